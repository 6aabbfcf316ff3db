"""OmniMoE-VL's coupled visual-depth routed projector (spec omnimoe_vl.md §2.2-2.6, paper §3).

    V (B, S, N, d_V)  --P_s-->  V~ (B, S, N, d)                       one projection per depth (stream)
    prompt embeddings H_T, prompt_mask  -->  prototypes q (B, Q, d), participation p (B, Q)        Eq. 3
    p, q  -->  router queries t (B, R, d)                                                          Eq. 5
    t reads every V~_s  -->  depth scores r (B, S)  -->  route w = TopKSoftmax_k(z) (B, S)          Eq. 6-7
    w  -->  (a) group-local fusion weights g (B, n_groups, S)  -->  fused tokens Z (B, N, d)      Eq. 8-9
           (b) injection context: route, text factors U, visual factors B_s, coefficients beta     Eq. 10, 18
    RoutedInjection.apply(layer, h): h + eta * w_s * G_l T_s h before the anchor layer a(s)        Eq. 11, 17

The projector attention has no positional encoding: the route is invariant to the order of the prompt tokens and to
padding (spec §9.3). Routing math (softmaxes, top-k, prior, usage statistics, fusion alignment, diversity terms) runs
in fp32 whatever the model dtype, also under autocast (`autocast_off`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import create_block_mask
from transformers.activations import ACT2FN
from transformers.masking_utils import padding_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.siglip.modeling_siglip import eager_attention_forward
from transformers.utils import ModelOutput

from ..configuration.omnimoe_vl import OmniMoeVlConfig
from .moe.balancing import sum_over_processes
from .moe.precision import Fp32Linear, autocast_off
from .moe.router import is_recomputing


# --- routing math (paper Eq. 3, 4, 7, 12; spec §8) -------------------------------------------------------------------


def top_k_softmax(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Softmax over the k largest logits of the last dimension, zeros elsewhere (fp32). Ties go to the lower index
    (a stable descending sort, the same on every device; spec D29). Gradients reach the logits of the support only."""
    logits = logits.float()
    support = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, support, True)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def floored_participation(logits: torch.Tensor, floor: float) -> torch.Tensor:
    """Eq. 3: p = (1 - Q eps) softmax(u) + eps, a distribution with every entry >= eps."""
    num_prototypes = logits.shape[-1]
    return (1 - num_prototypes * floor) * torch.softmax(logits.float(), dim=-1) + floor


def effective_count(weights: torch.Tensor) -> torch.Tensor:
    """n_eff(p) = 1 / sum_i p_i^2, in [1, Q] (Eq. 4)."""
    return 1.0 / weights.float().square().sum(dim=-1)


def participation_target(prompt_lengths: torch.Tensor, offset: float, low: float, high: float) -> torch.Tensor:
    """n_tgt(L_T) = clip(ln(1 + L_T) + offset, low, high) (Eq. 4)."""
    return (torch.log1p(prompt_lengths.float()) + offset).clamp(low, high)


def depth_prior(usage: torch.Tensor, alpha: float, kernel_width: float) -> torch.Tensor:
    """Eq. 7's proximal prior p_bar = K (c + alpha) / 1^T K (c + alpha), with K_ij = exp(-(i - j)^2 / gamma)."""
    depths = torch.arange(usage.shape[-1], dtype=torch.float32, device=usage.device)
    kernel = torch.exp(-(depths[:, None] - depths[None, :]).square() / kernel_width)
    with autocast_off(usage):
        smoothed = kernel @ (usage.float() + alpha)
    return smoothed / smoothed.sum()


def underuse_bonus(usage: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 7's bonus b_s(c) = (c_s + eps)^(-1/2) / mean_j (c_j + eps)^(-1/2): mean 1, larger for rarely used depths."""
    inverse = (usage.float() + eps).rsqrt()
    return inverse / inverse.mean()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, d), (B, L) -> (B, d): the mean over the masked positions, 0 where a row has none."""
    weights = mask.to(values.dtype).unsqueeze(-1)
    return (values * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


# --- routing objectives (spec §3.1; paper A.3) -----------------------------------------------------------------------

# The route's objectives (`OmniMoeVlProjector.routing_objectives`), by name.
ROUTING_OBJECTIVES = ("query_budget", "query_entropy", "query_diversity", "router_query_diversity", "router_utility",
                      "depth_balance", "adapter_factor")


def annealed_scale(step: int, min_scale: float, anneal_steps: int) -> float:
    """The linear schedule of an annealed loss weight: 1 at step 0, falling to `min_scale` at `anneal_steps`, then
    held (spec §3.1; the linear shape is spec D12's)."""
    if step >= anneal_steps:
        return min_scale
    return 1.0 - (1.0 - min_scale) * step / anneal_steps


def mean_squared_cosine(vectors: torch.Tensor) -> torch.Tensor:
    """(B, M, d) -> (): mean over i != j of cos(v_i, v_j)^2, averaged over the batch (L_div, L_rdiv; spec D12)."""
    count = vectors.shape[1]
    if count < 2:
        return vectors.new_zeros((), dtype=torch.float32)
    unit = F.normalize(vectors.float(), dim=-1)
    with autocast_off(unit):
        squared = (unit @ unit.transpose(1, 2)).square()  # (B, M, M)
    off_diagonal = squared.sum(dim=(1, 2)) - squared.diagonal(dim1=1, dim2=2).sum(dim=-1)
    return (off_diagonal / (count * (count - 1))).mean()


def normalised_entropy(weights: torch.Tensor) -> torch.Tensor:
    """(B, Q) distributions -> (B,): H(p) / ln Q, in [0, 1]."""
    return -torch.special.xlogy(weights, weights).sum(dim=-1) / math.log(weights.shape[-1])


def depth_balance(route: torch.Tensor, scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """L_bal = S sum_s f_s P_s (Switch style, spec D12): f_s the batch fraction of route slots on depth s (the route
    actually taken, exploration included), P_s the batch mean of softmax(r / T)_s. 1 when both are uniform.

    f_s (no gradient) counts the slots of every data-parallel process, P_s this process's samples: processes holding
    as many samples each then average to the loss and gradients of one process on the global batch."""
    slots = sum_over_processes((route > 0).float().sum(dim=0))
    fraction = slots / slots.sum()
    probability = torch.softmax(scores.float() / temperature, dim=-1).mean(dim=0)
    return route.shape[-1] * (fraction * probability).sum()


def utility_supervision(lm_loss: torch.Tensor, route: torch.Tensor, scores: torch.Tensor, temperature: float):
    """L_util = KL(pi || softmax(r / T)), pi = softmax(g / std(g)) with g = -dL_LM/dw, the first-order utility of each
    depth (Eq. 13; spec D12), held constant. One more backward through the language model (`autograd.grad`, which
    leaves the parameters' gradients alone). Off the route's support w_s is 0, but the injection still reads stream
    s, so its utility is defined there too. None when the loss does not depend on the route (a frozen projector, or
    a `route_override` of both uses)."""
    if not route.requires_grad:
        return None
    (gradient,) = torch.autograd.grad(lm_loss, route, retain_graph=True, allow_unused=True)
    if gradient is None:
        return None
    utility = -gradient.float()
    target = torch.softmax(utility / utility.std(dim=-1, keepdim=True).clamp(min=1e-12), dim=-1)
    log_probability = torch.log_softmax(scores.float() / temperature, dim=-1)
    return F.kl_div(log_probability, target, reduction="batchmean")


# --- outputs ---------------------------------------------------------------------------------------------------------


@dataclass
class OmniMoeVlRoutingContext(ModelOutput):
    r"""What the language layers need of one image-prompt pair, computed once at prefill and reused at every decode
    step (paper A.2; spec §2.6.4). Each row belongs to one sample; beams of a sample share their rows.

    route (`(batch_size, num_streams)` fp32): the injection weights w (the sample's route, or an override).
    text_factors (`(batch_size, injection_rank, hidden_size)`): U^T, the prompt-derived read directions / sqrt(d).
    visual_factors (`(batch_size, num_streams, injection_rank, hidden_size)`): B_s^T, the visual write directions
        of each stream / sqrt(d).
    coefficients (`(batch_size, num_streams, injection_rank)` fp32): beta_s, one distribution per stream (Eq. 18).
    """

    route: torch.Tensor | None = None
    text_factors: torch.Tensor | None = None
    visual_factors: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None


@dataclass
class OmniMoeVlProjectorOutput(ModelOutput):
    r"""
    fused_tokens (`(batch_size, num_patches, hidden_size)`): Z, the tokens that replace the image placeholders.
    routing_context (`OmniMoeVlRoutingContext`): the injection context.
    depth_route (`(batch_size, num_streams)` fp32): w, top-k sparse (the sample's own route, before any override).
    depth_scores (`(batch_size, num_streams)` fp32): r, the content scores of Eq. 6.
    query_weights (`(batch_size, num_query_prototypes)` fp32): p, the participation weights of Eq. 3.
    fusion_weights (`(batch_size, num_groups, num_streams)` fp32): g, the group-local weights of Eq. 9.
    prototypes (`(batch_size, num_query_prototypes, hidden_size)`): q; router_queries (`(batch_size,
        num_router_queries, hidden_size)`): t. Both feed the auxiliary losses.
    prompt_lengths (`(batch_size,)`): L_T, the number of prompt tokens.
    """

    fused_tokens: torch.Tensor | None = None
    routing_context: OmniMoeVlRoutingContext | None = None
    depth_route: torch.Tensor | None = None
    depth_scores: torch.Tensor | None = None
    query_weights: torch.Tensor | None = None
    fusion_weights: torch.Tensor | None = None
    prototypes: torch.Tensor | None = None
    router_queries: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None


# --- building blocks -------------------------------------------------------------------------------------------------


class OmniMoeVlCrossAttention(nn.Module):
    """Multi-head cross-attention without bias or positions (spec D6): queries (B, M, d) read keys/values (B, L, d),
    width `projector_attn_dim`, through transformers' attention interface (`config._attn_implementation`)."""

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        self.config = config
        hidden_size = config.text_config.hidden_size
        self.num_heads = config.projector_attn_heads
        self.head_dim = config.projector_attn_dim // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.num_key_value_groups = 1
        self.q_proj = nn.Linear(hidden_size, config.projector_attn_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, config.projector_attn_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, config.projector_attn_dim, bias=False)
        self.o_proj = nn.Linear(config.projector_attn_dim, hidden_size, bias=False)

    def forward(
        self,
        queries: torch.Tensor,  # (B, M, d)
        keys_values: torch.Tensor,  # (B, L, d)
        key_mask: torch.Tensor | None = None,  # (B, L) bool, True = attend; None = all
    ) -> torch.Tensor:  # (B, M, d)
        batch, num_queries, _ = queries.shape
        query = self.q_proj(queries).view(batch, num_queries, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(keys_values).view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(keys_values).view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)
        attention_mask = None
        if key_mask is not None and self.config._attn_implementation == "flex_attention":
            # flex attention takes a BlockMask; an additive tensor would be read inside its score function, which
            # torch's CPU kernels mis-index for these short query lengths.
            attention_mask = create_block_mask(padding_mask_function(key_mask), B=batch, H=None, Q_LEN=num_queries,
                                               KV_LEN=key_mask.shape[1], device=query.device)
        elif key_mask is not None:  # additive (B, 1, 1, L): what eager and sdpa both take
            attention_mask = torch.zeros(key_mask.shape, dtype=query.dtype, device=query.device)
            attention_mask = attention_mask.masked_fill(~key_mask, torch.finfo(query.dtype).min)[:, None, None, :]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        output, _ = attention(self, query, key, value, attention_mask, scaling=self.scaling, dropout=0.0)
        return self.o_proj(output.reshape(batch, num_queries, -1))


class OmniMoeVlStreamProjection(nn.Module):
    """P_s = Linear(d, d) . GELU . Linear(d_V, d) . LayerNorm(d_V): LLaVA's two-layer projector with a pre-norm
    (spec D5), one per depth."""

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        vision_size, hidden_size = config.vision_config.hidden_size, config.text_config.hidden_size
        self.norm = nn.LayerNorm(vision_size, eps=config.vision_config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(vision_size, hidden_size)
        self.act_fn = ACT2FN["gelu"]
        self.linear_fc2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:  # (B, N, d_V) -> (B, N, d)
        return self.linear_fc2(self.act_fn(self.linear_fc1(self.norm(stream))))


class OmniMoeVlDepthScore(nn.Module):
    """f_s: Linear(d, h_f) -> GELU -> Linear(h_f, 1), one per depth (spec D7)."""

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        # fp32 layers, under autocast too: the scores are the depth route's logits.
        self.fc1 = Fp32Linear(config.text_config.hidden_size, config.depth_score_hidden)
        self.act_fn = ACT2FN["gelu"]
        self.fc2 = Fp32Linear(config.depth_score_hidden, 1)

    def forward(self, readout: torch.Tensor) -> torch.Tensor:  # (B, d) -> (B,) fp32
        return self.fc2(self.act_fn(self.fc1(readout))).squeeze(-1)


class OmniMoeVlDepthRouter(nn.Module):
    """The global depth route w from the scores r (Eq. 7), with the exploration state.

    Buffers (persistent, fp32 whatever the model dtype: bf16 cannot hold an EMA's small steps):
        depth_usage_ema (S,): c, the EMA of how many samples per batch route to each depth.
        routing_step (): optimizer steps so far, advanced by the training callback (not by forward, so gradient
            accumulation does not speed up the schedules; spec D11).
    In `train()` and while `routing_step < exploration_steps`, z adds the proximal prior, the underuse bonus and
    Gaussian noise to r / T, and each forward updates c; otherwise, and always in `eval()`, z = r / T and nothing
    changes. The noise of a forward comes from a generator seeded by the routing step and the number of forwards
    already run in that step: every process draws the same noise (spec D30), that of the global batch (world size x
    its batch rows), and keeps its own rows, so data-parallel processes route as one process on the global batch;
    a run resumed from a checkpoint (which holds `routing_step`) draws what the uninterrupted run drew.
    """

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        self.config = config
        self.register_buffer("depth_usage_ema", torch.zeros(config.num_streams, dtype=torch.float32))
        self.register_buffer("routing_step", torch.zeros((), dtype=torch.int64))
        self._noise_step, self._noise_draws = -1, 0  # the routing step of the last noise, and draws in that step

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts floating buffers: keep the usage EMA fp32, cast from its fp32 values.
        usage = self.depth_usage_ema
        super()._apply(fn, recurse)
        if self.depth_usage_ema.dtype != torch.float32:
            self.depth_usage_ema = usage.to(self.depth_usage_ema.device, torch.float32)
        return self

    @property
    def exploring(self) -> bool:
        return self.training and int(self.routing_step) < self.config.exploration_steps

    def forward(self, scores: torch.Tensor) -> torch.Tensor:  # r (B, S) -> w (B, S) fp32
        config = self.config
        logits = scores.float() / config.depth_temperature
        if config.depth_router == "dense":  # the "-R" ablation: every depth, no top-k, no exploration
            return torch.softmax(logits, dim=-1)
        if not self.exploring:
            return top_k_softmax(logits, config.depth_top_k)
        usage = self.depth_usage_ema
        noise = self._exploration_noise(logits.shape).to(logits.device)
        logits = (
            logits
            + config.prior_coef * torch.log(depth_prior(usage, config.prior_dirichlet_alpha, config.prior_kernel_width))
            + config.underuse_bonus_coef * underuse_bonus(usage, config.underuse_eps)
            + config.exploration_noise_std * noise
        ) / (config.prior_coef + config.route_entropy_coef)  # Prop. 2's temperature lambda_h + lambda_e
        route = top_k_softmax(logits, config.depth_top_k)
        if not is_recomputing():
            self._update_usage(route)
        return route

    def _exploration_noise(self, shape: torch.Size) -> torch.Tensor:
        step = int(self.routing_step)
        if step != self._noise_step:
            self._noise_step, self._noise_draws = step, 0
        generator = torch.Generator().manual_seed((step << 20) + self._noise_draws)
        self._noise_draws += 1
        rank, world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        rows = shape[0]
        return torch.randn((world_size * rows, *shape[1:]), generator=generator)[rank * rows : (rank + 1) * rows]

    @torch.no_grad()
    def _update_usage(self, route: torch.Tensor) -> None:
        # n_s: samples whose route holds depth s; every rank keeps the same c, hence routes alike (spec D30)
        counts = sum_over_processes((route > 0).float().sum(dim=0))
        decay = self.config.usage_ema_decay
        self.depth_usage_ema.mul_(decay).add_((1 - decay) * counts)


class OmniMoeVlQuerySynthesis(nn.Module):
    """Prompt-conditioned prototypes q, participation p and router queries t (Eq. 3-5, A.2; spec §2.3)."""

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        self.config = config
        hidden_size = config.text_config.hidden_size
        self.prompt_norm = nn.LayerNorm(hidden_size)
        # An always-valid key/value, so that an empty prompt still gives finite attention (spec D9).
        self.prompt_null = nn.Parameter(torch.zeros(hidden_size))
        self.query_bank = nn.Parameter(torch.zeros(config.num_query_prototypes, hidden_size))  # C
        self.query_attn = OmniMoeVlCrossAttention(config)
        self.query_norm = nn.LayerNorm(hidden_size)
        # The participation gate's layers, fp32 under autocast too (`gate_logits`).
        self.gate_score = Fp32Linear(hidden_size, 1, bias=False)  # a
        self.gate_context = Fp32Linear(hidden_size, hidden_size, bias=False)  # W_c
        self.gate_bias = nn.Parameter(torch.zeros(config.num_query_prototypes))  # b
        self.router_mix = nn.Parameter(torch.zeros(config.num_router_queries, config.num_query_prototypes))  # M

    def gate_logits(
        self, prototypes: torch.Tensor, seeds: torch.Tensor, prompt: torch.Tensor, prompt_mask: torch.Tensor
    ) -> torch.Tensor:
        """u (B, Q) fp32, under autocast too (the participation gate's logits), from the prototypes q (B, Q, d), their
        seeds C (B, Q, d) and the normalised prompt (B, L, d) with its mask (B, L):
        u_i = a.q_i + q_i^T W_c h_T / sqrt(d) + q_i^T C_i / sqrt(d) + b_i  (A.2; shared per-sample shifts omitted)."""
        scale = math.sqrt(prototypes.shape[-1])
        context = self.gate_context(masked_mean(prompt, prompt_mask))  # (B, d)
        with autocast_off(prototypes):
            prototypes, seeds = prototypes.float(), seeds.float()
            return (
                self.gate_score(prototypes).squeeze(-1)
                + torch.einsum("bqd,bd->bq", prototypes, context) / scale
                + (prototypes * seeds).sum(-1) / scale
                + self.gate_bias.float()
            )

    def forward(
        self, prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor  # (B, L, d), (B, L) bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the normalised prompt H_T (B, L + 1, d) with its key mask (B, L + 1), the prototypes q (B, Q, d),
        the participation p (B, Q) fp32 and the router queries t (B, R, d)."""
        config = self.config
        batch, _, hidden_size = prompt_embeds.shape
        prompt = torch.cat([self.prompt_norm(prompt_embeds), self.prompt_null.expand(batch, 1, hidden_size)], dim=1)
        key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, 1)], dim=1)
        seeds = self.query_bank.expand(batch, -1, -1)
        prototypes = self.query_norm(self.query_attn(seeds, prompt, key_mask) + config.query_residual_scale * seeds)

        logits = self.gate_logits(prototypes, seeds, prompt[:, :-1], prompt_mask)
        if config.query_gate == "participation":
            participation = floored_participation(logits, config.query_floor)
        elif config.query_gate == "softmax":
            participation = torch.softmax(logits.float(), dim=-1)
        else:  # "none": the "-Q" ablation, uniform prototypes
            participation = torch.full_like(logits, 1 / config.num_query_prototypes, dtype=torch.float32)
        # Eq. 5: alpha_ri = softmax_i((M_ri + log p_i) / tau_q); t_r = sum_i alpha_ri q_i
        mixing = torch.softmax(
            (self.router_mix.float() + torch.log(participation)[:, None, :]) / config.query_mix_temperature, dim=-1
        )
        router_queries = torch.einsum("brq,bqd->brd", mixing.to(prototypes.dtype), prototypes)
        return prompt, key_mask, prototypes, participation, router_queries


class OmniMoeVlInjection(nn.Module):
    """The routed low-rank injection (Eq. 10, 11, 17, 18; spec §2.6): its parameters, the per-sample context, and
    the update applied before each anchor layer.

    Parameters (stream s anchors at `injection_layers[s]`, one stream per anchor):
        text_bank (r_T, d), text_attn, text_norm: R_U, the prompt's read directions.
        visual_bank (S, r_T, d), visual_attn (shared over streams), visual_norm: R_{B,s}, each stream's write
            directions (spec D13).
        adapter_down (S, r_G, d), adapter_up (S, d, r_G): G_l = up @ down.
        gate (S,): the anchor's global gain, initialised to `injection_gate_init` (0: no injection at conversion).
        type_gain (S, 2): the (text, visual) token gains.
    """

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        self.config = config
        hidden_size, rank, streams = config.text_config.hidden_size, config.injection_rank, config.num_streams
        self.text_bank = nn.Parameter(torch.zeros(rank, hidden_size))
        self.text_attn = OmniMoeVlCrossAttention(config)
        self.text_norm = nn.LayerNorm(hidden_size)
        self.visual_bank = nn.Parameter(torch.zeros(streams, rank, hidden_size))
        self.visual_attn = OmniMoeVlCrossAttention(config)
        self.visual_norm = nn.LayerNorm(hidden_size)
        self.adapter_down = nn.Parameter(torch.zeros(streams, config.adapter_rank, hidden_size))
        self.adapter_up = nn.Parameter(torch.zeros(streams, hidden_size, config.adapter_rank))
        self.gate = nn.Parameter(torch.full((streams,), float(config.injection_gate_init)))
        self.type_gain = nn.Parameter(torch.ones(streams, 2))

    def context(
        self,
        prompt: torch.Tensor,  # (B, L + 1, d) normalised prompt with the null key
        key_mask: torch.Tensor,  # (B, L + 1) bool
        streams: torch.Tensor,  # V~ (B, S, N, d)
        route: torch.Tensor,  # (B, S) fp32
    ) -> OmniMoeVlRoutingContext:
        batch, num_streams, num_patches, hidden_size = streams.shape
        rank = self.config.injection_rank
        text = self.text_norm(self.text_attn(self.text_bank.expand(batch, -1, -1), prompt, key_mask))  # (B, r, d)
        visual_queries = self.visual_bank.expand(batch, -1, -1, -1).reshape(batch * num_streams, rank, hidden_size)
        visual = self.visual_attn(visual_queries, streams.reshape(batch * num_streams, num_patches, hidden_size))
        visual = self.visual_norm(visual).view(batch, num_streams, rank, hidden_size)  # (B, S, r, d)
        scale = math.sqrt(hidden_size)
        # Eq. 18: beta_{s,j} = softmax_j(u_j . b_{s,j} / sqrt(d)), from the unscaled (norm ~ sqrt(d)) directions
        coefficients = torch.softmax((text[:, None] * visual).sum(-1).float() / scale, dim=-1)
        return OmniMoeVlRoutingContext(route, text / scale, visual / scale, coefficients)

    def residual(
        self,
        stream: int,
        hidden_states: torch.Tensor,  # (B, L, d)
        context: OmniMoeVlRoutingContext,
        visual_token_mask: torch.Tensor | None,  # (B, L) bool, True on image tokens
    ) -> torch.Tensor:  # Delta (B, L, d)
        dtype = hidden_states.dtype
        coordinates = hidden_states @ context.text_factors.transpose(1, 2)  # (B, L, r): read along U
        coordinates = coordinates * context.coefficients[:, stream, None, :].to(dtype)
        residual = coordinates @ context.visual_factors[:, stream]  # (B, L, d): T_s h (Eq. 17)
        residual = (residual @ self.adapter_down[stream].T) @ self.adapter_up[stream].T  # G_l T_s h
        residual = context.route[:, stream, None, None].to(dtype) * residual  # w_s; 0 off the route's support
        max_relative_norm = self.config.injection_max_relative_norm
        if max_relative_norm is not None:  # per-token clamp ||delta|| <= rho_max ||h||
            ratio = max_relative_norm * hidden_states.norm(dim=-1, keepdim=True) / (
                residual.norm(dim=-1, keepdim=True) + 1e-6
            )
            residual = residual * ratio.clamp(max=1.0)
        if visual_token_mask is None:
            gain = self.type_gain[stream, 0]
        else:
            gain = self.type_gain[stream][visual_token_mask.long()].unsqueeze(-1)  # (B, L, 1)
        return self.gate[stream] * gain * residual


@dataclass
class RoutedInjection:
    """The injection of one forward: the module, the sample's context and which tokens are image tokens. The
    language model calls `apply(layer_idx, hidden_states)` before each decoder layer; it adds nothing before the
    layers that anchor no stream."""

    module: OmniMoeVlInjection
    context: OmniMoeVlRoutingContext
    visual_token_mask: torch.Tensor | None  # (B, L) bool
    stream_of_layer: dict[int, int]

    def apply(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        stream = self.stream_of_layer.get(layer_idx)
        if stream is None:
            return hidden_states
        return hidden_states + self.module.residual(stream, hidden_states, self.context, self.visual_token_mask)


# --- the projector ---------------------------------------------------------------------------------------------------


class OmniMoeVlProjector(nn.Module):
    """The coupled visual-depth routed projector (paper §3; parameter names of spec §2.0.3)."""

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__()
        self.config = config
        hidden_size = config.text_config.hidden_size
        self.stream_proj = nn.ModuleList(OmniMoeVlStreamProjection(config) for _ in range(config.num_streams))
        self.queries = OmniMoeVlQuerySynthesis(config)
        self.depth_attn = nn.ModuleList(OmniMoeVlCrossAttention(config) for _ in range(config.num_streams))
        self.depth_score = nn.ModuleList(OmniMoeVlDepthScore(config) for _ in range(config.num_streams))
        self.depth_router = OmniMoeVlDepthRouter(config)
        self.fusion_norm = nn.LayerNorm(hidden_size)
        # Image tokens start at the scale of the text embeddings; conversion sets it from embed_tokens (spec D15).
        self.fusion_output_scale = nn.Parameter(torch.ones(()))
        self.injection = OmniMoeVlInjection(config)

    def forward(
        self,
        streams: torch.Tensor,  # V (B, S, N, d_V): the vision tower's hidden states at the taps
        prompt_embeds: torch.Tensor,  # (B, L, d): input embeddings of the whole sequence, before image scattering
        prompt_mask: torch.Tensor,  # (B, L) 0/1: the question tokens of the image's turn
        route_override: dict[str, torch.Tensor | None] | None = None,
    ) -> OmniMoeVlProjectorOutput:
        config = self.config
        streams = torch.stack([project(streams[:, s]) for s, project in enumerate(self.stream_proj)], dim=1)  # V~
        prompt_mask = prompt_mask.bool()
        prompt, key_mask, prototypes, participation, router_queries = self.queries(prompt_embeds, prompt_mask)

        # Eq. 6: d_s = mean_r Attn_s(t, V~_s, V~_s)_r; r_s = f_s(d_s)
        scores = torch.stack(
            [score(attend(router_queries, streams[:, s]).mean(dim=1))
             for s, (attend, score) in enumerate(zip(self.depth_attn, self.depth_score))],
            dim=-1,
        )  # (B, S)
        route = self.depth_router(scores)
        fusion_route, injection_route = self._overridden_routes(route, route_override)

        fused, fusion_weights = self.fuse(streams, router_queries, fusion_route)
        context = self.injection.context(prompt, key_mask, streams, injection_route)
        return OmniMoeVlProjectorOutput(
            fused_tokens=fused,
            routing_context=context,
            depth_route=route,
            depth_scores=scores.float(),
            query_weights=participation,
            fusion_weights=fusion_weights,
            prototypes=prototypes,
            router_queries=router_queries,
            prompt_lengths=prompt_mask.sum(dim=-1),
        )

    def fuse(
        self, streams: torch.Tensor, router_queries: torch.Tensor, route: torch.Tensor  # (B,S,N,d), (B,R,d), (B,S)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 8-9: group-local top-k weights with the route as log-prior, and the fused tokens Z (B, N, d) in patch
        order, with the group weights g (B, n_groups, S). The last group is shorter when N is not a multiple of the
        group size (spec D17)."""
        config = self.config
        batch, num_streams, num_patches, hidden_size = streams.shape
        group_of_patch = torch.arange(num_patches, device=streams.device) // config.fusion_group_size
        num_groups = int(group_of_patch[-1]) + 1
        group_sums = streams.new_zeros(batch, num_streams, num_groups, hidden_size)
        group_sums = group_sums.index_add_(2, group_of_patch, streams)
        group_means = F.normalize(group_sums.float(), dim=-1)  # the mean's direction: the count cancels
        summary = F.normalize(router_queries.float().mean(dim=1), dim=-1)  # t_bar (B, d)
        with autocast_off(summary):
            alignment = torch.einsum("bsgd,bd->bgs", group_means, summary)  # c_{b,s} in [-1, 1]
        prior = torch.log(route.float().clamp(min=config.fusion_log_floor))[:, None, :]
        weights = top_k_softmax(alignment / config.fusion_temperature + prior, config.fusion_top_k)  # (B, G, S)
        per_patch = weights[:, group_of_patch].to(streams.dtype)  # (B, N, S)
        fused = self.fusion_norm(torch.einsum("bns,bsnd->bnd", per_patch, streams))
        return self.fusion_output_scale * fused, weights

    def _overridden_routes(
        self, route: torch.Tensor, route_override: dict[str, torch.Tensor | None] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routes fusion and injection use: the sample's own, or those of `route_override` (spec §9.6,
        Table 5b: `{"fusion": w_u, "injection": w_v}`, each (B, S) or None)."""
        if not route_override:
            return route, route
        unknown = set(route_override) - {"fusion", "injection"}
        if unknown:
            raise ValueError(
                f"route_override has keys {sorted(unknown)}; it takes 'fusion' and 'injection', each a (batch, "
                f"{self.config.num_streams}) route or None"
            )
        routes = []
        for use in ("fusion", "injection"):
            override = route_override.get(use)
            if override is None:
                routes.append(route)
                continue
            if override.shape != route.shape or not torch.isfinite(override).all() or (override < 0).any():
                raise ValueError(
                    f"route_override[{use!r}] must be a finite, non-negative tensor of depth weights shaped (batch, "
                    f"num_streams) = {tuple(route.shape)}, got shape {tuple(override.shape)}"
                )
            routes.append(override.to(device=route.device, dtype=torch.float32))
        return routes[0], routes[1]

    def routing_objectives(self, outputs, lm_loss: torch.Tensor) -> dict[str, tuple[float, torch.Tensor]]:
        """The auxiliary objectives of spec §3.1 that train the route, as `{name: (weight, unweighted term)}`, from a
        training forward's outputs (`query_weights`, `prompt_lengths`, `prototypes`, `router_queries`,
        `depth_route`, `depth_scores`) and its language-model loss. The weights follow their schedules at this
        router's `routing_step`; terms of weight 0 are not computed. The "-Q" ablation (`query_gate="none"`, uniform
        p) has no participation, entropy nor prototype-diversity term (spec D12).

            query_budget         L_q    (n_eff(p) - n_tgt(L_T))^2, batch mean (Eq. 4)    annealed 1 -> min_scale
            query_entropy        L_ent  -sign H(p) / ln Q (sign +1 favours spread)         annealed 1 -> min_scale
            query_diversity      L_div  mean_{i!=j} cos(q_i, q_j)^2
            router_query_diversity  L_rdiv  mean_{r!=r'} cos(t_r, t_r')^2
            router_utility       L_util KL(pi || softmax(r / T)) (`router_utility="grad"`; one more backward)
            depth_balance        L_bal  S sum_s f_s P_s                                     annealed 1 -> min_scale
            adapter_factor       L_fac  1/2 sum_l ||up_l||_F^2 + ||down_l||_F^2 (C.3)
        """
        config = self.config
        step = int(self.depth_router.routing_step)
        participation = outputs.query_weights
        gated = config.query_gate != "none"  # "-Q" has no participation to regularise
        weights = {
            "query_budget": config.query_budget_coef * annealed_scale(
                step, config.query_budget_min_scale, config.query_budget_anneal_steps) if gated else 0.0,
            "query_entropy": config.query_entropy_coef * annealed_scale(
                step, config.query_entropy_min_scale, config.query_entropy_anneal_steps) if gated else 0.0,
            "query_diversity": config.query_diversity_coef if gated else 0.0,
            "router_query_diversity": config.router_query_diversity_coef,
            "router_utility": config.router_utility_coef if config.router_utility == "grad" else 0.0,
            "depth_balance": config.depth_balance_coef * annealed_scale(
                step, config.depth_balance_min_scale, config.depth_balance_anneal_steps),
            "adapter_factor": config.adapter_factor_reg_coef,
        }  # fmt: skip
        terms = {
            "query_budget": lambda: (
                effective_count(participation)
                - participation_target(outputs.prompt_lengths, config.participation_target_offset,
                                       config.participation_target_min, config.participation_target_max)
            ).square().mean(),
            "query_entropy": lambda: -config.query_entropy_sign * normalised_entropy(participation).mean(),
            "query_diversity": lambda: mean_squared_cosine(outputs.prototypes),
            "router_query_diversity": lambda: mean_squared_cosine(outputs.router_queries),
            "router_utility": lambda: utility_supervision(
                lm_loss, outputs.depth_route, outputs.depth_scores, config.depth_temperature),
            "depth_balance": lambda: depth_balance(outputs.depth_route, outputs.depth_scores, config.depth_temperature),
            "adapter_factor": lambda: 0.5 * (
                self.injection.adapter_up.float().square().sum() + self.injection.adapter_down.float().square().sum()),
        }  # fmt: skip
        objectives = {}
        for name in ROUTING_OBJECTIVES:
            weight = weights[name]
            term = terms[name]() if weight else None
            if term is not None:
                objectives[name] = (float(weight), term)
        return objectives
