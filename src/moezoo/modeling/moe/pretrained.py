"""What every `PreTrainedModel` built on the core shares, as a mixin placed before `PreTrainedModel`."""

from __future__ import annotations

import torch
from torch import nn

# Importing the kernel modules registers "moezoo" and "moezoo_triton" in transformers' ExpertsInterface, in exported
# (flattened) folders too, so `experts_implementation=` either works wherever the model code runs.
from ...kernels.sorted_experts import IMPLEMENTATION_NAME as SORTED_EXPERTS_IMPLEMENTATION
from ...kernels.triton_experts import IMPLEMENTATION_NAME as TRITON_EXPERTS_IMPLEMENTATION  # noqa: F401


class MoePreTrainedMixin:
    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers greps the model's own file for `@use_experts_implementation`; the experts live in the core.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Default to moezoo's implementation, the fastest measured on CPU, which hands CUDA tensors to moezoo's
        Triton experts (`moezoo_triton`) when triton is installed and other devices to grouped_mm: the device is
        known only when the experts are called (models are built on the meta device and moved afterwards). An
        explicit request is honoured as usual."""
        return super().get_correct_experts_implementation(requested_experts or SORTED_EXPERTS_IMPLEMENTATION)


class WithoutFusedExpertsMixin:
    """For a zoo model without fused experts, placed before its `PreTrainedModel` base: a dense tower of a composite
    model, or MoTE, whose task experts are whole FFNs run one route at a time. It takes every experts implementation,
    which changes nothing there.

    transformers hands `experts_implementation=` to every sub-config, and refuses `"grouped_mm"` on a model class
    whose file lacks `@use_experts_implementation` ("does not support setting experts implementation"), so one
    dense tower would fail a whole composite model. `_can_set_experts_implementation` stays False, as it is for
    transformers' dense models: transformers reads it as "has experts behind the interface" (its common tests then
    expect them to run), and `set_experts_implementation` leaves such a model's config as it is.
    """

    def _grouped_mm_can_dispatch(self) -> bool:
        return True  # no experts to dispatch


def checkpoints_reentrantly(model: nn.Module) -> bool:
    """Whether a training forward of `model` runs its layers under reentrant activation checkpointing
    (`use_reentrant=True`; transformers' default is the non-reentrant variant). Reentrant checkpointing runs each
    layer's first pass without gradients and takes only the layer's positional tensors as inputs, so a loss built
    from what hooks record in that pass (router logits for an auxiliary loss) silently gets no gradient."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            # `activation_checkpointing_enable` binds its options to torch's checkpoint with a partial; torch's own
            # default without `use_reentrant` is the reentrant variant.
            options = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None)
            return options is not None and options.get("use_reentrant", True)
    return False
