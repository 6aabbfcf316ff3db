"""`moezoo_triton`: moezoo's Triton experts implementation for GPUs, forward and backward (the kernels:
`triton_kernels.py`, `triton_backward_kernels.py`).

Select it on any model whose experts use `@use_experts_implementation` with `experts_implementation="moezoo_triton"`
or `model.set_experts_implementation("moezoo_triton")`; moezoo's default implementation, `moezoo`, hands CUDA
tensors to it when triton is installed. The forward pass is two Triton kernels (the gather fused into the gate/up
grouped GEMM, the activation into its epilogue, the routing weight into the down GEMM's) and sums each token's k
expert outputs in fp32, deterministically, as transformers' `grouped_mm` does. The backward pass is an
`autograd.Function` over four more launches: the down projection's input gradient with the activation's derivative
and the routing weights' gradient in its epilogue, the two projections' weight (and bias) gradients as grouped GEMMs
over each expert's pairs, and the up projection's input gradient. Frozen weights (LoRA, frozen layers) get no
weight-gradient launch.

What the backward pass needs of the forward pass: the pre-activation up projection (S, 2I) is saved, in the input
dtype, rather than recomputed: recomputing it would repeat the largest GEMM of the forward pass (a third of the
backward pass's work), while keeping it costs no more memory than transformers' `grouped_mm`, whose autograd graph
keeps it too (with the gathered inputs and the activation, which are not kept here). The activation and its
derivative are recomputed from it elementwise in the backward pass's first kernel.

A masked slot (top-k' < k: MoEMB's adaptive top-k, or a padding token routed nowhere) is either a routing weight of 0
(its output adds nothing and its routing weight still gets a gradient, as in every implementation) or the expert
index E, one past the last expert, which transformers' eager experts skip: it is left out of every kernel, its
output and gradients are 0.

Calls it does not cover go to moezoo's CPU implementation for CPU tensors, and to transformers' `grouped_mm`
elsewhere: devices Triton does not compile for, no triton installed, activations other than SiLU / GELU / ReLU,
custom gates, post-expert norms, expert parallelism, torch.compile tracing, and backward passes that autograd
records (gradients of gradients). Each reason is logged once.

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
    _gradients_with_graph,
    check_experts_inputs,
    expert_parameters,
    experts_forward_without_triton,
    handed_to_grouped_mm,
    needs_grad,
)


logger = logging.get_logger(__name__)

IMPLEMENTATION_NAME = "moezoo_triton"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Triton compiles for NVIDIA GPUs of compute capability 8.0 (Ampere) and later.
MIN_CUDA_CAPABILITY = (8, 0)
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


def _device_reason(device: torch.device) -> str | None:
    """Why Triton cannot run on `device`, or None."""
    if device.type == "cpu":
        return None if os.environ.get("TRITON_INTERPRET") == "1" else "CPU tensors outside TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"{device.type} tensors"
    if torch.version.hip is None and torch.cuda.get_device_capability(device) < MIN_CUDA_CAPABILITY:
        return "GPUs of compute capability below 8.0"
    return None


def _unsupported_reason(module, hidden_states, top_k_weights, up_weight, down_weight) -> str | None:
    if not is_triton_available():
        return "any call without triton installed"
    if (reason := _device_reason(hidden_states.device)) is not None:
        return reason
    if handed_to_grouped_mm(module):
        return "torch.compile tracing, expert parallelism or post-expert norms"
    if module.has_gate and (type(module)._apply_gate is not _default_apply_gate or not module.is_concatenated):
        return "custom gates or interleaved gate/up weights"
    if kernel_activation(module.act_fn) is None:
        return f"the activation {type(module.act_fn).__name__}"
    if not (up_weight.dtype == down_weight.dtype and up_weight.dtype in DTYPES and hidden_states.is_floating_point()):
        return "experts whose weights differ in dtype, or dtypes other than fp32, bf16, fp16 and fp64"
    if top_k_weights.device != hidden_states.device:
        return "routing weights on another device"
    return None


def check_expert_index(top_k_index: torch.Tensor, num_experts: int) -> None:
    """Raise a `ValueError` naming the first expert index outside [0, num_experts], num_experts being a masked slot
    (reads the indices on the host)."""
    outside = top_k_index[(top_k_index < 0) | (top_k_index > num_experts)]
    if outside.numel():
        raise ValueError(
            f"top_k_index routes to expert {int(outside[0])}, but this layer's experts are numbered "
            f"0..{num_experts - 1} ({num_experts} marks a masked slot)"
        )


class _TritonExperts(torch.autograd.Function):
    """The experts' forward pass on the Triton kernels, keeping the pre-activation projection and the sorted pairs for
    a backward pass on the Triton kernels too (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias, module,
                layout):
        from .triton_kernels import experts_forward, sort_pairs

        pairs = sort_pairs(top_k_index, down_weight.shape[0])
        up_features = up_weight.shape[-1] if layout.transposed else up_weight.shape[-2]
        projected = hidden_states.new_empty(top_k_index.numel(), up_features)  # kept for the backward pass
        output = experts_forward(
            hidden_states, pairs, top_k_weights, up_weight, up_bias, down_weight, down_bias, layout, projected
        )
        ctx.save_for_backward(
            hidden_states, top_k_index, top_k_weights, pairs.slot, pairs.token, pairs.offsets, projected, up_weight,
            up_bias, down_weight, down_bias,
        )
        ctx.module, ctx.layout = module, layout
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (hidden_states, top_k_index, top_k_weights, pair_slot, pair_token, offsets, projected, up_weight, up_bias,
         down_weight, down_bias) = ctx.saved_tensors
        inputs = (hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias)
        if torch.is_grad_enabled():  # autograd records this pass (gradients of gradients): transformers' is recorded
            return (*_gradients_with_graph(ctx.module, grad_output, inputs, ctx.needs_input_grad[:7]), None, None)
        need_x, _, need_weights, need_up_w, need_up_b, need_down_w, need_down_b, _, _ = ctx.needs_input_grad
        if projected.numel() == 0:  # no tokens, or k = 0
            return tuple(torch.zeros_like(t) if t is not None and need else None
                         for t, need in zip((*inputs, None, None), ctx.needs_input_grad))

        from .triton_backward_kernels import experts_backward
        from .triton_kernels import SortedPairs

        pairs = SortedPairs(pair_slot, pair_token, offsets, top_k_index.shape[1])
        grads = experts_backward(
            grad_output, hidden_states, pairs, top_k_weights, projected, up_weight, up_bias, down_weight, down_bias,
            ctx.layout, need_x=need_x, need_up=need_up_w or need_up_b, need_down=need_down_w or need_down_b,
        )
        needed = (need_x, need_weights, need_up_w, need_up_b, need_down_w, need_down_b)
        grad_x, grad_weights, grad_up_w, grad_up_b, grad_down_w, grad_down_b = (
            grad if need else None for grad, need in zip(grads, needed)
        )
        return grad_x, None, grad_weights, grad_up_w, grad_up_b, grad_down_w, grad_down_b, None, None


def triton_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """`ExpertsInterface` entry:
    `(module, hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`."""
    up_weight, up_bias, down_weight, down_bias = expert_parameters(module)
    reason = _unsupported_reason(module, hidden_states, top_k_weights, up_weight, down_weight)
    if reason is not None:
        logger.warning_once(
            f"moezoo_triton does not cover {reason}: such calls go to moezoo's CPU implementation for CPU tensors, "
            "to transformers' grouped_mm elsewhere"
        )
        return experts_forward_without_triton(module, hidden_states, top_k_index, top_k_weights)
    check_experts_inputs(module, hidden_states, top_k_index, top_k_weights, up_weight, down_weight)
    if hidden_states.device.type == "cpu":  # reading the indices costs a device sync elsewhere
        check_expert_index(top_k_index, down_weight.shape[0])

    from .triton_kernels import ExpertsLayout, experts_forward, sort_pairs

    layout = ExpertsLayout(module.has_gate, module.is_transposed, kernel_activation(module.act_fn))
    # The experts compute in their weights' dtype and answer in the input's, as transformers' grouped_mm and moezoo's
    # CPU implementation do: the two differ under autocast (bf16 activations into fp32 experts). Both casts are
    # autograd's, so the gradients come back in each dtype.
    states = hidden_states.to(up_weight.dtype)
    if needs_grad(states, top_k_weights, up_weight, up_bias, down_weight, down_bias):
        inputs = (states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias)
        # Tensors made under torch.inference_mode() (cached features) cannot be saved for the backward pass.
        inputs = tuple(t.clone() if t is not None and t.is_inference() else t for t in inputs)
        output = _TritonExperts.apply(*inputs, module, layout)
    else:
        pairs = sort_pairs(top_k_index, down_weight.shape[0])
        output = experts_forward(states, pairs, top_k_weights, up_weight, up_bias, down_weight, down_bias, layout)
    return output.to(hidden_states.dtype)


ExpertsInterface.register(IMPLEMENTATION_NAME, triton_experts_forward)
