"""MoEMB's logical FLOPs model (spec moemb.md §3.0, paper Eq. 6-7 and App. C.1): what a forward costs given the
adaptive decisions of every token at every layer, and the saving S(a) against full compute.

Per text token t and decoder layer ℓ (every term a matrix product, 2 FLOPs per multiply-add):

    f_mixer(ℓ) = Gated DeltaNet: projections (qkv, z, β, decay, out) + causal conv + delta-rule recurrence
                 full attention: projections (query with its output gate, key, value, out) + 4·n_h·h_d·ctx
    f_sh       = 6·d·I_s + 2·d                     shared expert and its gate
    f_rt       = k_eff · 6·d·I + 2·d·E             the routed experts that run, and the router
    FLOPs      = f_vision + Σ_ℓ Σ_t α_tℓ [ f_mixer(ℓ) + f_sh + (1 − p^skip_tℓ − p^drop_tℓ) f_rt ]
    α_tℓ       = Π_{j<ℓ} (1 − p^drop_tj)           the probability that token t reaches layer ℓ
    S(a)       = 1 − FLOPs(a) / FLOPs(full compute)

`ctx` is the expected number of earlier tokens of the same sequence (itself included) that reach the layer. The
vision tower runs in full whatever the decisions. Norms, activations and other elementwise work are left out; so is
the embedding lookup. The decisions are probabilities (a learned gate's) or 0/1 (a heuristic's, a rollout's); with
none the model costs its full compute. At the A3B shapes one token costs, per layer: routed experts
8·6·2048·512 = 50.3 MFLOP, shared expert 6.3, router 1.05, Gated DeltaNet projections 67.4 (+3.2 conv and
recurrence), full-attention projections 54.5: the routed experts are ≈40% of the language model's FLOPs, so a 49.8%
expert skip saves ≈20% (Table 8: 19.8%).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..configuration.moemb import MoEmbConfig


@dataclass(frozen=True)
class TokenLayerFlops:
    """What one text token costs in each part of one decoder layer, from the config alone."""

    attention_projections: float  # q (with its output gate), k, v, o
    attention_per_key: float  # 4·n_h·h_d: scores and weighted values, per key attended
    gated_delta_net_projections: float  # in_proj_qkv, in_proj_z, in_proj_b (β), in_proj_a (decay), out_proj
    gated_delta_net_recurrence: float  # causal depthwise conv + delta rule (state read, rank-1 write, readout)
    shared_expert: float  # 6·d·I_s + 2·d (0 without a shared expert)
    routed_expert: float  # 6·d·I: one routed expert
    router: float  # 2·d·E (0 for fixed modality routes)
    experts_per_token: int  # k

    @classmethod
    def from_config(cls, config: MoEmbConfig) -> TokenLayerFlops:
        text = config.text_config
        d = text.hidden_size
        attention_width = text.num_attention_heads * text.head_dim
        key_value_width = text.num_key_value_heads * text.head_dim
        key_width = text.linear_num_key_heads * text.linear_key_head_dim
        value_width = text.linear_num_value_heads * text.linear_value_head_dim
        conv_width = 2 * key_width + value_width  # the causal conv runs over q, k and v
        shared = 6 * d * text.shared_expert_intermediate_size + 2 * d if config.use_shared_expert else 0
        return cls(
            attention_projections=2 * d * (2 * attention_width + 2 * key_value_width) + 2 * attention_width * d,
            attention_per_key=4 * attention_width,
            gated_delta_net_projections=(
                2 * d * (conv_width + value_width + 2 * text.linear_num_value_heads) + 2 * value_width * d
            ),
            gated_delta_net_recurrence=(
                2 * text.linear_conv_kernel_dim * conv_width
                + 3 * 2 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
            ),
            shared_expert=shared,
            routed_expert=6 * d * text.moe_intermediate_size,
            router=0 if config.moe_variant == "modality" else 2 * d * text.num_experts,
            experts_per_token=text.num_experts_per_tok,
        )


@dataclass
class TokenDecisions:
    """The adaptive actions of every text token at every layer, `(T, L)` each (tokens in packed order, as
    `cu_seqlens` lays them out); probabilities in [0, 1], or 0/1 decisions. None is full compute for that action.

    drop: p^drop_tℓ, the token skips the routed experts at ℓ and leaves every later layer.
    skip: p^skip_tℓ, the token skips the routed experts at ℓ (the shared expert still runs).
    experts_per_token: k_eff, the routed experts that run when the token routes (at most k).
    layer_skip: the token's sample bypasses block ℓ (spec §3.10): none of the block's work runs for it.
    """

    drop: torch.Tensor | None = None
    skip: torch.Tensor | None = None
    experts_per_token: torch.Tensor | None = None
    layer_skip: torch.Tensor | None = None

    def resolved(self, shape: tuple[int, int], top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(drop, skip, k_eff) as float64 `(T, L)` tensors, checked."""
        values = []
        for field, default in (("drop", 0.0), ("skip", 0.0), ("experts_per_token", float(top_k))):
            value = getattr(self, field)
            if value is None:
                value = torch.full(shape, default, dtype=torch.float64)
            value = torch.as_tensor(value).double().cpu()
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"TokenDecisions.{field} has shape {tuple(value.shape)}; expected (tokens, layers) = {shape}"
                )
            upper = top_k if field == "experts_per_token" else 1.0
            if not bool(((value >= 0) & (value <= upper)).all()):
                raise ValueError(f"TokenDecisions.{field} must lie in [0, {upper}]")
            values.append(value)
        drop, skip, _ = values
        if bool((drop + skip > 1 + 1e-9).any()):
            raise ValueError("TokenDecisions.skip + TokenDecisions.drop must not exceed 1: they are exclusive actions")
        return tuple(values)


@dataclass(frozen=True)
class ForwardFlops:
    """The logical FLOPs of one forward, by part."""

    vision: float = 0.0
    token_mixers: float = 0.0  # Gated DeltaNet and attention projections, conv and recurrence
    attention_context: float = 0.0  # 4·n_h·h_d per (query, key) pair of the full-attention layers
    shared_experts: float = 0.0
    routed_experts: float = 0.0
    routers: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, field.name) for field in fields(self))


def vision_flops(config: MoEmbConfig, grid_thw: torch.Tensor | None) -> float:
    """The vision tower on images or videos of `grid_thw` `(n, 3)` (temporal steps, height, width in patches): patch
    embedding, the blocks (attention within each temporal step) and the 2×2 merger."""
    if grid_thw is None:
        return 0.0
    vision = config.vision_config
    width, merged_width = vision.hidden_size, vision.hidden_size * vision.spatial_merge_size**2
    patch_input = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    per_patch = 2 * patch_input * width + vision.depth * (2 * width * 4 * width + 4 * width * vision.intermediate_size)
    per_merged_token = 2 * merged_width * merged_width + 2 * merged_width * vision.out_hidden_size
    total = 0.0
    for steps, height, width_patches in torch.as_tensor(grid_thw).tolist():
        frame = height * width_patches
        patches = steps * frame
        total += patches * (per_patch + vision.depth * 4 * width * frame)
        total += patches // vision.spatial_merge_size**2 * per_merged_token
    return float(total)


def logical_flops(
    config: MoEmbConfig,
    cu_seqlens: torch.Tensor,  # (B + 1,) bounds of the sequences in the T text tokens
    decisions: TokenDecisions | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> ForwardFlops:
    """The logical FLOPs of a forward over the sequences of `cu_seqlens` (spec Eq. 6-7): full compute without
    `decisions`."""
    cu_seqlens = torch.as_tensor(cu_seqlens).long().cpu()
    if (
        cu_seqlens.ndim != 1
        or cu_seqlens.numel() < 2
        or int(cu_seqlens[0]) != 0
        or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any())
    ):
        raise ValueError(f"cu_seqlens must be 0 followed by the non-decreasing end of every sequence, got {cu_seqlens}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    text = config.text_config
    costs = TokenLayerFlops.from_config(config)
    shape = (int(cu_seqlens[-1]), text.num_hidden_layers)
    decisions = decisions or TokenDecisions()
    drop, skip, experts = decisions.resolved(shape, costs.experts_per_token)
    bypassed = torch.zeros(shape, dtype=torch.float64)
    if decisions.layer_skip is not None:
        bypassed = torch.as_tensor(decisions.layer_skip).double().cpu()
        if tuple(bypassed.shape) != shape or not bool(((bypassed >= 0) & (bypassed <= 1)).all()):
            raise ValueError(f"TokenDecisions.layer_skip must be {shape} (tokens, layers) values in [0, 1]")

    # α_tℓ = Π_{j<ℓ} (1 − p^drop_tj): every token reaches the first layer.
    reach = torch.cat([torch.ones(shape[0], 1, dtype=torch.float64), torch.cumprod(1 - drop, dim=1)[:, :-1]], dim=1)
    # A bypassed block costs nothing; its tokens still reach the next one.
    runs = reach * (1 - bypassed)
    routed = runs * (1 - skip - drop)  # (T, L): expected routing of each token at each layer
    # ctx_tℓ: the expected number of tokens of t's sequence, up to t, that run ℓ (causal attention's keys).
    running = torch.cumsum(runs, dim=0)
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    before_sequence = torch.cat([torch.zeros(1, shape[1], dtype=torch.float64), running])[starts]
    context = running - before_sequence

    full_attention = torch.tensor([kind == "full_attention" for kind in text.layer_types])
    mixer_per_layer = torch.where(
        full_attention,
        float(costs.attention_projections),
        float(costs.gated_delta_net_projections + costs.gated_delta_net_recurrence),
    ).double()
    return ForwardFlops(
        vision=vision_flops(config, image_grid_thw) + vision_flops(config, video_grid_thw),
        token_mixers=float((runs.sum(0) * mixer_per_layer).sum()),
        attention_context=float(costs.attention_per_key * (runs * context)[:, full_attention].sum()),
        shared_experts=float(costs.shared_expert * runs.sum()),
        routed_experts=float(costs.routed_expert * (routed * experts).sum()),
        routers=float(costs.router * routed.sum()),
    )


def flops_saving(
    config: MoEmbConfig,
    cu_seqlens: torch.Tensor,
    decisions: TokenDecisions,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> float:
    """S(a) = 1 − FLOPs(a) / FLOPs(full compute) on the same inputs: 0 for full compute, at most 1."""
    visual = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
    adaptive = logical_flops(config, cu_seqlens, decisions, **visual).total
    full = logical_flops(config, cu_seqlens, None, **visual).total
    return 1.0 - adaptive / full
