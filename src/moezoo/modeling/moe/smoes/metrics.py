"""The modality specialisation index (MSI, spec §2.7): how far the experts' modality attributions are from uniform.

The paper defines MSI only in words (soft-routing baseline .177, hard routing 1.0). Here, per layer,
MSI = mean_e |p_e(text) - p_e(vision)|, with p_e(m) proportional to the share of modality m's top-k dispatches
that go to expert e. Normalising by the modality's own dispatches makes routing that ignores modality score about
0 whatever the text/vision token ratio, and routing that gives each modality its own experts score 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .scores import NUM_MODALITIES, TEXT, VISION


@torch.no_grad()
def modality_specialisation_index(
    top_k_index: torch.LongTensor,  # (B, T, k) the router's selection
    modality: torch.LongTensor,  # (B, T) hard labels
    valid: torch.Tensor,  # (B, T) bool
    num_experts: int,
) -> float:
    """MSI of one layer, in [0, 1]."""
    selected, labels = top_k_index[valid], modality[valid]  # (N, k), (N,)
    dispatches = torch.zeros(NUM_MODALITIES, num_experts, dtype=torch.long, device=top_k_index.device)
    for m in (TEXT, VISION):
        dispatches[m] = torch.bincount(selected[labels == m].reshape(-1), minlength=num_experts)
    return dispatch_specialisation_index(dispatches)


def dispatch_specialisation_index(dispatches: torch.Tensor) -> float:
    """MSI of one layer from its `(NUM_MODALITIES, num_experts)` counts of top-k dispatches per modality and expert."""
    dispatch_share = dispatches.double() / dispatches.sum(dim=-1, keepdim=True).clamp_min(1)
    attribution = dispatch_share / dispatch_share.sum(dim=0, keepdim=True).clamp_min(1e-12)
    return (attribution[TEXT] - attribution[VISION]).abs().mean().item()


@torch.no_grad()
def mean_modality_specialisation_index(
    top_k_indices: Sequence[torch.LongTensor],  # one (B, T, k) selection per MoE layer
    modality: torch.LongTensor,
    valid: torch.Tensor,
    num_experts: int,
) -> float:
    """MSI averaged over layers, the number the paper reports."""
    if not top_k_indices:
        raise ValueError("mean_modality_specialisation_index needs the top-k selection of at least one MoE layer")
    per_layer = [modality_specialisation_index(index, modality, valid, num_experts) for index in top_k_indices]
    return sum(per_layer) / len(per_layer)
