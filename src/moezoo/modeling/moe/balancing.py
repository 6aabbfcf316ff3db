"""Aux-loss-free balancing: the one call a training loop makes after each optimizer step.

`moezoo.training.callbacks.RoutingBiasCallback` makes it from a `transformers.Trainer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .router import TopKRouter


def number_of_processes() -> int:
    """The processes `sum_over_processes` sums over (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_processes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the data-parallel processes (in place), unchanged without torch.distributed: balancing
    statistics counted on every process's share of the global batch become the global batch's."""
    if number_of_processes() > 1:
        dist.all_reduce(tensor)
    return tensor


def balanced_routers(model: nn.Module) -> list[TopKRouter]:
    """The routers of `model` that carry a selection-only balancing bias."""
    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.e_score_correction_bias is not None]


@torch.no_grad()
def update_routing_biases(model: nn.Module, sync_processes: bool = True) -> int:
    """Apply one bias update to every balanced router of `model` from the assignments counted since the last call.

    Counts accumulate over every training forward (all micro-batches of a gradient-accumulation step); with
    `torch.distributed` initialised they are summed over all processes first, so every rank applies the same step.
    Routers whose weight is frozen are skipped (their counts are discarded). Returns the number of routers updated.
    """
    routers = balanced_routers(model)
    if not routers:
        return 0
    # One flat tensor, so that one all_reduce sums every router's counts (layers may have different expert counts).
    counts = torch.cat([router.tokens_per_expert for router in routers])
    if sync_processes:
        sum_over_processes(counts)
    updated = 0
    for router, router_counts in zip(routers, counts.split([router.num_experts for router in routers])):
        if not router.weight.requires_grad:
            router.reset_counts()
            continue
        updated += router.update_bias(router_counts) is not None
    return updated
