"""The routed slots each token keeps (spec §3.7-3.9), as `(T, k)` bool masks over a router's top-k slots, and the
context manager that applies such a decision to a router's output. The dropped slots' weights become 0 (masked
execution, no renormalisation unless asked: spec A-22)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def slot_ranks(weights: torch.Tensor) -> torch.Tensor:
    """`(T, k)` rank of every slot by its weight, 0 = the largest (ties: the earlier slot first)."""
    order = torch.sort(weights, dim=-1, descending=True, stable=True).indices
    return torch.argsort(order, dim=-1)


def uniform_top_k(weights: torch.Tensor, experts_per_token: int) -> torch.Tensor:
    """Keep the k' highest of the k slots (spec §3.7)."""
    return slot_ranks(weights) < experts_per_token


def modes_slots(
    weights: torch.Tensor, is_visual: torch.Tensor, layer_scales: tuple[float, float], thresholds: tuple[float, float]
) -> torch.Tensor:
    """MoDES (spec §3.8): keep slot j of token t iff s_ℓ^{m(t)} · α_tj ≥ τ_{m(t)}, m = text (0) or visual (1)."""
    modality = is_visual.long()
    scale = weights.new_tensor(layer_scales)[modality][:, None]
    threshold = weights.new_tensor(thresholds)[modality][:, None]
    return scale * weights >= threshold


def threshold_slots(weights: torch.Tensor, threshold: float, min_experts_per_token: int) -> torch.Tensor:
    """Keep slot j iff α_tj ≥ τ, and each token's `min_experts_per_token` highest slots whatever their weight."""
    return (weights >= threshold) | (slot_ranks(weights) < min_experts_per_token)


def apply_slot_mask(weights: torch.Tensor, kept: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """Zero the dropped slots' weights; with `renormalize`, scale the kept ones back to the token's total weight."""
    kept_weights = weights * kept
    if renormalize:
        kept_total = kept_weights.sum(-1, keepdim=True)
        kept_weights = torch.where(kept_total > 0, kept_weights * weights.sum(-1, keepdim=True) / kept_total, 0.0)
    return kept_weights.to(weights.dtype)


@contextmanager
def edited_routing(router: torch.nn.Module, edit):
    """While active, the router's `(logits, top_k_weights, top_k_index)` output goes through
    `edit(logits, weights, index) -> weights` before the experts read it (the shared core's block calls its router
    once per forward)."""

    def hook(module, inputs, output):
        logits, weights, index = output
        return logits, edit(logits, weights, index), index

    handle = router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
