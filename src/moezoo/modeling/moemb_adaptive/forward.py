"""One adaptive forward of MoEMB (spec §3.0): the per-token metadata, the decisions each layer takes (tokens dropped
after a Gated DeltaNet block, tokens that skip their routed experts, routed slots dropped), and the report of what
they saved, in logical FLOPs (`moemb_flops`, Eq. 6-7) and realised rates per layer and modality.

Masked execution: skipped experts and dropped slots get a routing weight of 0. Dropped tokens are removed from the
`(B, S)` rows (each row's survivors moved to its front, in order, with their original positions), so later Gated
DeltaNet layers see the sequence without them, as physical removal does (spec A-18); the output keeps the input's
layout, a dropped token's hidden state being the one it left with.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ...configuration.moemb_adaptive import AdaptiveSettings
from ..moemb_flops import ForwardFlops, TokenDecisions, logical_flops
from .packed import compacted_experts
from .routing import apply_slot_mask, edited_routing, modes_slots, threshold_slots, uniform_top_k
from .selection import keep_highest, lowest_fraction, otsu_split
from .trained import TrainedActions


BETA_SKIPS = ("beta_rank", "beta_threshold", "otsu_beta")


@dataclass
class TokenMetadata:
    """What the adaptive actions know of every token, `(B, S)` in the current layout (packed: B = 1)."""

    modality: torch.Tensor  # long: 0 text, 1 image, 2 video (`mm_token_type_ids`)
    is_pooled: torch.Tensor  # bool: the token the embedding is read from; never dropped, never skips its experts
    segment_id: torch.Tensor  # long: the item (row, or packed segment) the token belongs to
    original_index: torch.Tensor  # long: the token's position in its input row
    position_ids: torch.Tensor  # (3, B, S) long: its original MRoPE positions
    alive: torch.Tensor  # bool: a real (non-padding) token still in the forward

    @classmethod
    def from_inputs(
        cls,
        mm_token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        pooled_index: torch.Tensor | None,
        segment_ids: torch.Tensor | None,  # (T,) of a packed row
    ) -> TokenMetadata:
        batch, length = mm_token_type_ids.shape
        device = mm_token_type_ids.device
        alive = torch.ones((batch, length), dtype=torch.bool, device=device)
        if attention_mask is not None:
            alive = attention_mask.bool()
        positions = torch.arange(length, device=device)
        if segment_ids is not None:
            segment_id = segment_ids[None]
        else:
            segment_id = torch.arange(batch, device=device)[:, None].expand(batch, length)
        if pooled_index is None:  # each item's last real token
            last = torch.full((int(segment_id.max()) + 1,), -1, dtype=torch.long, device=device)
            flat_positions = (positions[None] + length * torch.arange(batch, device=device)[:, None])[alive]
            pooled_index = last.scatter_reduce(0, segment_id[alive], flat_positions, reduce="amax")
            is_pooled = torch.zeros(batch * length, dtype=torch.bool, device=device)
            is_pooled[pooled_index] = True
            is_pooled = is_pooled.view(batch, length)
        elif segment_ids is not None:
            is_pooled = torch.zeros((1, length), dtype=torch.bool, device=device)
            is_pooled[0, pooled_index] = True
        else:
            is_pooled = positions[None] == pooled_index[:, None]
        return cls(
            modality=mm_token_type_ids.long(),
            is_pooled=is_pooled,
            segment_id=segment_id,
            original_index=positions[None].expand(batch, length),
            position_ids=position_ids,
            alive=alive,
        )

    def gather(self, index: torch.Tensor, alive: torch.Tensor) -> TokenMetadata:
        """The metadata of the tokens at `index` `(B, S')` of every row, `alive` their new liveness."""
        return TokenMetadata(
            modality=self.modality.gather(1, index),
            is_pooled=self.is_pooled.gather(1, index) & alive,
            segment_id=self.segment_id.gather(1, index),
            original_index=self.original_index.gather(1, index),
            position_ids=self.position_ids.gather(2, index[None].expand(3, -1, -1)),
            alive=alive,
        )


@dataclass
class AdaptiveReport:
    """What an adaptive forward did and saved. Rates are `(num_layers, 3)` float (text, image, video; NaN where the
    batch has no token of that modality), over the real tokens that reach each layer."""

    flops: ForwardFlops  # the logical FLOPs of this forward
    full_flops: ForwardFlops  # the same inputs at full compute
    flops_saving: float  # S(a) = 1 - flops / full_flops
    token_drop_rate: torch.Tensor  # tokens removed from the forward at the layer
    expert_skip_rate: torch.Tensor  # tokens that run no routed expert at the layer (skipped or dropped there)
    slot_skip_rate: torch.Tensor  # routed slots (k per token) not executed
    routed_slots: float  # k per token and layer it reaches: the slots of full compute
    executed_slots: float  # the routed slots executed
    decisions: TokenDecisions  # per real token (row-major) and layer, what the FLOPs were counted from
    # With the trained gates: (B,) S(a) of every sample (item) on its own, and (B, L) the blocks each one bypassed.
    sample_flops_saving: torch.Tensor | None = None
    layer_skipped: torch.Tensor | None = None

    @property
    def slot_skip_ratio(self) -> float:
        """The share of routed slots not executed, over every layer and modality."""
        return 1.0 - self.executed_slots / self.routed_slots


def beta_of(linear_attn: torch.nn.Module, mixer_input: torch.Tensor) -> torch.Tensor:
    """β = sigmoid(in_proj_b(x)) of a Gated DeltaNet layer averaged over its heads (spec §2.1), `(B, S)` float."""
    return torch.sigmoid(linear_attn.in_proj_b(mixer_input).float()).mean(-1)


class AdaptiveForward:
    """The decisions of one forward. The decoder layers call `read_beta` (on the token mixer's input) and `routing`
    (around the MoE block: routed slots are post-processed); the text model calls `remove_dropped` after a layer
    that dropped tokens, and `restore_layout` / `report` at the end."""

    def __init__(
        self,
        settings: AdaptiveSettings,
        config,  # the MoEmbConfig (the FLOPs model reads the vision tower's and the text model's sizes)
        metadata: TokenMetadata,
        visual_grids: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        control=None,  # a `gates.GateControl` (training, GRPO rollouts), with
        text_model=None,  # the `MoEmbTextModel` whose trained gates act (`trained.TrainedActions`)
    ):
        self.settings = settings
        self.config = config
        self.metadata = metadata
        self.visual_grids = visual_grids
        self.real_tokens = metadata.alive.clone()  # (B, S) in the input layout
        self.input_modality = metadata.modality.clone()
        self.top_k = config.text_config.num_experts_per_tok
        shape = (*metadata.alive.shape, config.text_config.num_hidden_layers)
        self.experts_run = torch.full(shape, self.top_k, dtype=torch.float64)
        self.skipped = torch.zeros(shape, dtype=torch.bool)
        self.dropped = torch.zeros(shape, dtype=torch.bool)
        self.beta = None  # (B, S) head-mean β of the latest Gated DeltaNet layer
        self.pending_drop = None  # (B, S) tokens leaving the forward after the current layer
        self.left_states = None  # (B, S, H) input layout: the hidden states of the tokens that left
        self.kept_slots = None  # (T, k) bool: the routed slots the current layer's MoE block runs
        # (B, S) bool: tokens whose sample bypasses the current block (layer skip at inference); they take no decision
        # there, so masked execution (block computed, result discarded) decides as packed execution (block not run).
        self.bypassed = None
        self.trained = None  # the trained gates' actions, when the settings or a GateControl use them
        if text_model is not None:
            self.trained = TrainedActions(self, control, text_model)
            self.trained = self.trained if self.trained.is_active else None

    # --- hook points ---

    def read_beta(self, layer_idx: int, linear_attn: torch.nn.Module | None, mixer_input: torch.Tensor) -> None:
        """Reads β = sigmoid(in_proj_b(x)) averaged over the heads (spec §2.1) at a Gated DeltaNet layer, and takes
        the one-shot pruning decision at `prune_after_layer` (spec §3.3)."""
        settings = self.settings
        if linear_attn is None or not self.reads_beta:
            return
        self.beta = beta_of(linear_attn, mixer_input)
        if settings.token_pruning == "gdn_beta" and layer_idx == settings.prune_after_layer:
            meta = self.metadata
            candidates = self.deciding() & (meta.modality > 0)  # only visual tokens are pruned
            kept = keep_highest(
                self.beta.flatten(), meta.segment_id.flatten(), candidates.flatten(), settings.keep_ratio
            ).view_as(candidates)
            drop = candidates & ~kept
            self.pending_drop = drop if bool(drop.any()) else None  # keeping everything leaves the layout as is

    @contextmanager
    def routing(self, layer_idx: int, block: torch.nn.Module):
        """Context manager around a layer's MoE block: its router's top-k weights are post-processed; in packed
        execution its routed experts run the kept slots only (`packed.compacted_experts`)."""
        routed = self.metadata.alive.flatten()  # the block routes the tokens of its mask, in row-major order
        compact = compacted_experts(block, lambda: self.kept_slots) if self.settings.execution == "packed" else None
        capture = self.trained.capture_router_input(block.gate) if self.trained is not None else None
        try:
            with edited_routing(
                block.gate, lambda logits, weights, index: self._route(layer_idx, routed, logits, weights, index)
            ):
                with compact or nullcontext():
                    yield
        finally:
            if capture is not None:
                capture.remove()

    def _route(self, layer_idx: int, routed: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, index=None):
        settings, meta = self.settings, self.metadata
        segment = meta.segment_id.flatten()[routed]
        modality = meta.modality.flatten()[routed]
        candidates = self.deciding().flatten()[routed]
        skip = torch.zeros_like(candidates)
        score = logits.max(-1).values if settings.expert_skip == "otsu_router_logit" else None
        if settings.expert_skip in BETA_SKIPS and self.beta is not None:  # no β before the first GDN layer
            score = self.beta.flatten()[routed]
        if settings.expert_skip == "beta_rank" and score is not None:
            skip = lowest_fraction(score, segment, candidates, settings.skip_fraction)
        elif settings.expert_skip == "beta_threshold" and score is not None:
            skip = candidates & (score < settings.beta_threshold)
        elif settings.expert_skip in ("otsu_beta", "otsu_router_logit") and score is not None:
            skip = otsu_split(
                score, segment, candidates, settings.otsu_min_cv, settings.otsu_max_skip, settings.otsu_bins
            )

        kept = torch.ones_like(weights, dtype=torch.bool)
        if settings.top_k == "uniform":
            kept = uniform_top_k(weights, settings.experts_per_token)
        elif settings.top_k == "modes":
            thresholds = (settings.modes_thresholds["text"], settings.modes_thresholds["visual"])
            kept = modes_slots(weights, modality > 0, settings.modes_layer_scales[layer_idx], thresholds)
        elif settings.top_k == "threshold":
            kept = threshold_slots(weights, settings.score_threshold, settings.min_experts_per_token)
        drop = torch.zeros_like(skip) if self.pending_drop is None else self.pending_drop.flatten()[routed]
        renormalize, scale = settings.renormalize, None
        if self.trained is not None:  # the efficiency heads and null experts (`trained.TrainedActions.route`)
            skip, drop, kept, trained_renormalize, scale = self.trained.route(
                layer_idx, routed, logits, index, skip, drop, kept
            )
            renormalize = renormalize if trained_renormalize is None else trained_renormalize
        # A token dropped here skips this layer's routed experts too (the DROP action of spec §3.0): its hidden
        # state is not read after this layer. A bypassed token is counted at full compute (its block costs nothing).
        if self.bypassed is not None:
            kept = kept | self.bypassed.flatten()[routed][:, None]
        kept = kept & ~(skip | drop)[:, None]

        rows = torch.arange(meta.alive.shape[0])[:, None].expand_as(meta.alive).flatten()[routed.cpu()]
        columns = meta.original_index.flatten()[routed].cpu()
        self.experts_run[rows, columns, layer_idx] = kept.sum(-1).double().cpu()
        self.skipped[rows, columns, layer_idx] = (skip & ~drop).cpu()
        self.dropped[rows, columns, layer_idx] = drop.cpu()
        self.kept_slots = kept
        weights = apply_slot_mask(weights, kept, renormalize)
        return weights if scale is None else weights * scale[:, None].to(weights.dtype)

    @property
    def reads_beta(self) -> bool:
        """Whether an action reads β at the Gated DeltaNet blocks."""
        return self.settings.token_pruning == "gdn_beta" or self.settings.expert_skip in BETA_SKIPS

    def deciding(self) -> torch.Tensor:
        """`(B, S)` bool: the tokens that take a decision at the current block (never the pooled token)."""
        meta = self.metadata
        deciding = meta.alive & ~meta.is_pooled
        return deciding if self.bypassed is None else deciding & ~self.bypassed

    @contextmanager
    def bypassing(self, bypassed: torch.Tensor):
        """Masked execution of a block some samples bypass (`bypassed` `(B, S)`): they decide nothing there."""
        self.bypassed = bypassed
        try:
            yield
        finally:
            self.bypassed = None

    @contextmanager
    def running_only(self, rows: torch.Tensor, layer: torch.nn.Module, hidden_states: torch.Tensor):
        """Packed execution of `layer` run on the tokens at `rows` `(T',)` of the packed row alone (the others'
        samples bypass it, spec §3.10): the metadata and β are those of the sub-pack while it runs, and the decisions
        it takes (tokens to drop) are put back in the whole row's layout. Where the block reads β, the bypassing
        tokens' β is read from their block input `hidden_states` normalised, as masked execution reads it."""
        meta, beta = self.metadata, self.beta
        runs = torch.zeros(meta.alive.shape[1], dtype=torch.bool, device=rows.device)
        runs[rows] = True
        self.metadata = meta.gather(rows[None], meta.alive[:, rows])
        self.beta = None if beta is None else beta[:, rows]
        try:
            yield
        finally:
            self.metadata = meta
            linear_attn = getattr(layer, "linear_attn", None)
            if linear_attn is not None and self.reads_beta:
                whole = torch.empty(meta.alive.shape, device=rows.device)
                if rows.numel():
                    whole[:, rows] = self.beta
                whole[:, ~runs] = beta_of(linear_attn, layer.input_layernorm(hidden_states[:, ~runs]))
                self.beta = whole
            else:
                self.beta = beta
            if self.pending_drop is not None:
                drop = torch.zeros_like(meta.alive)
                drop[:, rows] = self.pending_drop
                self.pending_drop = drop

    def remove_dropped(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """After the layer that dropped tokens: moves each row's survivors to its front (in order) and returns the new
        hidden states `(B, S', H)`, position embeddings and padding mask `(B, S')`."""
        meta, drop = self.metadata, self.pending_drop
        self.pending_drop = None
        if self.left_states is None:
            self.left_states = hidden_states.new_zeros((*self.real_tokens.shape, hidden_states.shape[-1]))
        rows = torch.arange(drop.shape[0], device=drop.device)[:, None].expand_as(drop)
        self.left_states[rows[drop], meta.original_index[drop]] = hidden_states[drop]
        alive = meta.alive & ~drop
        length = int(alive.sum(1).max())
        index = torch.sort((~alive).long(), dim=1, stable=True).indices[:, :length]  # survivors first, in order
        alive = alive.gather(1, index)
        self.metadata = meta.gather(index, alive)
        if self.beta is not None:
            self.beta = self.beta.gather(1, index)
        hidden_states = hidden_states.gather(1, index[..., None].expand(-1, -1, hidden_states.shape[-1]))
        position_embeddings = tuple(
            part.gather(1, index[..., None].expand(-1, -1, part.shape[-1])) for part in position_embeddings
        )
        return hidden_states, position_embeddings, alive.long()

    def restore_layout(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The hidden states in the input layout `(B, S, H)`: the survivors' final ones, the others' at leaving."""
        if self.left_states is None:
            return hidden_states
        meta = self.metadata
        rows = torch.arange(meta.alive.shape[0], device=meta.alive.device)[:, None].expand_as(meta.alive)
        restored = self.left_states.clone()
        restored[rows[meta.alive], meta.original_index[meta.alive]] = hidden_states[meta.alive]
        return restored

    # --- report ---

    def report(self, cu_seqlens: torch.Tensor | None = None) -> AdaptiveReport:
        """The logical FLOPs and realised rates; `cu_seqlens` of a packed row, else the rows' real tokens."""
        real = self.real_tokens.cpu()
        if cu_seqlens is None:
            cu_seqlens = torch.nn.functional.pad(real.sum(1).cumsum(0), (1, 0))
        decisions = TokenDecisions(
            drop=self.dropped[real].double(), skip=self.skipped[real].double(), experts_per_token=self.experts_run[real],
            layer_skip=None if self.trained is None else self.trained.sample_layer_skip(real),
        )  # fmt: skip
        image_grid_thw, video_grid_thw = self.visual_grids
        grids = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
        flops = logical_flops(self.config, cu_seqlens, decisions, **grids)
        full_flops = logical_flops(self.config, cu_seqlens, None, **grids)

        drop, skip, experts = decisions.drop, decisions.skip, decisions.experts_per_token
        reach = torch.cat([torch.ones_like(drop[:, :1]), torch.cumprod(1 - drop, dim=1)[:, :-1]], dim=1)
        executed = reach * (1 - skip - drop) * experts  # (T, L) routed slots run
        modality = self.input_modality.cpu()[real]
        top_k = self.top_k
        rates = {name: torch.full((drop.shape[1], 3), float("nan"), dtype=torch.float64) for name in
                 ("token_drop_rate", "expert_skip_rate", "slot_skip_rate")}  # fmt: skip
        for kind in range(3):
            of_kind = modality == kind
            if not bool(of_kind.any()):
                continue
            reached = reach[of_kind].sum(0)
            rates["token_drop_rate"][:, kind] = (reach * drop)[of_kind].sum(0) / reached
            rates["expert_skip_rate"][:, kind] = (reach * (skip + drop))[of_kind].sum(0) / reached
            rates["slot_skip_rate"][:, kind] = 1 - executed[of_kind].sum(0) / (top_k * reached)
        return AdaptiveReport(
            flops=flops,
            full_flops=full_flops,
            flops_saving=1.0 - flops.total / full_flops.total,
            routed_slots=float(top_k * reach.sum()),
            executed_slots=float(executed.sum()),
            decisions=decisions,
            **rates,
            **({} if self.trained is None else self.trained.sample_report(self.config, cu_seqlens, decisions)),
        )
