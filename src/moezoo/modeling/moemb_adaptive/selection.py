"""Per-sample selection rules shared by the adaptive actions: every budget (a share kept, a share skipped, an Otsu
threshold) is computed over one sample's (one packed segment's) candidate tokens, never over the batch (spec §3.0,
A-16), so an item's embedding does not depend on its neighbours. Ties go to the earlier token."""

from __future__ import annotations

import math

import torch


def per_segment(segment_ids: torch.Tensor, candidates: torch.Tensor):
    """Yields, for every segment with candidates, the flat indices of its candidate tokens (in token order)."""
    for segment in torch.unique(segment_ids[candidates]).tolist():
        yield (candidates & (segment_ids == segment)).nonzero().flatten()


def keep_highest(
    scores: torch.Tensor, segment_ids: torch.Tensor, candidates: torch.Tensor, ratio: float
) -> torch.Tensor:
    """Flat bool mask of the ⌈ratio · n⌉ highest-scoring candidates of each segment (n: its candidates)."""
    kept = torch.zeros_like(candidates)
    for index in per_segment(segment_ids, candidates):
        count = math.ceil(ratio * index.numel() - 1e-9)  # 0.5 · 6 = 3, not 4 from a rounding error
        order = torch.sort(scores[index], descending=True, stable=True).indices
        kept[index[order[:count]]] = True
    return kept


def lowest(scores: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` lowest-scoring of the flat `index` tokens."""
    return index[torch.sort(scores[index], stable=True).indices[:count]]


def lowest_fraction(scores: torch.Tensor, segment_ids: torch.Tensor, candidates: torch.Tensor, fraction: float):
    """Flat bool mask of the ⌊fraction · n⌋ lowest-scoring candidates of each segment."""
    selected = torch.zeros_like(candidates)
    for index in per_segment(segment_ids, candidates):
        selected[lowest(scores, index, math.floor(fraction * index.numel() + 1e-9))] = True
    return selected


def otsu_threshold(scores: torch.Tensor, bins: int = 256) -> float:
    """θ* = argmax_θ w₀(θ) w₁(θ) (μ₀(θ) − μ₁(θ))² over the inner edges θ of a `bins`-bin histogram of `scores` (class
    0: scores below θ); the first maximiser on ties. Class means are those of the scores themselves."""
    scores = scores.double().flatten()
    low, high = float(scores.min()), float(scores.max())
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)[1:-1]
    ordered = torch.sort(scores).values
    below = torch.searchsorted(ordered, edges)  # how many scores lie under each edge
    cumulative = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)])
    total, count = cumulative[-1], scores.numel()
    valid = (below > 0) & (below < count)
    if not bool(valid.any()):
        return low  # all scores equal: nothing lies below any split
    below_sum = cumulative[below]
    w0, w1 = below / count, 1 - below / count
    mean0 = below_sum / below.clamp(min=1)
    mean1 = (total - below_sum) / (count - below).clamp(min=1)
    between = torch.where(valid, w0 * w1 * (mean0 - mean1) ** 2, -1.0)
    return float(edges[int(torch.argmax(between))])


def otsu_split(
    scores: torch.Tensor,
    segment_ids: torch.Tensor,
    candidates: torch.Tensor,
    min_cv: float,
    max_share: float,
    bins: int,
) -> torch.Tensor:
    """Flat bool mask of the candidates each segment sends below its Otsu threshold (spec §3.6): none where the
    segment's coefficient of variation σ/|μ| is at most `min_cv`; at most ⌊max_share · n⌋ of them, the lowest."""
    selected = torch.zeros_like(candidates)
    for index in per_segment(segment_ids, candidates):
        values = scores[index].double()
        mean = values.mean().abs()
        if index.numel() < 2 or mean == 0 or float(values.std(unbiased=False) / mean) <= min_cv:
            continue
        below = index[values < otsu_threshold(values, bins)]
        cap = math.floor(max_share * index.numel() + 1e-9)
        selected[lowest(scores, below, cap) if below.numel() > cap else below] = True
    return selected
