"""`moezoo_triton`: moezoo's Triton experts implementation for GPUs, for inference (the kernels: `triton_kernels.py`).

Select it on any model whose experts use `@use_experts_implementation` with `experts_implementation="moezoo_triton"`
or `model.set_experts_implementation("moezoo_triton")`. It runs the routed experts as two Triton kernels (the gather
fused into the gate/up grouped GEMM, the activation into its epilogue, the routing weight into the down GEMM's) and
sums each token's k expert outputs in fp32, deterministically, as transformers' `grouped_mm` does.

Calls it does not cover go to moezoo's `moezoo` implementation, which serves CPU tensors itself and hands everything
else to transformers' `grouped_mm`: calls that need gradients (training: the spec keeps the backward pass to
`grouped_mm`), devices Triton does not compile for, no triton installed, activations other than SiLU / GELU / ReLU,
custom gates, post-expert norms, expert parallelism, torch.compile tracing. Each reason is logged once.

On CPU tensors the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1` set before the first call),
which is how the tests check them on machines without a GPU; it is slow and meant for that alone.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers.activations import (
    FastGELUActivation,
    GELUActivation,
    GELUTanh,
    NewGELUActivation,
    QuickGELUActivation,
    SiLUActivation,
)
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
from transformers.utils import logging
from transformers.utils.import_utils import is_triton_available

from .sorted_experts import (
    check_expert_index,
    check_experts_inputs,
    expert_parameters,
    handed_to_grouped_mm,
    needs_grad,
    sorted_experts_forward,
)


logger = logging.get_logger(__name__)

IMPLEMENTATION_NAME = "moezoo_triton"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The activation modules the kernels compute in their epilogue, by the name the kernels know them by.
KERNEL_ACTIVATIONS = {
    SiLUActivation: "silu",
    nn.SiLU: "silu",
    GELUActivation: "gelu",
    GELUTanh: "gelu_tanh",
    NewGELUActivation: "gelu_tanh",
    FastGELUActivation: "gelu_tanh",
    QuickGELUActivation: "quick_gelu",
    nn.ReLU: "relu",
}


def kernel_activation(act_fn: nn.Module) -> str | None:
    """The kernels' name for `act_fn`, or None when they do not compute it."""
    if type(act_fn) is nn.GELU:
        return "gelu" if act_fn.approximate == "none" else "gelu_tanh"
    return KERNEL_ACTIVATIONS.get(type(act_fn))


def _unsupported_reason(module, hidden_states, top_k_weights, up_weight, down_weight, grad_needed) -> str | None:
    device = hidden_states.device.type
    if grad_needed:
        return "calls that need gradients (its kernels are for inference)"
    if not is_triton_available():
        return "any call without triton installed"
    if device != "cuda" and not (device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"{device} tensors (on the CPU, only under TRITON_INTERPRET=1)"
    if handed_to_grouped_mm(module):
        return "torch.compile tracing, expert parallelism or post-expert norms"
    if module.has_gate and (type(module)._apply_gate is not _default_apply_gate or not module.is_concatenated):
        return "custom gates or interleaved gate/up weights"
    if kernel_activation(module.act_fn) is None:
        return f"the activation {type(module.act_fn).__name__}"
    if not (hidden_states.dtype == up_weight.dtype == down_weight.dtype and hidden_states.dtype in DTYPES):
        return "mixed dtypes, or dtypes other than fp32, bf16 and fp16"
    if top_k_weights.device != hidden_states.device:
        return "routing weights on another device"
    return None


def triton_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """`ExpertsInterface` entry: `(module, hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`."""
    up_weight, up_bias, down_weight, down_bias = expert_parameters(module)
    grad_needed = needs_grad(hidden_states, top_k_weights, up_weight, up_bias, down_weight, down_bias)
    reason = _unsupported_reason(module, hidden_states, top_k_weights, up_weight, down_weight, grad_needed)
    if reason is not None:
        logger.warning_once(f"moezoo_triton does not cover {reason}: such calls go to the `moezoo` implementation")
        return sorted_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    check_experts_inputs(module, hidden_states, top_k_index, top_k_weights, up_weight, down_weight)
    if hidden_states.device.type == "cpu":  # reading the indices costs a device sync elsewhere
        check_expert_index(top_k_index, down_weight.shape[0])

    from .triton_kernels import experts_forward

    return experts_forward(
        hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias,
        has_gate=module.has_gate, transposed=module.is_transposed, activation=kernel_activation(module.act_fn),
    )


ExpertsInterface.register(IMPLEMENTATION_NAME, triton_experts_forward)
