"""The dtype a train command loads the weights in: each recipe's `dtype` option (`--dtype`), beside the Trainer's
mixed precision (`--bf16` / `TrainingArguments(bf16=True)`: autocast over the weights as loaded). `None` keeps the
folder's own dtype; `"bfloat16"` halves the memory of weights, gradients and optimizer state, which a paper-scale
model needs. Whatever the dtype, the zoo's fp32 numerics stay fp32 (`moezoo.modeling.moe.precision`: router logits,
balancing, routing terms, contrastive logits) and so do its fp32 buffers (balancing bias, SMoES statistics, depth
usage EMA). See docs/training.md, "Mixed precision"."""

from __future__ import annotations

from ..modeling.moe.precision import DTYPES


def add_dtype_argument(parser, default: str = "the folder's own") -> None:
    """`--dtype`, the same for every train command; `default` says what its absence loads."""
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help=f"load the weights in this dtype and train them in it (default: {default}); "
                             "bfloat16 halves the memory of weights, gradients and optimizer state; --bf16 instead "
                             "runs the matmuls in bf16 over the weights as loaded (autocast)")  # fmt: skip


def load_dtype(name: str | None) -> dict:
    """`from_pretrained`'s keyword arguments for a recipe's `dtype` option: none for None (the folder's own dtype)."""
    if name is None:
        return {}
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or None for the folder's own), got {name!r}")
    return {"dtype": DTYPES[name]}
