"""Triton kernels of the backward pass of moezoo's `moezoo_triton` experts implementation (`triton_experts.py`; the
forward pass and the pieces shared with it: `triton_kernels.py`).

For the pairs p = (token t, slot s) sorted by expert e, with routing weight w, pre-activation projection h (saved by
the forward pass), activation a = act(h_gate) * h_up (or act(h)) and G = dL/d output (T, H):

    kernel 1  ga[p] = G[t] @ W_down[e]                                      (S, I), the gather fused into the GEMM
              epilogue: dh[p] = w * ga[p] * d a / d h (the activation's derivative, from h)        (S, 2I)
                        dL/dw[p] = ga[p] . a[p] + G[t] . b_down[e]    (per tile of I, summed over the tiles after)
                        a[p], for the down projection's weight gradient
    kernel 2  dW_down[e] = sum_p (w G[t])^T a[p],  db_down[e] = sum_p w G[t]             grouped GEMM over the pairs
              dW_up[e] = sum_p dh[p]^T x[t],       db_up[e] = sum_p dh[p]                (the same kernel)
    then      dx[slot] = dh[p] @ W_up[e]  (the forward pass's scattered projection, unweighted), and each token's
              k rows summed in slot order, as the forward pass sums its output

Products accumulate in fp32 (fp64 for fp64 inputs); dh and a are kept in the input dtype, as the forward pass keeps
its activation. Masked slots (expert index E) are outside every expert's span: they get no gradient, their routing
weights' gradient is 0.
"""

from __future__ import annotations

import torch
from transformers.utils.import_utils import is_triton_available

from .triton_kernels import (
    BLOCK_K,
    BLOCK_N,
    ExpertsLayout,
    SortedPairs,
    accumulator,
    accumulator_dtype,
    activation_and_derivative,
    dot_precision,
    expert_tile,
    in_out_strides,
    row_tiling,
    scattered_projection,
    sum_slots,
)


# Imported only when triton is installed, as `triton_kernels.py`.
if is_triton_available():
    import triton
    import triton.language as tl


# The weight-gradient tiles: (output features) x (input features), summed over BLOCK_PAIRS pairs at a time.
BLOCK_OUT, BLOCK_IN, BLOCK_PAIRS = 64, 64, 32


@triton.jit
def _down_backward_kernel(
    grad_ptr, pair_token_ptr, pair_slot_ptr, slot_weight_ptr, offsets_ptr, w_ptr, bias_ptr, projected_ptr,
    grad_projected_ptr, act_ptr, weight_grad_ptr,
    hidden, width, num_pairs,
    stride_grad, stride_w_expert, stride_w_out, stride_w_in, stride_bias, stride_projected, stride_grad_projected,
    stride_act,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_ACT: tl.constexpr,
    ACCUMULATOR: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Kernel 1 above, for one tile of the I columns: dh (S, 2I) (or (S, I) without a gate), with STORE_ACT the
    activation (S, I), and this tile's part of each pair's routing-weight gradient, at weight_grad[tile, slot]."""
    expert, start, end, cols, col_mask = expert_tile(offsets_ptr, width, BLOCK_N)
    w_expert = w_ptr + expert * stride_w_expert
    for row_start in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        tile_mask = row_mask[:, None] & col_mask[None, :]
        tokens = tl.load(pair_token_ptr + rows, mask=row_mask, other=0)
        slots = tl.load(pair_slot_ptr + rows, mask=row_mask, other=0)
        grad_act = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACCUMULATOR)  # dL/da before the routing weight
        grad_dot_bias = tl.zeros((BLOCK_M,), dtype=ACCUMULATOR)  # G[t] . b_down[e]
        for k_start in range(0, hidden, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden
            grad = tl.load(grad_ptr + tokens[:, None] * stride_grad + ks[None, :],
                           mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            # W_down[e] read as (H, I): its output features are this product's inputs
            w = tl.load(w_expert + ks[:, None] * stride_w_out + cols[None, :] * stride_w_in,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            grad_act = tl.dot(grad, w, grad_act, input_precision=PRECISION, out_dtype=ACCUMULATOR)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + expert * stride_bias + ks, mask=k_mask, other=0.0).to(ACCUMULATOR)
                grad_dot_bias += tl.sum(grad.to(ACCUMULATOR) * bias[None, :], axis=1)

        projected = projected_ptr + rows[:, None] * stride_projected + cols[None, :]
        activated, derivative = activation_and_derivative(
            tl.load(projected, mask=tile_mask, other=0.0).to(ACCUMULATOR), ACTIVATION
        )
        act = activated
        if HAS_GATE:
            up = tl.load(projected + width, mask=tile_mask, other=0.0).to(ACCUMULATOR)
            act = activated * up
        # dL/dw = G[t] . (a @ W_down^T + b) = ga . a + G[t] . b; the bias term once, in the first column tile
        weight_grad = tl.sum(grad_act * act, axis=1)
        if HAS_BIAS:
            weight_grad += tl.where(tl.program_id(1) == 0, grad_dot_bias, 0.0)
        tl.store(weight_grad_ptr + tl.program_id(1) * num_pairs + slots, weight_grad, mask=row_mask)

        grad_act *= tl.load(slot_weight_ptr + slots, mask=row_mask, other=0.0).to(ACCUMULATOR)[:, None]
        grad_projected = grad_projected_ptr + rows[:, None] * stride_grad_projected + cols[None, :]
        dtype = grad_projected_ptr.dtype.element_ty
        if HAS_GATE:
            tl.store(grad_projected, (grad_act * up * derivative).to(dtype), mask=tile_mask)
            tl.store(grad_projected + width, (grad_act * activated).to(dtype), mask=tile_mask)
        else:
            tl.store(grad_projected, (grad_act * derivative).to(dtype), mask=tile_mask)
        if STORE_ACT:
            tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], act.to(act_ptr.dtype.element_ty),
                     mask=tile_mask)


@triton.jit
def _weight_grad_kernel(
    left_ptr, right_ptr, pair_token_ptr, pair_slot_ptr, slot_weight_ptr, offsets_ptr, grad_w_ptr, grad_bias_ptr,
    num_out, num_in,
    stride_left, stride_right, stride_grad_expert, stride_grad_out, stride_grad_in, stride_grad_bias,
    LEFT_BY_TOKEN: tl.constexpr, LEFT_WEIGHTED: tl.constexpr, RIGHT_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACCUMULATOR: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """Kernel 2 above: grad_w[e] (out, in) = sum over expert e's pairs p of left[p]^T right[p], and with HAS_BIAS
    grad_bias[e] = sum_p left[p]. A pair's row of `left` / `right` is the pair's own (rows sorted by expert) or its
    token's (BY_TOKEN); with LEFT_WEIGHTED it is scaled by the pair's routing weight. Experts without pairs get 0."""
    expert = tl.program_id(2).to(tl.int64)
    outs = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    ins = tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    out_mask, in_mask = outs < num_out, ins < num_in
    start, end = tl.load(offsets_ptr + expert), tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_OUT, BLOCK_IN), dtype=ACCUMULATOR)
    bias_acc = tl.zeros((BLOCK_OUT,), dtype=ACCUMULATOR)
    for pair_start in range(start, end, BLOCK_PAIRS):
        pairs = pair_start + tl.arange(0, BLOCK_PAIRS)
        pair_mask = pairs < end
        left_rows = pairs
        if LEFT_BY_TOKEN:
            left_rows = tl.load(pair_token_ptr + pairs, mask=pair_mask, other=0)
        right_rows = pairs
        if RIGHT_BY_TOKEN:
            right_rows = tl.load(pair_token_ptr + pairs, mask=pair_mask, other=0)
        left = tl.load(left_ptr + left_rows[None, :] * stride_left + outs[:, None],  # (out, pairs): left^T
                       mask=out_mask[:, None] & pair_mask[None, :], other=0.0)
        if LEFT_WEIGHTED:
            slots = tl.load(pair_slot_ptr + pairs, mask=pair_mask, other=0)
            scaled = left.to(ACCUMULATOR) * tl.load(slot_weight_ptr + slots, mask=pair_mask,
                                                    other=0.0).to(ACCUMULATOR)[None, :]
            left = scaled.to(left_ptr.dtype.element_ty)
        right = tl.load(right_ptr + right_rows[:, None] * stride_right + ins[None, :],
                        mask=pair_mask[:, None] & in_mask[None, :], other=0.0)
        acc = tl.dot(left, right, acc, input_precision=PRECISION, out_dtype=ACCUMULATOR)
        if HAS_BIAS:
            bias_acc += tl.sum(left.to(ACCUMULATOR), axis=1)
    tl.store(grad_w_ptr + expert * stride_grad_expert + outs[:, None] * stride_grad_out + ins[None, :] * stride_grad_in,
             acc.to(grad_w_ptr.dtype.element_ty), mask=out_mask[:, None] & in_mask[None, :])
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            tl.store(grad_bias_ptr + expert * stride_grad_bias + outs, bias_acc.to(grad_bias_ptr.dtype.element_ty),
                     mask=out_mask)


def _weight_grad(
    left: torch.Tensor, right: torch.Tensor, pairs: SortedPairs, weight: torch.Tensor, bias: torch.Tensor | None,
    transposed: bool, left_by_token: bool, right_by_token: bool, slot_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch `_weight_grad_kernel`: the gradients of `weight` (E, out, in) (or (E, in, out) if transposed) and of
    `bias` (E, out) from the rows `left` (out features) and `right` (in features) of each expert's pairs."""
    num_experts = weight.shape[0]
    grad_weight = torch.empty_like(weight)
    grad_bias = torch.empty_like(bias) if bias is not None else None
    num_out, num_in = left.shape[1], right.shape[1]
    _weight_grad_kernel[(triton.cdiv(num_out, BLOCK_OUT), triton.cdiv(num_in, BLOCK_IN), num_experts)](
        left, right, pairs.token, pairs.slot, slot_weights if slot_weights is not None else left, pairs.offsets,
        grad_weight, grad_bias if grad_bias is not None else grad_weight,
        num_out, num_in,
        left.stride(0), right.stride(0), *in_out_strides(grad_weight, transposed),
        grad_bias.stride(0) if grad_bias is not None else 0,
        LEFT_BY_TOKEN=left_by_token, LEFT_WEIGHTED=slot_weights is not None, RIGHT_BY_TOKEN=right_by_token,
        HAS_BIAS=grad_bias is not None, ACCUMULATOR=accumulator(left.dtype), PRECISION=dot_precision(left),
        BLOCK_OUT=BLOCK_OUT, BLOCK_IN=BLOCK_IN, BLOCK_PAIRS=BLOCK_PAIRS,
    )
    return grad_weight, grad_bias


def experts_backward(
    grad_output: torch.Tensor, hidden_states: torch.Tensor, pairs: SortedPairs, top_k_weights: torch.Tensor,
    projected: torch.Tensor, up_weight: torch.Tensor, up_bias: torch.Tensor | None, down_weight: torch.Tensor,
    down_bias: torch.Tensor | None, layout: ExpertsLayout, need_x: bool, need_up: bool, need_down: bool,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `triton_kernels.experts_forward` from dL/d output (T, H), given the pre-activation projection
    it saved: (dx (T, H), d top_k_weights (T, k), d up_weight, d up_bias, d down_weight, d down_bias). dx is None
    unless `need_x`; the up (down) projection's gradients are None unless `need_up` (`need_down`)."""
    num_tokens, hidden = hidden_states.shape
    num_experts = down_weight.shape[0]
    num_pairs, width = projected.shape[0], projected.shape[1] // (2 if layout.has_gate else 1)
    x, grad, slot_weights = hidden_states.contiguous(), grad_output.contiguous(), top_k_weights.contiguous()
    precision, accumulate = dot_precision(x), accumulator(x.dtype)

    block_m, row_blocks = row_tiling(num_tokens, num_pairs, num_experts)
    column_tiles = triton.cdiv(width, BLOCK_N)
    grad_projected = torch.empty_like(projected)
    activated = x.new_empty(num_pairs, width) if need_down else None
    weight_grad_parts = torch.zeros(column_tiles, num_pairs, dtype=accumulator_dtype(x.dtype), device=x.device)
    _down_backward_kernel[(row_blocks, column_tiles, num_experts)](
        grad, pairs.token, pairs.slot, slot_weights, pairs.offsets, down_weight,
        down_bias if down_bias is not None else down_weight, projected, grad_projected,
        activated if activated is not None else grad_projected, weight_grad_parts,
        hidden, width, num_pairs,
        grad.stride(0), *in_out_strides(down_weight, layout.transposed),
        down_bias.stride(0) if down_bias is not None else 0, projected.stride(0), grad_projected.stride(0),
        activated.stride(0) if activated is not None else 0,
        HAS_GATE=layout.has_gate, HAS_BIAS=down_bias is not None, ACTIVATION=layout.activation,
        STORE_ACT=activated is not None, ACCUMULATOR=accumulate, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    grad_weights = weight_grad_parts.sum(0).view(num_tokens, pairs.top_k).to(top_k_weights.dtype)

    grad_down_weight = grad_down_bias = grad_up_weight = grad_up_bias = grad_x = None
    if need_down:
        grad_down_weight, grad_down_bias = _weight_grad(
            grad, activated, pairs, down_weight, down_bias, layout.transposed, left_by_token=True,
            right_by_token=False, slot_weights=slot_weights,
        )
    if need_up:
        grad_up_weight, grad_up_bias = _weight_grad(
            grad_projected, x, pairs, up_weight, up_bias, layout.transposed, left_by_token=False, right_by_token=True,
        )
    if need_x:
        # dx = dh @ W_up[e]: W_up's output features are this product's inputs, so its two feature strides swap
        expert_stride, out_stride, in_stride = in_out_strides(up_weight, layout.transposed)
        grad_pairs = scattered_projection(grad_projected, pairs, up_weight, (expert_stride, in_stride, out_stride),
                                          hidden)
        grad_x = sum_slots(grad_pairs, pairs.top_k, hidden_states.dtype)
    return grad_x, grad_weights, grad_up_weight, grad_up_bias, grad_down_weight, grad_down_bias
