"""Total and active parameter counts of a model built on the core (works on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .block import SparseMoeBlock


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # parameters used for one token: routed experts count k / E of their size


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Counts every parameter once (tied weights included once). A model with its own accounting (task routes,
    adaptive computation) provides `active_parameter_count()` and is trusted for the active count."""
    total = sum(p.numel() for p in model.parameters())
    if hasattr(model, "active_parameter_count"):
        return ParameterCounts(total, int(model.active_parameter_count()))
    inactive = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            routed = sum(p.numel() for p in module.experts.parameters())
            inactive += routed * (module.num_experts - module.spec.num_experts_per_tok) // module.num_experts
    return ParameterCounts(total, total - inactive)
