"""Triton kernels of moezoo's `moezoo_triton` experts implementation (see `triton_experts.py`), after MoE-ViE's
"two kernel launches" forward (moe_vie.md §3, the paper's Alg. 1):

    kernel 1  act[p] = act_fn(x[token(p)] @ W_gate[e]^T (+ b)) * (x[token(p)] @ W_up[e]^T (+ b))   (S, I)
              the gather of the input rows is fused into the GEMM, the activation into its epilogue
    kernel 2  out[slot(p)] = w(p) * (act[p] @ W_down[e]^T (+ b))                                      (S, H), fp32
              the routing weight is fused into the epilogue, rows are written back in slot order

over the S = T * k (token, slot) pairs sorted by expert (p); expert e owns the pairs offsets[e] .. offsets[e+1]. The
caller sums each token's k rows of `out` in slot order (deterministic, unlike an atomic scatter-add). Products
accumulate in fp32 whatever the input dtype.

Each program takes one (BLOCK_M x BLOCK_N) tile of one expert's pairs; the grid's first axis is sized by the tokens
of the call (no expert sees more pairs than there are tokens when each token's k experts differ, as top-k routing
makes them), so no device-to-host sync is needed to size it, and a program loops over further tiles in the rare
case that an expert has more pairs (a token routed twice to one expert).

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors in fp32 (how the tests check them on a machine
without a GPU).
"""

from __future__ import annotations

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


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return x * tl.sigmoid(x)
    elif ACTIVATION == "gelu":
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * inner)
    elif ACTIVATION == "quick_gelu":
        return x * tl.sigmoid(1.702 * x)
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _expert_tile(offsets_ptr, num_cols, BLOCK_N: tl.constexpr):
    """This program's expert, the span [start, end) of its pairs, and its tile of output columns with their mask."""
    expert = tl.program_id(2)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, tl.load(offsets_ptr + expert), tl.load(offsets_ptr + expert + 1), cols, cols < num_cols


@triton.jit
def _up_projection_kernel(
    x_ptr, pair_token_ptr, offsets_ptr, w_ptr, bias_ptr, act_ptr,
    hidden, width,
    stride_x, stride_w_expert, stride_w_out, stride_w_in, stride_bias, stride_act,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act (S, I) for the pairs sorted by expert; w is gate_up (E, 2I, H), gate rows first (or up (E, I, H) without
    a gate), in any strides."""
    expert, start, end, cols, col_mask = _expert_tile(offsets_ptr, width, BLOCK_N)
    w_expert = w_ptr + expert * stride_w_expert
    for row_start in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        tokens = tl.load(pair_token_ptr + rows, mask=row_mask, other=0)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, hidden, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden
            x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_gate = tl.load(w_expert + cols[None, :] * stride_w_out + ks[:, None] * stride_w_in, mask=w_mask, other=0.0)
            gate = tl.dot(x, w_gate, gate, input_precision=PRECISION)
            if HAS_GATE:
                w_up = tl.load(w_expert + (cols[None, :] + width) * stride_w_out + ks[:, None] * stride_w_in,
                               mask=w_mask, other=0.0)
                up = tl.dot(x, w_up, up, input_precision=PRECISION)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + expert * stride_bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_GATE:
                up += tl.load(bias_ptr + expert * stride_bias + width + cols, mask=col_mask,
                              other=0.0).to(tl.float32)[None, :]
        activated = _activation(gate, ACTIVATION)
        if HAS_GATE:
            activated = activated * up
        tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], activated.to(act_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_projection_kernel(
    act_ptr, pair_slot_ptr, slot_weight_ptr, offsets_ptr, w_ptr, bias_ptr, out_ptr,
    hidden, width,
    stride_act, stride_w_expert, stride_w_out, stride_w_in, stride_bias, stride_out,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[slot] (S, H) in fp32 for the pairs sorted by expert, each row times its pair's routing weight; w is down
    (E, H, I) in any strides."""
    expert, start, end, cols, col_mask = _expert_tile(offsets_ptr, hidden, BLOCK_N)
    w_expert = w_ptr + expert * stride_w_expert
    for row_start in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, width, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < width
            act = tl.load(act_ptr + rows[:, None] * stride_act + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                          other=0.0)
            w = tl.load(w_expert + cols[None, :] * stride_w_out + ks[:, None] * stride_w_in,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(act, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        slots = tl.load(pair_slot_ptr + rows, mask=row_mask, other=0)
        acc *= tl.load(slot_weight_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + slots[:, None] * stride_out + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


def _in_out_strides(weight: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output feature, input feature) strides of a (E, out, in) weight, or of an (E, in, out) one."""
    expert, second, third = weight.stride()
    return (expert, third, second) if transposed else (expert, second, third)


def _dot_precision(x: torch.Tensor) -> str | None:
    """fp32 products in IEEE precision, as torch's own matmuls, unless torch allows TF32; else (16-bit inputs) the
    backend's default."""
    if x.dtype == torch.float32 and not (x.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return None


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: about the pairs an expert sees on average, within [MIN_BLOCK_M, MAX_BLOCK_M]."""
    return max(MIN_BLOCK_M, min(MAX_BLOCK_M, triton.next_power_of_2(max(1, -(-num_pairs // num_experts)))))


def experts_forward(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    up_weight: torch.Tensor, up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
    has_gate: bool, transposed: bool, activation: str,
) -> torch.Tensor:
    """(T, H) output of the routed experts: the two kernels above, then each token's k rows summed in fp32.

    `up_weight` is gate_up (E, 2I, H) with `has_gate`, else up (E, I, H); `down_weight` is (E, H, I); with
    `transposed`, each is stored with its last two axes swapped (transformers' `is_transposed`)."""
    num_tokens, hidden = hidden_states.shape
    num_experts, top_k = down_weight.shape[0], top_k_index.shape[1]
    width = down_weight.shape[1] if transposed else down_weight.shape[2]
    num_pairs = num_tokens * top_k
    device = hidden_states.device
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden)

    # Pairs grouped by expert without a device-to-host sync: a stable sort and a histogram.
    expert_ids = top_k_index.reshape(-1)
    pair_slot = torch.argsort(expert_ids, stable=True)
    pair_token = pair_slot // top_k
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:].scatter_add_(0, expert_ids.to(torch.int64), torch.ones_like(expert_ids, dtype=torch.int64))
    offsets = offsets.cumsum(0)

    x = hidden_states.contiguous()
    precision = _dot_precision(x)
    block_m = _block_m(num_pairs, num_experts)
    row_blocks = triton.cdiv(num_tokens, block_m)

    activated = x.new_empty(num_pairs, width)
    _up_projection_kernel[(row_blocks, triton.cdiv(width, BLOCK_N), num_experts)](
        x, pair_token, offsets, up_weight, up_bias if up_bias is not None else up_weight, activated,
        hidden, width,
        x.stride(0), *_in_out_strides(up_weight, transposed), up_bias.stride(0) if up_bias is not None else 0,
        activated.stride(0),
        HAS_GATE=has_gate, HAS_BIAS=up_bias is not None, ACTIVATION=activation, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    weighted = torch.empty(num_pairs, hidden, dtype=torch.float32, device=device)
    _down_projection_kernel[(row_blocks, triton.cdiv(hidden, BLOCK_N), num_experts)](
        activated, pair_slot, top_k_weights.contiguous(), offsets, down_weight,
        down_bias if down_bias is not None else down_weight, weighted,
        hidden, width,
        activated.stride(0), *_in_out_strides(down_weight, transposed),
        down_bias.stride(0) if down_bias is not None else 0, weighted.stride(0),
        HAS_BIAS=down_bias is not None, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
