"""`moezoo`: the default experts implementation of moezoo's models, which picks the kernels of each call by its
device: moezoo's Triton experts (`moezoo_triton`, `triton_experts.py`) for CUDA tensors when triton is installed,
moezoo's CPU implementation (`sorted_experts.py`) for CPU tensors, transformers' `grouped_mm` for the rest.

It stands above both implementations, because the Triton one hands what it does not cover back to the CPU one.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface
from transformers.utils.import_utils import is_triton_available

from .sorted_experts import experts_forward_without_triton
from .triton_experts import triton_experts_forward


IMPLEMENTATION_NAME = "moezoo"
# The devices whose calls `moezoo` hands to moezoo's Triton experts (`moezoo_triton`) when triton is installed.
TRITON_DEVICE_TYPES = ("cuda",)


def hands_to_triton(device: torch.device) -> bool:
    """Whether `moezoo` runs a call on `device` with moezoo's Triton experts: the default implementation of moezoo's
    models is resolved here, at the call, because a model is built on the meta device and moved afterwards."""
    return device.type in TRITON_DEVICE_TYPES and is_triton_available()


def moezoo_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """`ExpertsInterface` entry: `(module, hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`.
    CUDA tensors go to `moezoo_triton` when triton is installed, see `experts_forward_without_triton` for the rest."""
    if hands_to_triton(hidden_states.device):
        return triton_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return experts_forward_without_triton(module, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION_NAME, moezoo_experts_forward)
