"""Fast experts implementations and kernels, registered into transformers' own interfaces."""

from .moezoo_experts import IMPLEMENTATION_NAME as SORTED_EXPERTS_IMPLEMENTATION
from .moezoo_experts import moezoo_experts_forward
from .triton_experts import IMPLEMENTATION_NAME as TRITON_EXPERTS_IMPLEMENTATION
from .triton_experts import triton_experts_forward


__all__ = [
    "SORTED_EXPERTS_IMPLEMENTATION",
    "TRITON_EXPERTS_IMPLEMENTATION",
    "moezoo_experts_forward",
    "triton_experts_forward",
]
