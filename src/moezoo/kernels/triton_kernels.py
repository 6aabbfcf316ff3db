"""Triton kernels of moezoo's `moezoo_triton` experts implementation (see `triton_experts.py`): the forward pass,
after MoE-ViE's "two kernel launches" (moe_vie.md §3, the paper's Alg. 1), and what the backward pass
(`triton_backward_kernels.py`) shares with it:

    kernel 1  act[p] = act_fn(x[token(p)] @ W_gate[e]^T (+ b)) * (x[token(p)] @ W_up[e]^T (+ b))   (S, I)
              the gather of the input rows is fused into the GEMM, the activation into its epilogue; when the call
              will be differentiated, the pre-activation projection (S, 2I) is written too
    kernel 2  out[slot(p)] = w(p) * (act[p] @ W_down[e]^T (+ b))                                      (S, H), fp32
              the routing weight is fused into the epilogue, rows are written back in slot order

over the S = T * k (token, slot) pairs sorted by expert (p); expert e owns the pairs offsets[e] .. offsets[e+1]. A
slot routed to the index E (one past the last expert: the "no expert" of a masked slot, which transformers' eager
experts skip) sorts after every expert's pairs and is left out; its row of `out` stays 0. The caller sums each
token's k rows of `out` in slot order (deterministic, unlike an atomic scatter-add). Products accumulate in fp32
whatever the input dtype (in fp64 for fp64 inputs).

Each program takes one (BLOCK_M x BLOCK_N) tile of one expert's pairs; the grid's first axis is sized by the tokens
of the call (no expert sees more pairs than there are tokens when each token's k experts differ, as top-k routing
makes them), so no device-to-host sync is needed to size it, and a program loops over further tiles in the rare
case that an expert has more pairs (a token routed twice to one expert).

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors in fp32 and fp64 (how the tests check them on a
machine without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils.import_utils import is_triton_available


# This module is imported only when triton is installed; the guard keeps transformers' check of a Hub folder's
# imports from requiring triton of everyone who loads the model's remote code.
if is_triton_available():
    import triton
    import triton.language as tl


# Tile sizes; tl.dot needs every side to be at least 16.
BLOCK_N = 64
BLOCK_K = 32
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64


@dataclass(frozen=True)
class ExpertsLayout:
    """What the kernels need to know of an experts module besides its tensors."""

    has_gate: bool  # up_weight is gate_up (E, 2I, H), gate rows first; else up (E, I, H)
    transposed: bool  # weights stored with their last two axes swapped (transformers' `is_transposed`)
    activation: str  # the kernels' name of the activation: "silu", "gelu", "gelu_tanh", "quick_gelu" or "relu"


@dataclass
class SortedPairs:
    """The (token, slot) pairs of one call grouped by expert (masked slots last), as the kernels index them."""

    slot: torch.Tensor  # (S,) int64: the slot token * k + j of each pair, expert 0's first
    token: torch.Tensor  # (S,) int64: the token of each pair
    offsets: torch.Tensor  # (E+1,) int64: expert e owns the pairs offsets[e] .. offsets[e+1]
    top_k: int  # k, the slots of each token


def sort_pairs(top_k_index: torch.Tensor, num_experts: int) -> SortedPairs:
    """Group the pairs by expert on the device, without a host sync: a stable sort and a histogram whose last bin
    counts the masked slots (index `num_experts`), so that they fall outside every expert's span."""
    expert_ids = top_k_index.reshape(-1)
    pair_slot = torch.argsort(expert_ids, stable=True)
    bins = torch.zeros(num_experts + 2, dtype=torch.int64, device=top_k_index.device)
    bins[1:].scatter_add_(0, expert_ids.to(torch.int64), torch.ones_like(expert_ids, dtype=torch.int64))
    offsets = bins.cumsum(0)[: num_experts + 1]
    return SortedPairs(pair_slot, pair_slot // top_k_index.shape[1], offsets, top_k_index.shape[1])


@triton.jit
def activation_and_derivative(x, ACTIVATION: tl.constexpr):
    """act_fn(x) and act_fn'(x), elementwise, in x's dtype (fp32 or fp64)."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(x)
        return x * sig, sig * (1.0 + x * (1.0 - sig))
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        return x * cdf, cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(y)) = sigmoid(2y), and tanh'(y) = 1 - tanh(y)^2 = 4 sigmoid(2y) (1 - sigmoid(2y))
        sig = tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
        return x * sig, sig + x * 2.0 * sig * (1.0 - sig) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    elif ACTIVATION == "quick_gelu":
        sig = tl.sigmoid(1.702 * x)
        return x * sig, sig + 1.702 * x * sig * (1.0 - sig)
    else:
        return tl.maximum(x, 0.0), tl.where(x > 0.0, 1.0, 0.0).to(x.dtype)


@triton.jit
def expert_tile(offsets_ptr, num_cols, BLOCK_N: tl.constexpr):
    """This program's expert, the span [start, end) of its pairs, and its tile of output columns with their mask.
    The expert is an int64, as the offset of its weights may pass 2**31 elements."""
    expert = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, tl.load(offsets_ptr + expert), tl.load(offsets_ptr + expert + 1), cols, cols < num_cols


@triton.jit
def _up_projection_kernel(
    x_ptr, pair_token_ptr, offsets_ptr, w_ptr, bias_ptr, act_ptr, projected_ptr,
    hidden, width,
    stride_x, stride_w_expert, stride_w_out, stride_w_in, stride_bias, stride_act, stride_projected,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PROJECTED: tl.constexpr,
    ACCUMULATOR: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act (S, I) for the pairs sorted by expert, and with STORE_PROJECTED the pre-activation projection (S, 2I) (or
    (S, I) without a gate); w is gate_up (E, 2I, H), gate rows first (or up (E, I, H) without a gate), in any
    strides."""
    expert, start, end, cols, col_mask = expert_tile(offsets_ptr, width, BLOCK_N)
    w_expert = w_ptr + expert * stride_w_expert
    for row_start in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        tile_mask = row_mask[:, None] & col_mask[None, :]
        tokens = tl.load(pair_token_ptr + rows, mask=row_mask, other=0)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACCUMULATOR)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACCUMULATOR)
        for k_start in range(0, hidden, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden
            x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_gate = tl.load(w_expert + cols[None, :] * stride_w_out + ks[:, None] * stride_w_in, mask=w_mask,
                             other=0.0)
            gate = tl.dot(x, w_gate, gate, input_precision=PRECISION, out_dtype=ACCUMULATOR)
            if HAS_GATE:
                w_up = tl.load(w_expert + (cols[None, :] + width) * stride_w_out + ks[:, None] * stride_w_in,
                               mask=w_mask, other=0.0)
                up = tl.dot(x, w_up, up, input_precision=PRECISION, out_dtype=ACCUMULATOR)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + expert * stride_bias + cols, mask=col_mask, other=0.0).to(ACCUMULATOR)[None, :]
            if HAS_GATE:
                up += tl.load(bias_ptr + expert * stride_bias + width + cols, mask=col_mask,
                              other=0.0).to(ACCUMULATOR)[None, :]
        if STORE_PROJECTED:
            projected = projected_ptr + rows[:, None] * stride_projected + cols[None, :]
            tl.store(projected, gate.to(projected_ptr.dtype.element_ty), mask=tile_mask)
            if HAS_GATE:
                tl.store(projected + width, up.to(projected_ptr.dtype.element_ty), mask=tile_mask)
        activated, _ = activation_and_derivative(gate, ACTIVATION)
        if HAS_GATE:
            activated = activated * up
        tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], activated.to(act_ptr.dtype.element_ty),
                 mask=tile_mask)


@triton.jit
def _scattered_projection_kernel(
    rows_ptr, pair_slot_ptr, slot_weight_ptr, offsets_ptr, w_ptr, bias_ptr, out_ptr,
    num_out, num_in,
    stride_rows, stride_w_expert, stride_w_out, stride_w_in, stride_bias, stride_out,
    HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, ACCUMULATOR: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[slot] (S, num_out) in the accumulator's dtype = rows (S, num_in, sorted by expert) @ W[e]^T (+ b[e]),
    each row times its pair's routing weight if WEIGHTED. The forward pass's down projection (w is down (E, H, I));
    the backward pass runs the input gradient of the up projection on it too (w is gate_up with its two feature
    strides swapped, unweighted)."""
    expert, start, end, cols, col_mask = expert_tile(offsets_ptr, num_out, BLOCK_N)
    w_expert = w_ptr + expert * stride_w_expert
    for row_start in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACCUMULATOR)
        for k_start in range(0, num_in, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < num_in
            inputs = tl.load(rows_ptr + rows[:, None] * stride_rows + ks[None, :],
                             mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_expert + cols[None, :] * stride_w_out + ks[:, None] * stride_w_in,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(inputs, w, acc, input_precision=PRECISION, out_dtype=ACCUMULATOR)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias + cols, mask=col_mask, other=0.0).to(ACCUMULATOR)[None, :]
        slots = tl.load(pair_slot_ptr + rows, mask=row_mask, other=0)
        if WEIGHTED:
            acc *= tl.load(slot_weight_ptr + slots, mask=row_mask, other=0.0).to(ACCUMULATOR)[:, None]
        tl.store(out_ptr + slots[:, None] * stride_out + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


def in_out_strides(weight: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output feature, input feature) strides of a (E, out, in) weight, or of an (E, in, out) one."""
    expert, second, third = weight.stride()
    return (expert, third, second) if transposed else (expert, second, third)


def accumulator(dtype: torch.dtype):
    """The kernels' accumulator dtype: fp64 for fp64 inputs, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """`accumulator` as a torch dtype, for the buffers the kernels accumulate into."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_precision(x: torch.Tensor) -> str | None:
    """fp32 products in IEEE precision, as torch's own matmuls, unless torch allows TF32; else (16-bit or fp64
    inputs) the backend's default."""
    if x.dtype == torch.float32 and not (x.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return None


def row_tiling(num_tokens: int, num_pairs: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK_M, the grid's row-tile axis): about the pairs an expert sees on average, within [MIN_BLOCK_M,
    MAX_BLOCK_M] rows per tile, and enough tiles for the most pairs an expert sees when each token's k experts
    differ (the kernels loop over further tiles otherwise)."""
    block_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, triton.next_power_of_2(max(1, -(-num_pairs // num_experts)))))
    return block_m, triton.cdiv(num_tokens, block_m)


def sum_slots(rows: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, H): each token's k slot rows (T*k, H) summed in slot order, in the rows' (accumulator) dtype, then cast."""
    return rows.view(-1, top_k, rows.shape[-1]).sum(dim=1).to(dtype)


def scattered_projection(
    rows: torch.Tensor, pairs: SortedPairs, weight: torch.Tensor, strides: tuple[int, int, int], num_out: int,
    bias: torch.Tensor | None = None, slot_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `_scattered_projection_kernel`: (S, num_out) rows in slot order, in the accumulator's dtype; the rows
    of masked slots are 0. `strides` are the (expert, output feature, input feature) strides of `weight`."""
    num_pairs, num_in = rows.shape
    num_experts = pairs.offsets.numel() - 1
    block_m, row_blocks = row_tiling(num_pairs // pairs.top_k, num_pairs, num_experts)
    out = torch.zeros(num_pairs, num_out, dtype=accumulator_dtype(rows.dtype), device=rows.device)
    _scattered_projection_kernel[(row_blocks, triton.cdiv(num_out, BLOCK_N), num_experts)](
        rows, pairs.slot, slot_weights if slot_weights is not None else rows, pairs.offsets, weight,
        bias if bias is not None else weight, out,
        num_out, num_in,
        rows.stride(0), *strides, bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, WEIGHTED=slot_weights is not None, ACCUMULATOR=accumulator(rows.dtype),
        PRECISION=dot_precision(rows), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def experts_forward(
    hidden_states: torch.Tensor, pairs: SortedPairs, top_k_weights: torch.Tensor,
    up_weight: torch.Tensor, up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
    layout: ExpertsLayout, projected: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, H) output of the routed experts: the two kernels above, then each token's k rows summed in fp32.

    `up_weight` is gate_up (E, 2I, H) with a gate, else up (E, I, H); `down_weight` is (E, H, I); in the transposed
    layout each is stored with its last two axes swapped. `projected`, an (S, 2I) (or (S, I)) buffer, receives the
    pre-activation up projection for the backward pass."""
    num_tokens, hidden = hidden_states.shape
    num_experts = down_weight.shape[0]
    width = down_weight.shape[1] if layout.transposed else down_weight.shape[2]
    num_pairs = pairs.slot.numel()
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden)

    x = hidden_states.contiguous()
    block_m, row_blocks = row_tiling(num_tokens, num_pairs, num_experts)
    activated = x.new_empty(num_pairs, width)
    _up_projection_kernel[(row_blocks, triton.cdiv(width, BLOCK_N), num_experts)](
        x, pairs.token, pairs.offsets, up_weight, up_bias if up_bias is not None else up_weight, activated,
        projected if projected is not None else activated,
        hidden, width,
        x.stride(0), *in_out_strides(up_weight, layout.transposed), up_bias.stride(0) if up_bias is not None else 0,
        activated.stride(0), projected.stride(0) if projected is not None else 0,
        HAS_GATE=layout.has_gate, HAS_BIAS=up_bias is not None, ACTIVATION=layout.activation,
        STORE_PROJECTED=projected is not None, ACCUMULATOR=accumulator(x.dtype), PRECISION=dot_precision(x),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    weighted = scattered_projection(
        activated, pairs, down_weight, in_out_strides(down_weight, layout.transposed), hidden, bias=down_bias,
        slot_weights=top_k_weights.contiguous(),
    )
    return sum_slots(weighted, pairs.top_k, hidden_states.dtype)
