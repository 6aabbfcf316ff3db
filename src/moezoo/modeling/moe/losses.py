"""Auxiliary router losses, computed from the per-layer router logits that the blocks return.

The blocks return logits of valid tokens only, so padding is excluded before these functions see anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .balancing import number_of_processes, sum_over_processes


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor | None],
    num_experts: int,
    top_k: int,
    router_type: str = "softmax",
    over_processes: bool = False,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all layers (equations 4-6 of Fedus et al.):
    `E * sum_e f_e * P_e`, with `f_e` the fraction of (token, slot) assignments of expert `e` and `P_e` its mean
    routing probability. Equals transformers' `load_balancing_loss_func` for softmax routers.

    For sigmoid routers the probabilities are the affinities normalised over experts, and the selection is the
    bias-free top-k of those probabilities.

    `over_processes`: the global batch's under data parallelism, as SMoES's losses are: `f_e` (no gradient) counts
    every process's assignments (`sum_over_processes`), and each process's `P_e` sums its own probabilities over the
    rows of all processes, times their number, so that the mean of the processes' losses and gradients is one
    process's on the global batch.
    """
    layers = [logits for logits in router_logits if logits is not None]
    if not layers:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=layers[0].device)
    probability_sum = torch.zeros_like(assignments)
    rows = 0
    for logits in layers:
        probs = _routing_probabilities(logits.float(), router_type)
        selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        assignments = assignments + torch.zeros_like(assignments).index_add_(
            0, selected, torch.ones_like(selected, dtype=torch.float32)
        )
        probability_sum = probability_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    if over_processes:
        counts = sum_over_processes(torch.cat([assignments, assignments.new_tensor([rows])]))
        assignments, rows = counts[:-1], counts[-1]
        probability_sum = probability_sum * number_of_processes()
    if rows == 0:
        return assignments.sum() * 0.0
    return num_experts * torch.sum((assignments / rows) * (probability_sum / rows))


def router_z_loss(router_logits: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over tokens of `logsumexp(logits)^2`, averaged over layers."""
    layers = [logits for logits in router_logits if logits is not None and logits.numel()]
    if not layers:
        raise ValueError("router_z_loss needs the router logits of at least one layer")
    per_layer = [torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in layers]
    return torch.stack(per_layer).mean()


def _routing_probabilities(logits: torch.Tensor, router_type: str) -> torch.Tensor:
    if router_type == "softmax":
        return torch.softmax(logits, dim=-1)
    if router_type == "sigmoid":
        affinities = torch.sigmoid(logits)
        return affinities / affinities.sum(dim=-1, keepdim=True)
    raise ValueError(f"no routing probabilities for router_type={router_type!r} (expected 'softmax' or 'sigmoid')")
