"""Expert bins (SMoES spec §2.2): each MoE layer's experts cut into `num_bins` groups of `num_experts / num_bins`.

The bin is the unit of specialisation and of expert-parallel placement. With adaptive binning the experts are
sorted by their text preference, measured by a momentum (EMA) of the modality-weighted tokens each receives, and
cut into contiguous runs of that order: bin 0 is the most vision-leaning, bin `num_bins - 1` the most text-leaning.
"""

from __future__ import annotations

import torch

from .scores import NUM_MODALITIES, TEXT, VISION


BINNING_TYPES = ("adaptive", "fixed")


def contiguous_bins(num_experts: int, num_bins: int, device: torch.device | str | None = None) -> torch.LongTensor:
    """(E,) the bins of fixed binning, and of adaptive binning before any count: `arange(E) // (E / num_bins)`."""
    return torch.arange(num_experts, device=device) // (num_experts // num_bins)


@torch.no_grad()
def soft_dispatch_counts(
    top_k_index: torch.LongTensor,  # (B, T, k)
    scores: torch.Tensor,  # (B, T, 2) soft modality scores
    valid: torch.Tensor,  # (B, T) bool
    num_experts: int,
) -> torch.Tensor:
    """C (2, E): C[m, e] = sum over valid tokens t of M[t, m] * [e in top-k(t)], the top-k dispatches weighted by the
    layer's soft scores (hard counts with hard scores)."""
    weights = torch.where(valid[..., None], scores.float(), 0.0)  # where, not *: padding scores may be NaN
    per_slot = weights.unsqueeze(-2).expand(*top_k_index.shape, NUM_MODALITIES)  # (B, T, k, 2)
    counts = torch.zeros(num_experts, NUM_MODALITIES, dtype=torch.float32, device=scores.device)
    counts.index_add_(0, top_k_index.reshape(-1), per_slot.reshape(-1, NUM_MODALITIES))
    return counts.T.contiguous()


@torch.no_grad()
def text_preference(counts: torch.Tensor) -> torch.Tensor:
    """f_spec (E,) = C[TEXT] / (C[TEXT] + C[VISION]), 0.5 for an expert that has received nothing."""
    total = counts[TEXT] + counts[VISION]
    return torch.where(total > 0, counts[TEXT] / total.clamp_min(1e-12), torch.full_like(total, 0.5))


@torch.no_grad()
def adaptive_bins(counts: torch.Tensor, num_bins: int) -> torch.LongTensor:
    """(E,) bins from the (2, E) count EMA: experts sorted by ascending text preference (a stable sort, so ties keep
    the expert order and equal counts give `contiguous_bins`), then cut into `num_bins` equal runs."""
    num_experts = counts.shape[-1]
    order = torch.sort(text_preference(counts), stable=True).indices
    bins = torch.empty_like(order)
    bins[order] = contiguous_bins(num_experts, num_bins, device=order.device)
    return bins
