"""What every `PreTrainedModel` built on the core shares, as a mixin placed before `PreTrainedModel`."""

from __future__ import annotations

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
        """Default to moezoo's implementation, the fastest measured on CPU (it hands other devices to
        grouped_mm); an explicit request is honoured as usual."""
        return super().get_correct_experts_implementation(requested_experts or SORTED_EXPERTS_IMPLEMENTATION)
