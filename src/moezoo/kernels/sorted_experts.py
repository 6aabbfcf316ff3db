"""moezoo's experts implementation for the CPU: tokens sorted by expert, one contiguous GEMM per expert.

It runs the CPU calls of `moezoo` (`moezoo_experts.py`): select it on any model whose experts use
`@use_experts_implementation` (ours and transformers' own, e.g. Qwen3.5-MoE) with `experts_implementation="moezoo"`
or `model.set_experts_implementation("moezoo")`.

Forward, for the S = T*k (token, slot) pairs sorted by expert:
    xs  = x[token_of_pair]                                  one gather (S, H)
    h_e = xs_e @ W_up[e]^T (+ b_up[e])                      one GEMM per expert into one buffer (S, 2I)
    a   = act(gate) * up  (or act(h))                       (S, I)
    y_e = (w_e * a_e) @ W_down[e]^T (+ w_e * b_down[e])     routing weights scale the narrower activation
    out = index_add(y, token_of_pair)                       one scatter, no inverse permutation
Backward is a hand-written `autograd.Function`: per expert one GEMM for each of dX and dW, weight gradients written
straight into their final tensor, no weight gradient at all for frozen experts (LoRA, frozen layers), and the
SwiGLU derivative fused in place. Other gates and activations are differentiated by recomputing them under
autograd, so any `_apply_gate` / `act_fn` works.

Why it is faster on the CPU than transformers' `grouped_mm` (measured by `moezoo bench moe-layer`): on CPU,
`grouped_mm` is itself a loop of GEMMs, so the difference is everything around them. Buffers larger than glibc's
mmap threshold (32 MiB) come back from the kernel as fresh pages on every allocation and are page-faulted on first
write, which costs as much as the arithmetic on them; here every temporary of one call lives in a per-thread
workspace that is reused from call to call, fewer temporaries are made in the first place, and the expert weight
gradients come from a pool that hands a buffer out again once no gradient refers to it. `release_workspace()`
returns that memory.

When each expert sees few tokens (at most `NATIVE_MAX_PAIRS_PER_EXPERT` pairs on average: decoding, short
sequences), a GEMM per expert is bound by reading the expert's weights, and BLAS reads them twice (packing, then
multiplying). Fused SwiGLU experts in fp32 then run on moezoo's C kernels (`native_experts.c`, built on first use
by `native.py`), which read an expert's weights once per 16 of its pairs in the forward pass and once per 8 in the
backward pass, and write each weight gradient once. With more pairs per expert the GEMMs stay BLAS's, and for fused
SwiGLU in fp32 the activation is one native pass over all pairs (silu, times up, times the routing weight), as is its
derivative (which also yields the routing-weight gradients), instead of three and six PyTorch passes. Without a C
compiler the PyTorch path above serves every call.

`moezoo` hands CUDA tensors to moezoo's Triton experts (`moezoo_triton`, `triton_experts.py`) when triton is
installed. Everything else this implementation does not cover (other devices, expert parallelism, post-expert norms,
torch.compile tracing) is handed to transformers' `grouped_mm` implementation (`batched_mm` for weights `grouped_mm`
cannot take: `transformers_experts_forward`).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import (
    _default_apply_gate,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)
from transformers.utils.import_utils import is_torchdynamo_compiling

from .native import native_library


class _Workspace(threading.local):
    """Named scratch buffers that only grow; a buffer is valid until the next request under the same name."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        return self._buffer(name, numel, like)[:numel].view(shape)

    def address(self, name: str, numel: int, like: torch.Tensor) -> int:
        """The address of the buffer `get` would view, for the native kernels (making no view saves per-call time)."""
        return self._buffer(name, numel, like).data_ptr()

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.buffers[key] = buffer
        return buffer


_WORKSPACE = _Workspace()


class _GradientPool:
    """Reusable memory for the expert weight gradients (the largest tensors a backward pass makes).

    A gradient handed out here is a view of a pooled buffer; autograd keeps it as `param.grad` without copying.
    The buffer is handed out again only once nothing but the pool refers to its storage (the optimizer zeroed the
    gradient with `set_to_none=True`, or autograd added it into an existing `.grad` and dropped it), so a gradient
    a caller still holds is never overwritten. Without the pool every backward pass would take fresh pages from
    the kernel for these tensors and fault each of them in, which costs as much as computing them. The pool keeps
    as many buffers per shape as there were gradients of that shape alive at once (one per MoE layer, plus one
    while gradients accumulate), like PyTorch's CUDA caching allocator; `release_workspace()` returns them.
    """

    def __init__(self):
        self.buffers: dict[tuple, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _is_free(buffer: torch.Tensor) -> bool:
        # The pool's tensor and the temporary storage object are the only owners of a free buffer.
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2

    def empty_like(self, weight: torch.Tensor) -> torch.Tensor:
        if not hasattr(torch._C, "_storage_Use_Count"):
            return torch.empty_like(weight)
        key = (tuple(weight.shape), weight.dtype, weight.device)
        with self.lock:
            buffers = self.buffers.setdefault(key, [])
            for buffer in buffers:
                if self._is_free(buffer):
                    return buffer.view(buffer.shape)
            buffer = torch.empty(key[0], dtype=weight.dtype, device=weight.device)
            buffers.append(buffer)
            return buffer.view(buffer.shape)


_GRADIENT_POOL = _GradientPool()


def release_workspace() -> None:
    """Free the scratch memory this thread's calls have kept for reuse, and the pooled weight-gradient buffers
    that no gradient refers to any more."""
    _WORKSPACE.buffers.clear()
    with _GRADIENT_POOL.lock:
        _GRADIENT_POOL.buffers.clear()


def _expert_index_error(top_k_index: torch.Tensor, num_experts: int) -> ValueError:
    outside = top_k_index[(top_k_index < 0) | (top_k_index >= num_experts)]
    return ValueError(
        f"top_k_index routes to expert {int(outside[0])}, but this layer's experts are numbered 0..{num_experts - 1}"
    )


def check_expert_index(top_k_index: torch.Tensor, num_experts: int) -> None:
    """Raise a `ValueError` naming the first expert index outside [0, num_experts) (reads the indices on the host)."""
    if top_k_index.numel() and (int(top_k_index.min()) < 0 or int(top_k_index.max()) >= num_experts):
        raise _expert_index_error(top_k_index, num_experts)


def check_experts_inputs(module, hidden_states, top_k_index, top_k_weights, up_weight, down_weight) -> None:
    """Raise a `ValueError` saying what does not fit when the inputs' shapes do not match each other or the experts'
    weights: kernels that index raw memory would otherwise read past the end of a tensor."""
    name = type(module).__name__
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"{name}: expected hidden_states (tokens, hidden) and top_k_index (tokens, k), got "
            f"{tuple(hidden_states.shape)} and {tuple(top_k_index.shape)}"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"{name}: top_k_weights {tuple(top_k_weights.shape)} must have top_k_index's shape "
            f"{tuple(top_k_index.shape)}"
        )
    hidden = hidden_states.shape[1]
    up_in = up_weight.shape[1] if module.is_transposed else up_weight.shape[2]
    down_out = down_weight.shape[2] if module.is_transposed else down_weight.shape[1]
    if hidden != up_in or hidden != down_out:
        raise ValueError(f"{name}: hidden_states has {hidden} features, but these experts take and return {up_in}")


def _sort_pairs(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, int]:
    """The (token, slot) pairs of one call grouped by expert, stably, and the number of experts they reach.

    One int64 tensor holds the pair order (S,) (the slots token * k + j of expert 0, then of expert 1, ...) followed by
    the expert offsets (E+1,): see `_order_and_offsets`. Sorted by moezoo's native counting sort when it is built (one
    C pass instead of PyTorch's bincount, argsort and cumsum, which cost ~5% of a 64-token forward), else by PyTorch.
    An index outside the layer's experts raises a `ValueError` naming it."""
    library = native_library()
    if library is None:
        check_expert_index(top_k_index, num_experts)
        flat_ids = top_k_index.reshape(-1)
        counts = torch.bincount(flat_ids, minlength=num_experts)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return torch.cat([torch.argsort(flat_ids, stable=True), offsets]), int(counts.count_nonzero())
    expert_index = top_k_index
    if expert_index.dtype != torch.int64 or not expert_index.is_contiguous():
        expert_index = expert_index.to(torch.int64).contiguous()
    num_pairs = expert_index.numel()
    sorted_pairs = torch.empty(num_pairs + num_experts + 1, dtype=torch.int64)
    experts_hit = library.moezoo_sort_pairs(
        expert_index.data_ptr(), num_pairs, num_experts, *_order_and_offsets(sorted_pairs, num_pairs)
    )
    if experts_hit < 0:
        raise _expert_index_error(top_k_index, num_experts)
    return sorted_pairs, experts_hit


def _order_and_offsets(sorted_pairs: torch.Tensor, num_pairs: int) -> tuple[int, int]:
    """The addresses of the pair order and of the expert offsets, which `_sort_pairs` holds one after the other."""
    address = sorted_pairs.data_ptr()
    return address, address + num_pairs * sorted_pairs.element_size()


class _Segments:
    """The (token, slot) pairs of one call sorted by expert (`_sort_pairs`): `order` (S,) and each expert's row count.

    Per-expert views are made with one `split` / `unbind` call each, which keeps the Python work per expert to a
    single GEMM call: at small batches that overhead is comparable to the GEMMs themselves.
    """

    def __init__(self, sorted_pairs: torch.Tensor, num_pairs: int):
        self.order = sorted_pairs[:num_pairs]
        self.counts = sorted_pairs[num_pairs:].diff().tolist()
        self.hit = [expert for expert, count in enumerate(self.counts) if count]

    def rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-expert row blocks of a tensor whose rows follow `order`."""
        return tensor.split(self.counts)


def _matrices(weight: torch.Tensor, transposed_view: bool) -> tuple[torch.Tensor, ...]:
    return (weight.transpose(1, 2) if transposed_view else weight).unbind(0)


def _project(inputs, weight, bias, segments, transposed, out):
    """Per expert `out_e = inputs_e @ W[e]^T + b[e]`; `weight` is (E, out, in), or (E, in, out) if transposed."""
    matrices = _matrices(weight, not transposed)
    input_rows, out_rows = segments.rows(inputs), segments.rows(out)
    if bias is None:
        for expert in segments.hit:
            torch.mm(input_rows[expert], matrices[expert], out=out_rows[expert])
    else:
        for expert in segments.hit:
            torch.addmm(bias[expert], input_rows[expert], matrices[expert], out=out_rows[expert])
    return out


def _project_back(grad, weight, segments, transposed, out):
    """Per expert `out_e = grad_e @ W[e]`: the input gradient of `_project`."""
    matrices = _matrices(weight, transposed)
    grad_rows, out_rows = segments.rows(grad), segments.rows(out)
    for expert in segments.hit:
        torch.mm(grad_rows[expert], matrices[expert], out=out_rows[expert])
    return out


def _weight_grad(inputs, grad, weight, segments, transposed):
    """Per expert `grad_e^T @ inputs_e` in a new gradient shaped like `weight`; experts without tokens get 0."""
    result = _GRADIENT_POOL.empty_like(weight)
    left, right = segments.rows(inputs if transposed else grad), segments.rows(grad if transposed else inputs)
    for expert, count in enumerate(segments.counts):
        if count:
            torch.mm(left[expert].t(), right[expert], out=result[expert])
        else:
            result[expert].zero_()
    return result


def _bias_grad(grad, bias, segments):
    result = torch.zeros_like(bias)
    grad_rows = segments.rows(grad)
    for expert in segments.hit:
        torch.sum(grad_rows[expert], dim=0, out=result[expert])
    return result


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(a * b).sum(-1)` for (S, n) inputs without an (S, n) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _has_fused_swiglu(module) -> bool:
    return (
        module.has_gate
        and type(module)._apply_gate is _default_apply_gate
        and isinstance(module.act_fn, (SiLUActivation, nn.SiLU))
    )


def _pointer(tensor: torch.Tensor | None) -> int | None:
    """The address ctypes passes for a tensor; None (a NULL pointer) tells the kernel to skip that output."""
    return None if tensor is None else tensor.data_ptr()


def _native_swiglu(module, projected: torch.Tensor):
    """moezoo's native library when its SwiGLU pass over all pairs can take this call (fused SwiGLU, fp32, a width
    that is a multiple of 16), else None."""
    width = projected.shape[-1] // 2
    if _has_fused_swiglu(module) and projected.dtype == torch.float32 and projected.is_contiguous() and width % 16 == 0:
        return native_library()
    return None


def _sum_pairs(pair_rows: torch.Tensor, token_of_pair: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(T, H): each token's k pair rows summed, in fp32 whatever the rows' dtype, returned in the rows' dtype."""
    if pair_rows.dtype in (torch.float16, torch.bfloat16):
        output = torch.zeros(num_tokens, pair_rows.shape[-1], dtype=torch.float32, device=pair_rows.device)
        return output.index_add_(0, token_of_pair, pair_rows.float()).to(pair_rows.dtype)
    return pair_rows.new_zeros(num_tokens, pair_rows.shape[-1]).index_add_(0, token_of_pair, pair_rows)


def _activate(module, projected: torch.Tensor) -> torch.Tensor:
    """The experts' nonlinearity on the projected pairs (S, 2I) or (S, I) -> (S, I)."""
    if _has_fused_swiglu(module):
        gate, up = projected.chunk(2, dim=-1)
        activated = _WORKSPACE.get("activated", tuple(gate.shape), gate)
        return torch.ops.aten.silu.out(gate, out=activated).mul_(up)
    return module._apply_gate(projected) if module.has_gate else module.act_fn(projected)


def _activate_weighted(module, projected: torch.Tensor, pair_weights: torch.Tensor) -> torch.Tensor:
    """The activation of every pair scaled by its routing weight (S, I); `pair_weights` is (S, 1)."""
    library = _native_swiglu(module, projected)
    if library is None:
        return _activate(module, projected).mul_(pair_weights)
    num_pairs, width = projected.shape[0], projected.shape[-1] // 2
    weighted = _WORKSPACE.get("activated", (num_pairs, width), projected)
    library.moezoo_swiglu_pairs(projected.data_ptr(), num_pairs, width, pair_weights.data_ptr(), weighted.data_ptr(),
                                torch.get_num_threads())
    return weighted


def _activation_backward(module, projected, grad_weighted, pair_weights, need_weighted, need_pair_grad):
    """Backward of `_activate_weighted` from dL/d(weighted activation) (S, I), which it may overwrite. Returns
    dL/d(projected) and, if asked for, the weighted activation (S, I) (for the down projection's weight gradient)
    and dL/d(routing weight) of every pair (S,)."""
    library = _native_swiglu(module, projected)
    if library is not None:
        num_pairs, width = projected.shape[0], projected.shape[-1] // 2
        weighted = _WORKSPACE.get("activated", (num_pairs, width), projected) if need_weighted else None
        grad_projected = _WORKSPACE.get("grad_projected", tuple(projected.shape), projected)
        pair_grad = projected.new_empty(num_pairs) if need_pair_grad else None
        library.moezoo_swiglu_pairs_backward(
            projected.data_ptr(), grad_weighted.data_ptr(), num_pairs, width, pair_weights.data_ptr(),
            _pointer(weighted), grad_projected.data_ptr(), _pointer(pair_grad), torch.get_num_threads(),
        )
        return grad_projected, weighted, pair_grad

    fused = _has_fused_swiglu(module)
    if fused:
        activated = _activate(module, projected)
    else:
        with torch.enable_grad():
            projected = projected.detach().requires_grad_(True)
            activated = _activate(module, projected)
    pair_grad = _rowwise_dot(grad_weighted, activated.detach()) if need_pair_grad else None
    weighted = None
    if need_weighted:
        weighted = activated.detach().mul_(pair_weights) if fused else activated.detach() * pair_weights
    grad_activated = grad_weighted.mul_(pair_weights)
    if fused:
        grad_projected = _swiglu_backward(projected, grad_activated)
    else:
        (grad_projected,) = torch.autograd.grad(activated, projected, grad_activated)
    return grad_projected, weighted, pair_grad


def _experts_forward(hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias, module,
                     segments, projected):
    """The forward pass over the pairs of `segments`, writing the up projection into `projected` (S, out_features of
    W_up). Returns the output (T, H) and the per-pair routing weights (S, 1)."""
    num_tokens, hidden_dim = hidden_states.shape
    top_k = top_k_index.shape[1]
    order = segments.order
    token_of_pair = order // top_k

    pair_states = _WORKSPACE.get("pair_states", (order.numel(), hidden_dim), hidden_states)
    torch.index_select(hidden_states, 0, token_of_pair, out=pair_states)
    _project(pair_states, up_weight, up_bias, segments, module.is_transposed, projected)
    pair_weights = top_k_weights.reshape(-1).index_select(0, order).to(projected.dtype).unsqueeze(-1)
    scaled = _activate_weighted(module, projected, pair_weights)
    expert_out = _project(scaled, down_weight, None, segments, module.is_transposed, pair_states)
    if down_bias is not None:
        out_rows, weight_rows = segments.rows(expert_out), segments.rows(pair_weights)
        for expert in segments.hit:
            out_rows[expert].addmm_(weight_rows[expert], down_bias[expert].unsqueeze(0))
    return _sum_pairs(expert_out, token_of_pair, num_tokens), pair_weights


def _gradients_with_graph(module, grad_output, inputs, needs_input_grad):
    """The backward pass when autograd records it (`backward(create_graph=True)`: gradients of gradients, e.g. a
    gradient penalty), which the hand-written backward passes cannot give: the forward recomputed with transformers'
    `grouped_mm`, whose backward is made of differentiable operations, then differentiated. `inputs` are the
    `autograd.Function`'s tensor inputs, starting with (hidden_states, top_k_index, top_k_weights); the others are
    the module's own parameters."""
    hidden_states, top_k_index, top_k_weights = inputs[:3]
    wanted = [tensor for tensor, needed in zip(inputs, needs_input_grad) if needed]
    with torch.enable_grad():
        output = transformers_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    gradients = iter(torch.autograd.grad(output, wanted, grad_output, create_graph=True, allow_unused=True))
    return tuple(next(gradients) if needed else None for needed in needs_input_grad)


class _SortedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias, module,
                segments):
        up_features = up_weight.shape[-1] if module.is_transposed else up_weight.shape[-2]
        projected = hidden_states.new_empty(top_k_index.numel(), up_features)  # kept for the backward pass
        output, pair_weights = _experts_forward(
            hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias, module, segments,
            projected,
        )
        ctx.save_for_backward(
            hidden_states, top_k_index, top_k_weights, segments.order, projected, pair_weights, up_weight, up_bias,
            down_weight, down_bias,
        )
        ctx.segments = segments
        ctx.module = module
        ctx.top_k = top_k_index.shape[1]
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (hidden_states, top_k_index, top_k_weights, order, projected, pair_weights, up_weight, up_bias, down_weight,
         down_bias) = ctx.saved_tensors
        segments, module, top_k = ctx.segments, ctx.module, ctx.top_k
        if torch.is_grad_enabled():
            inputs = (hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias)
            return (*_gradients_with_graph(module, grad_output, inputs, ctx.needs_input_grad[:7]), None, None)
        transposed = module.is_transposed
        need_x, _, need_weights, need_up_w, need_up_b, need_down_w, need_down_b, _, _ = ctx.needs_input_grad
        num_pairs, hidden_dim = order.numel(), hidden_states.shape[-1]
        token_of_pair = order // top_k

        # One (S, H) scratch buffer serves, in turn, the gathered output gradient, the gathered inputs and the
        # input gradient of the pairs.
        pair_buffer = _WORKSPACE.get("pair_states", (num_pairs, hidden_dim), projected)
        grad_pairs = torch.index_select(grad_output.to(projected.dtype), 0, token_of_pair, out=pair_buffer)
        width = down_weight.shape[-2] if transposed else down_weight.shape[-1]
        grad_weighted = _project_back(
            grad_pairs, down_weight, segments, transposed,
            _WORKSPACE.get("grad_activated", (num_pairs, width), projected),
        )
        grad_projected, weighted, pair_grad = _activation_backward(
            module, projected, grad_weighted, pair_weights, need_down_w, need_weights
        )
        grad_weights = grad_down_b = grad_down_w = None
        if need_weights:
            if down_bias is not None:
                grad_rows, pair_grad_rows = segments.rows(grad_pairs), segments.rows(pair_grad)
                for expert in segments.hit:
                    pair_grad_rows[expert].add_(grad_rows[expert] @ down_bias[expert])
            grad_weights = torch.empty_like(pair_grad)
            grad_weights[order] = pair_grad
            grad_weights = grad_weights.view(-1, top_k).to(pair_weights.dtype)
        if need_down_b:
            grad_down_b = _bias_grad(grad_pairs * pair_weights, down_bias, segments)
        if need_down_w:
            grad_down_w = _weight_grad(weighted, grad_pairs, down_weight, segments, transposed)

        grad_up_w = grad_up_b = grad_x = None
        if need_up_w:
            pair_inputs = torch.index_select(hidden_states.to(projected.dtype), 0, token_of_pair, out=pair_buffer)
            grad_up_w = _weight_grad(pair_inputs, grad_projected, up_weight, segments, transposed)
        if need_up_b:
            grad_up_b = _bias_grad(grad_projected, up_bias, segments)
        if need_x:
            grad_pair_inputs = _project_back(grad_projected, up_weight, segments, transposed, pair_buffer)
            grad_x = _sum_pairs(grad_pair_inputs, token_of_pair, hidden_states.shape[0]).to(hidden_states.dtype)
        return grad_x, None, grad_weights, grad_up_w, grad_up_b, grad_down_w, grad_down_b, None, None


def _swiglu_backward(projected: torch.Tensor, grad_activated: torch.Tensor) -> torch.Tensor:
    """Gradient of `silu(gate) * up` w.r.t. `[gate | up]`, written into one (S, 2I) workspace buffer."""
    gate, up = projected.chunk(2, dim=-1)
    grad_projected = _WORKSPACE.get("grad_projected", tuple(projected.shape), projected)
    grad_gate, grad_up = grad_projected.chunk(2, dim=-1)
    torch.ops.aten.silu.out(gate, out=grad_up).mul_(grad_activated)
    torch.ops.aten.silu_backward.grad_input(grad_activated.mul_(up), gate, grad_input=grad_gate)
    return grad_projected


# Above this many (token, slot) pairs per expert that has any, one BLAS GEMM per expert beats the native kernels,
# whose backward pass goes over an expert's weights once per 8 pairs. Measured with `moezoo bench moe-layer --tokens
# 256 384 512` (64 experts, top-8) on a 2-core AVX-512 VM: native ahead at 32 pairs per expert, even at 48
# (forward + backward), behind at 64.
NATIVE_MAX_PAIRS_PER_EXPERT = 40


def _runs_natively(module, hidden_states, up_weight, up_bias, down_weight, num_pairs: int, experts_hit: int) -> bool:
    """Whether `native_experts.c` takes this call: fused SwiGLU without biases, fp32, contiguous weights in
    transformers' layout, sizes that are multiples of 64, and few pairs per expert that has any."""
    hidden, width = hidden_states.shape[-1], down_weight.shape[-1]
    return (
        _has_fused_swiglu(module)
        and up_bias is None
        and not module.is_transposed
        and hidden_states.dtype == up_weight.dtype == down_weight.dtype == torch.float32
        and up_weight.is_contiguous()
        and down_weight.is_contiguous()
        and hidden % 64 == 0
        and width % 64 == 0
        and num_pairs <= NATIVE_MAX_PAIRS_PER_EXPERT * experts_hit
        and native_library() is not None
    )


def _native_forward(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, sorted_pairs, projected):
    """The forward pass on the native kernels (T, H), for the pairs sorted by `_sort_pairs`, writing the up
    projection at the address `projected` (S, 2I); also returns the routing weights as fp32, for the backward pass."""
    (num_tokens, hidden), (num_experts, _, width) = hidden_states.shape, down_weight.shape
    num_pairs = top_k_index.numel()
    routing_weights = top_k_weights.float().contiguous()
    inputs = hidden_states.contiguous()
    output = torch.empty_like(inputs)
    native_library().moezoo_swiglu_forward(
        inputs.data_ptr(), num_tokens, hidden, width, num_experts, top_k_index.shape[1],
        *_order_and_offsets(sorted_pairs, num_pairs), routing_weights.data_ptr(), up_weight.data_ptr(),
        down_weight.data_ptr(), projected, _WORKSPACE.address("pair_states", num_pairs * hidden, inputs),
        output.data_ptr(), torch.get_num_threads(),
    )
    return output, routing_weights


class _NativeSwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, up_weight, down_weight, sorted_pairs, module):
        projected = hidden_states.new_empty(top_k_index.numel(), up_weight.shape[-2])  # kept for the backward pass
        output, routing_weights = _native_forward(
            hidden_states, top_k_index, top_k_weights, up_weight, down_weight, sorted_pairs, projected.data_ptr()
        )
        ctx.save_for_backward(
            hidden_states, top_k_index, top_k_weights, sorted_pairs, routing_weights, projected, up_weight, down_weight
        )
        ctx.module = module
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (hidden_states, top_k_index, top_k_weights, sorted_pairs, routing_weights, projected, up_weight,
         down_weight) = ctx.saved_tensors
        if torch.is_grad_enabled():
            inputs = (hidden_states, top_k_index, top_k_weights, up_weight, down_weight)
            return (*_gradients_with_graph(ctx.module, grad_output, inputs, ctx.needs_input_grad[:5]), None, None)
        need_x, _, need_weights, need_up, need_down, _, _ = ctx.needs_input_grad
        inputs, grad_output = hidden_states.contiguous(), grad_output.contiguous()
        (num_tokens, hidden), (num_experts, _, width) = inputs.shape, down_weight.shape
        num_pairs = routing_weights.numel()
        grad_x = torch.empty_like(inputs) if need_x else None
        grad_pair_x = _WORKSPACE.address("pair_states", num_pairs * hidden, inputs) if need_x else None
        grad_weights = torch.empty_like(routing_weights) if need_weights else None
        grad_up = _GRADIENT_POOL.empty_like(up_weight) if need_up else None
        grad_down = _GRADIENT_POOL.empty_like(down_weight) if need_down else None
        native_library().moezoo_swiglu_backward(
            grad_output.data_ptr(), inputs.data_ptr(), num_tokens, hidden, width, num_experts,
            routing_weights.shape[1], *_order_and_offsets(sorted_pairs, num_pairs), routing_weights.data_ptr(),
            up_weight.data_ptr(), down_weight.data_ptr(), projected.data_ptr(), grad_pair_x, _pointer(grad_x),
            _pointer(grad_weights), _pointer(grad_up), _pointer(grad_down), torch.get_num_threads(),
        )
        if grad_weights is not None:
            grad_weights = grad_weights.to(top_k_weights.dtype)
        return grad_x, None, grad_weights, grad_up, grad_down, None, None


def handed_to_grouped_mm(module) -> bool:
    """What neither moezoo implementation covers, on any device: torch.compile tracing, expert parallelism, post-expert
    norms."""
    return is_torchdynamo_compiling() or module._is_expert_parallel or module.has_post_expert_norm


def transformers_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' `grouped_mm`, or its `batched_mm` where `torch._grouped_mm` refuses the weights: it needs every
    row of its operands 16-byte aligned, which 16-bit experts of an odd width are not (MoE-ViE-L's 684 and -H's 854
    in bf16 fail with "strides should be multiple of 16 bytes")."""
    up_weight, _, down_weight, _ = expert_parameters(module)
    row_lengths = (*up_weight.shape[1:], *down_weight.shape[1:])  # (out, in) of both projections, transposed or not
    if all(length * up_weight.element_size() % 16 == 0 for length in row_lengths):
        return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def expert_parameters(module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`(up_weight, up_bias, down_weight, down_bias)` of an experts module; up is gate_up with a gate; biases or None."""
    up_weight = module.gate_up_proj if module.has_gate else module.up_proj
    if not module.has_bias:
        return up_weight, None, module.down_proj, None
    up_bias = module.gate_up_proj_bias if module.has_gate else module.up_proj_bias
    return up_weight, up_bias, module.down_proj, module.down_proj_bias


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will need gradients of any of `tensors` (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def experts_forward_without_triton(module, hidden_states, top_k_index, top_k_weights):
    """The CPU implementation above for CPU tensors, transformers' `grouped_mm` (or `batched_mm`) for other devices and
    what the CPU implementation does not cover."""
    if hidden_states.device.type != "cpu" or handed_to_grouped_mm(module):
        return transformers_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    up_weight, up_bias, down_weight, down_bias = expert_parameters(module)
    check_experts_inputs(module, hidden_states, top_k_index, top_k_weights, up_weight, down_weight)
    # The experts compute in their weights' dtype and answer in the input's, as transformers' grouped_mm does: the two
    # differ under autocast (which does not reach the `out=` products and C kernels here), e.g. bf16 activations into
    # fp32 experts, and in mixed-precision models. Both casts are autograd's, so gradients come back in each dtype.
    output = _sorted_experts_forward(
        module, hidden_states.to(up_weight.dtype), top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias
    )
    return output.to(hidden_states.dtype)


def _sorted_experts_forward(module, hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight,
                            down_bias):
    """The CPU implementation for hidden states in the dtype of the experts' weights."""
    grad_needed = needs_grad(hidden_states, top_k_weights, up_weight, up_bias, down_weight, down_bias)
    if grad_needed:
        # Tensors made under torch.inference_mode() (cached features) cannot be saved for the backward pass.
        hidden_states, top_k_index, top_k_weights = (
            tensor.clone() if tensor.is_inference() else tensor for tensor in (hidden_states, top_k_index, top_k_weights)
        )
    inputs = (hidden_states, top_k_index, top_k_weights, up_weight, up_bias, down_weight, down_bias)
    num_pairs = top_k_index.numel()
    sorted_pairs, experts_hit = _sort_pairs(top_k_index, down_weight.shape[0])
    if _runs_natively(module, hidden_states, up_weight, up_bias, down_weight, num_pairs, experts_hit):
        native_inputs = (hidden_states, top_k_index, top_k_weights, up_weight, down_weight, sorted_pairs)
        if grad_needed:
            return _NativeSwiGLUExperts.apply(*native_inputs, module)
        projected = _WORKSPACE.address("projected", num_pairs * up_weight.shape[-2], hidden_states)
        return _native_forward(*native_inputs, projected)[0]
    segments = _Segments(sorted_pairs, num_pairs)
    if grad_needed:
        return _SortedExperts.apply(*inputs, module, segments)
    up_features = up_weight.shape[-1] if module.is_transposed else up_weight.shape[-2]
    projected = _WORKSPACE.get("projected", (num_pairs, up_features), hidden_states)
    return _experts_forward(*inputs, module, segments, projected)[0]

