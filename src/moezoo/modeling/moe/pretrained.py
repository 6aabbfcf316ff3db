"""What every `PreTrainedModel` built on the core shares, as a mixin placed before `PreTrainedModel`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

# Importing the kernel modules registers "moezoo" and "moezoo_triton" (which "moezoo" imports) in transformers'
# ExpertsInterface, in exported (flattened) folders too, so `experts_implementation=` either works wherever the model
# code runs.
from ...kernels.moezoo_experts import IMPLEMENTATION_NAME as SORTED_EXPERTS_IMPLEMENTATION
from .block import SparseMoeBlock
from .offload import OffloadMixin


class MoePreTrainedMixin(OffloadMixin):
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

    def init_parallel_plans(self) -> None:
        """
        transformers' plans, plus the rules of the core's modules wherever this model holds them, so that
        `DistributedConfig(ep_size=N)` and `DistributedConfig(fsdp_size=N)` work on every zoo model without a
        hand-written plan per architecture (names with `*` for the layer numbers, as transformers writes them):

        - EP: each `SparseMoeBlock`'s fused expert tensors are split into contiguous ranges on dim 0, the expert
          dim (`"grouped_gemm"`), and its experts module reaches them through transformers' token exchange
          (`"ep_dispatch_experts"`, `AllToAllEP` when training);
        - FSDP2: each `_no_split_modules` layer is its own `fully_shard` unit (`"free_full_weight"`: gathered for
          its forward and backward only), rather than the whole model in one.
        """
        super().init_parallel_plans()
        no_split_modules = set(self._no_split_modules or ())
        module_names = set()
        for name, module in self.named_modules():
            generic_name = replace_layer_number_by_wildcard(name)
            module_names.add(generic_name)
            if isinstance(module, SparseMoeBlock):
                for parameter_name, _ in module.experts.named_parameters(recurse=False):
                    self._ep_plan[f"{generic_name}.experts.{parameter_name}"] = "grouped_gemm"
                self._ep_plan[f"{generic_name}.experts"] = "ep_dispatch_experts"
            elif name and type(module).__name__ in no_split_modules:
                self._fsdp_plan[generic_name] = "free_full_weight"
        # The config's default FSDP rules name `embed_tokens`, `layers.*` and `norm`, which most zoo models lack.
        self._fsdp_plan = {name: style for name, style in self._fsdp_plan.items() if name in module_names}


class WithoutFusedExpertsMixin(OffloadMixin):
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
