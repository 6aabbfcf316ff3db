"""Packed varlen execution of MoEMB's adaptive forward (spec moemb.md §3.14): what turns the logical FLOPs an action
saves into wall-clock time. Selected by `AdaptiveSettings.execution = "packed"` (the config's `adaptive` dict or the
`adaptive=` keyword of a forward).

    state      h [1, T, d] (the real tokens of every item back to back), segment ids, cu_seqlens [B + 1], max_seqlen,
               the original MRoPE positions gathered (never renumbered), modality, is_pooled (`TokenMetadata`)
    per layer  token mixer on the packed row, each item on its own (below); MoE: the shared expert on every row, the
               routed experts only on the kept (token, slot) pairs, gathered into a compact list
               (`compacted_experts`): a skipped slot costs nothing
    pruning    after a layer that drops tokens, every per-token tensor is index-selected (`TokenMetadata.gather`,
               `AdaptiveForward.remove_dropped` on the single row) and cu_seqlens recomputed from the segment ids
    layer skip at inference, the segments that bypass a block (spec §3.10) are left out of its packed row: the others'
               rows index-selected, cu_seqlens recomputed, the block's output scattered back
               (`MoEmbTextModel._run_without`, `AdaptiveForward.running_only`); a bypassing segment takes no decision
               there, in masked execution too (`AdaptiveForward.bypassing`), where the block runs and is discarded
    end        final norm, the pooled row of each segment, L2-normalised; the hidden states are put back in the
               input's padded layout (`PaddedBatch.unpack`), so the output looks as the masked forward's does

A padded batch is packed by `PaddedBatch` inside `MoEmbModel.forward`; a batch already packed (`cu_seqlens`) stays so.

Exactness (tested): without an action, the packed forward equals the padded one; with one, packed equals the masked
reference of the same action to float rounding (the masked forward moves each row's survivors to its front, so its
Gated DeltaNet layers see the same neighbours as the packed row; both differ from the training-time masked
approximation of spec A-18, where a dropped token stays in the conv window).

Token mixers (`moezoo.modeling.moemb`, shared with packed full compute): a Gated DeltaNet layer runs the stock layer
once per item on the CPU (exact; its PyTorch fallbacks would carry the state across items, spec §3.14) and fla's
varlen kernels with `cu_seqlens` for the delta rule and the convolution on a GPU; attention gets a block-diagonal
causal mask, and flash-attention's varlen arguments with `attn_implementation="flash_attention_2"`. (A right-padded
`(B, max_seqlen)` view run in one batched call was measured on the CPU: 1.3-1.8× slower for the Gated DeltaNet fallback,
12% faster for attention, about 1% of a forward: not worth a second path.)

How a new per-token action plugs in: decide in `AdaptiveForward` (forward.py) as the existing ones do; every
decision is taken on the token order of the current layout, so it works masked and packed alike.
- an expert action (skip a token's routed experts, drop slots) clears entries of the `(T, k)` kept-slot mask that
  `AdaptiveForward._route` returns; packed execution reads that mask (`AdaptiveForward.kept_slots`) and runs only the
  kept pairs, nothing else to do;
- a token-dropping action sets `AdaptiveForward.pending_drop` (`(B, S)` bool, never the pooled token) during a
  layer; the text model then removes those tokens and, packed, recomputes cu_seqlens;
- per-sample budgets go through `selection.per_segment` with `TokenMetadata.segment_id`, which is the item in
  both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PaddedBatch:
    """Where the real tokens of a `(B, S)` padded batch go in its packed `(1, T)` row: items in order, each item's
    real tokens in order (left or right padding alike)."""

    real: torch.Tensor  # (B, S) bool
    cu_seqlens: torch.Tensor  # (B + 1,) int32

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor | None, shape: tuple[int, int], device) -> PaddedBatch:
        real = torch.ones(shape, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        if not bool(real.any(1).all()):
            raise ValueError("every item of the batch needs a real token: an attention_mask row is all 0")
        cu_seqlens = nn.functional.pad(real.sum(1).cumsum(0), (1, 0)).to(torch.int32)
        return cls(real, cu_seqlens)

    def pack(self, tensor: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
        """`tensor` with the `(B, S)` dimensions at `batch_dim, batch_dim + 1`, its real tokens packed into `(1, T)`."""
        moved = tensor.movedim((batch_dim, batch_dim + 1), (0, 1))
        return moved[self.real].unsqueeze(0).movedim((0, 1), (batch_dim, batch_dim + 1))

    def packed_index(self, index: torch.Tensor) -> torch.Tensor:
        """`(B,)` positions in each row (e.g. the pooled tokens) as positions in the packed row."""
        before = (self.real.long().cumsum(1) - 1).gather(1, index[:, None])[:, 0]
        return self.cu_seqlens[:-1].long() + before

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`(1, T, ...)` back into the `(B, S, ...)` layout, zeros at the padding."""
        padded = packed.new_zeros((*self.real.shape, *packed.shape[2:]))
        padded[self.real] = packed[0]
        return padded


class _CompactedExperts(nn.Module):
    """Routed experts that run only the kept (token, slot) pairs: the pairs are gathered into a `(P, H)` list with
    one slot each (any experts implementation runs it), and each output is added to its token's row."""

    def __init__(self, experts: nn.Module, kept_slots: Callable[[], torch.Tensor]):
        super().__init__()
        self.experts = experts
        self.kept_slots = kept_slots

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, slots = self.kept_slots().nonzero(as_tuple=True)
        output = torch.zeros_like(hidden_states)
        if tokens.numel():
            pairs = self.experts(
                hidden_states[tokens], top_k_index[tokens, slots, None], top_k_weights[tokens, slots, None]
            )
            output.index_add_(0, tokens, pairs.to(output.dtype))
        return output


@contextmanager
def compacted_experts(block: nn.Module, kept_slots: Callable[[], torch.Tensor]):
    """While active, `block.experts` (a sparse-MoE block's routed experts) runs only the slots of `kept_slots()`, the
    `(T, k)` bool mask of the current call, read after the router ran."""
    experts = block.experts
    block.experts = _CompactedExperts(experts, kept_slots)
    try:
        yield
    finally:
        block.experts = experts
