"""Fast experts implementations and kernels, registered into transformers' own interfaces."""

from .sorted_experts import IMPLEMENTATION_NAME as SORTED_EXPERTS_IMPLEMENTATION
from .sorted_experts import sorted_experts_forward


__all__ = ["SORTED_EXPERTS_IMPLEMENTATION", "sorted_experts_forward"]
