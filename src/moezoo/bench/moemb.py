"""`moezoo bench moemb`: embeddings per second of MoEMB against transformers' Qwen3.5-MoE forward on the same weights,
for text-only and image + text inputs, with every experts implementation.

transformers' side is `Qwen3_5MoeModel` (the backbone of `Qwen3_5MoeForConditionalGeneration`, whose weights MoEMB
loads as they are, minus `lm_head`) followed by the same pooling: the hidden state of each input's `<emb>` token,
L2-normalised. MoEMB's overhead is its time over transformers' with the same experts implementation; the spec asks
for at most 5%. Both run randomly initialised (fixed seed, fp32 unless asked otherwise, eval mode, no autograd) on
one batch built by `MoEmbProcessor`, on the CPU or a GPU (`device="cuda"`, where moezoo's Triton kernels take the
place of its CPU experts implementation), timed round-robin (one forward of each per round, median over rounds) so
that every ratio compares measurements taken under the same machine load.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch.nn import functional as F
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from ..configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB, MoEmbConfig
from ..modeling.moemb import MoEmbForEmbedding
from ..terminal import console, print_table, progress_bar
from .moe_layer import (
    DEFAULT_IMPLEMENTATIONS,
    check_device,
    check_implementations,
    default_implementations,
    split_runnable,
    synchronize,
)
from .moemb_adaptive import run as run_adaptive
from .moemb_inputs import INPUT_KINDS, bench_inputs
from .timing import add_device_arguments, add_threads_argument, apply_threads, describe_device, time_round_robin

# "cpu": the A3B proportions (3 Gated DeltaNet layers per attention layer, fine-grained experts with a shared one,
# top-8 of many) at a width a CPU runs in tens of milliseconds.
SIZES = {
    "cpu": dict(
        text_config=dict(
            vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
            pad_token_id=0, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                                 mrope_section=[4, 2, 2], mrope_interleaved=True),
        ),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, in_channels=3, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256,
                           num_position_embeddings=256),
        image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003,
        emb_token_id=1004,
    ),
    "tiny": TINY_MOEMB,
    "a3b": MOEMB_CONFIGS["MoEMB-A3B"] | {"emb_token_id": 248077},
}  # fmt: skip
# The default --image-size of each size, in pixels: an image must fit its context (the tiny model's 512 positions
# hold 64 image tokens at 64 px, not the 784 of a 224 px image).
IMAGE_SIZES = {"cpu": 224, "tiny": 64, "a3b": 224}
DEFAULT_SIZE = "cpu"


@dataclass
class EmbedBenchRow:
    inputs: str  # "text" or "image+text"
    model: str  # "moemb" or "transformers"
    impl: str
    batch_size: int
    tokens: float  # mean real tokens per input
    ms: float | None  # per batch
    embeddings_per_second: float | None
    overhead_vs_transformers: float | None = None  # moemb rows: time / transformers' time - 1, same impl
    speedup_vs_eager: float | None = None
    max_abs_diff_vs_transformers: float | None = None  # of the embeddings, moemb rows
    note: str = ""


def bench_configs(size: str = DEFAULT_SIZE) -> tuple[MoEmbConfig, Qwen3_5MoeConfig]:
    """The MoEMB config of a named size and transformers' Qwen3.5-MoE config of the same backbone."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    fields = copy.deepcopy(SIZES[size])
    config = MoEmbConfig(**fields)
    # From the config: a size may leave them at their defaults (the A3B's ids).
    ids = {key: getattr(config, key) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id")}  # fmt: skip
    return config, Qwen3_5MoeConfig(text_config=fields["text_config"], vision_config=fields["vision_config"], **ids)


def build_models(config: MoEmbConfig, qwen_config: Qwen3_5MoeConfig, seed: int = 0):
    """transformers' backbone, randomly initialised, and MoEMB holding the very same weights."""
    torch.manual_seed(seed)
    qwen = Qwen3_5MoeForConditionalGeneration(qwen_config).eval()
    moemb = MoEmbForEmbedding(config).eval()
    weights = {name: tensor for name, tensor in qwen.state_dict().items() if name != "lm_head.weight"}
    moemb.load_state_dict(weights, strict=True)
    return qwen.model, moemb


@torch.no_grad()
def transformers_embeddings(backbone, inputs: dict, impl: str | None = None) -> torch.Tensor:
    """transformers' forward, then MoEMB's pooling: the `<emb>` hidden state of each row, L2-normalised."""
    if impl is not None:
        backbone.set_experts_implementation(impl)
    model_inputs = {key: value for key, value in inputs.items() if key != "pooled_index"}
    hidden_states = backbone(**model_inputs).last_hidden_state
    pooled = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), inputs["pooled_index"]]
    return F.normalize(pooled.float(), dim=-1)


@torch.no_grad()
def moemb_embeddings(model: MoEmbForEmbedding, inputs: dict, impl: str | None = None) -> torch.Tensor:
    if impl is not None:
        model.set_experts_implementation(impl)
    return model(**inputs).embeddings


def _finished(device: str, embed: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`embed(*args)`, finished on return (GPU kernels run asynchronously): the timed call."""
    embeddings = embed(*args)
    synchronize(device)
    return embeddings


def run_moemb_bench(
    config: MoEmbConfig,
    qwen_config: Qwen3_5MoeConfig,
    kinds: Sequence[str] = INPUT_KINDS,
    batch_size: int = 8,
    text_tokens: int = 64,
    image_size: int = 224,
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    seconds_per_case: float = 20.0,
    max_rounds: int = 25,
    seed: int = 0,
    on_case_done: Callable[[str], None] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[EmbedBenchRow]:
    """Time transformers' and MoEMB's forward with every implementation, for each kind of input."""
    check_device(device)
    check_implementations(implementations)
    if batch_size < 1:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    backbone, moemb = (model.to(device, dtype) for model in build_models(config, qwen_config, seed))
    text = config.text_config
    rows = []
    for kind in kinds:
        # floating-point inputs (pixels) in `dtype`, token ids and masks as they are
        inputs = bench_inputs(config, kind, batch_size, text_tokens, image_size, seed).to(device=device, dtype=dtype)
        real_tokens = int(inputs["attention_mask"].sum())
        runnable, skipped = split_runnable(implementations, real_tokens * text.num_experts_per_tok, text.hidden_size,
                                           text.moe_intermediate_size, dtype.itemsize, device=device)  # fmt: skip
        calls, diffs = {}, {}
        for impl in runnable:
            expected = transformers_embeddings(backbone, inputs, impl)
            diffs[impl] = float((moemb_embeddings(moemb, inputs, impl) - expected).abs().max())
            calls[("transformers", impl)] = partial(_finished, device, transformers_embeddings, backbone, inputs, impl)
            calls[("moemb", impl)] = partial(_finished, device, moemb_embeddings, moemb, inputs, impl)
        ms = {name: seconds * 1e3 for name, seconds in time_round_robin(calls, seconds_per_case, max_rounds).items()}
        for impl in implementations:
            for model in ("transformers", "moemb"):
                if impl in skipped:
                    rows.append(EmbedBenchRow(kind, model, impl, batch_size, real_tokens / batch_size, None, None,
                                              note=skipped[impl]))  # fmt: skip
                    continue
                time_ms = ms[model, impl]
                row = EmbedBenchRow(kind, model, impl, batch_size, real_tokens / batch_size, time_ms,
                                    batch_size * 1e3 / time_ms)  # fmt: skip
                if ("moemb", "eager") in ms:
                    row.speedup_vs_eager = ms[model, "eager"] / time_ms
                if model == "moemb":
                    row.overhead_vs_transformers = time_ms / ms["transformers", impl] - 1
                    row.max_abs_diff_vs_transformers = diffs[impl]
                rows.append(row)
        if on_case_done:
            on_case_done(kind)
    return rows


def print_moemb_table(rows: Sequence[EmbedBenchRow], title: str, max_overhead: float = 0.05) -> None:
    print_table(
        title,
        ["inputs", "model", "impl", "batch", "tokens/input", "ms", "embeddings/s", "overhead vs transformers",
         "× eager", "max |Δ| vs transformers"],
        [
            [r.inputs, r.model, r.impl, r.batch_size, r.tokens, r.ms, r.embeddings_per_second,
             None if r.overhead_vs_transformers is None else f"{100 * r.overhead_vs_transformers:+.1f}%",
             r.note or r.speedup_vs_eager, r.max_abs_diff_vs_transformers]
            for r in rows
        ],
    )  # fmt: skip
    measured = [r for r in rows if r.overhead_vs_transformers is not None]
    worst = max(measured, key=lambda r: r.overhead_vs_transformers, default=None)
    if worst is not None:
        verdict = "within" if worst.overhead_vs_transformers <= max_overhead else "ABOVE"
        console.print(
            f"largest MoEMB overhead over transformers' Qwen3.5-MoE forward: "
            f"{100 * worst.overhead_vs_transformers:+.1f}% ({worst.inputs}, {worst.impl}), {verdict} the "
            f"{100 * max_overhead:.0f}% budget. Overhead: MoEMB's time "
            "over transformers' with the same experts implementation; × eager: over MoEMB's own eager time."
        )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo bench moemb`."""
    parser.add_argument("--size", choices=sorted(SIZES), default=DEFAULT_SIZE,
                        help="cpu (width 256, 8 layers, 64 experts top-8: A3B's proportions), tiny (tests) or a3b "
                             "(the paper's backbone: 35 B parameters, far too heavy for a CPU)")
    parser.add_argument("--inputs", nargs="+", choices=INPUT_KINDS, default=list(INPUT_KINDS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--text-tokens", type=int, default=64, help="words per caption, at most (half at least)")
    parser.add_argument("--image-size", type=int,
                        help="square images of image+text inputs, in pixels (default: "
                             + ", ".join(f"{size} {pixels}" for size, pixels in IMAGE_SIZES.items()) + ")")
    add_device_arguments(parser)
    parser.add_argument("--seconds-per-case", type=float, default=20.0, help="time budget per kind of input")
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--adaptive", action="store_true",
                        help="instead: every inference-time adaptive action and budget against full compute on the "
                             "same weights (packed execution), one batch of image + text and text inputs: "
                             "embeddings/s, FLOPs saving, ideal and realised speedup, a verdict per target; "
                             "--seconds-per-case is then the whole timing budget (moezoo.bench.moemb_adaptive)")


def run_bench(args: argparse.Namespace) -> int:
    """`moezoo bench moemb` with the options of `add_bench_arguments`."""
    config, qwen_config = bench_configs(args.size)
    apply_threads(args)
    if args.adaptive:
        return run_adaptive(args, config, args.image_size or IMAGE_SIZES[args.size])
    with progress_bar(transient=True) as progress:
        task = progress.add_task("moemb", total=len(args.inputs))
        rows = run_moemb_bench(
            config, qwen_config, kinds=args.inputs, batch_size=args.batch_size, text_tokens=args.text_tokens,
            image_size=args.image_size or IMAGE_SIZES[args.size],
            implementations=args.impl or default_implementations(args.device), seconds_per_case=args.seconds_per_case,
            on_case_done=lambda kind: progress.update(task, advance=1, description=kind), device=args.device,
            dtype=getattr(torch, args.dtype),
        )  # fmt: skip
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    text = config.text_config
    print_moemb_table(
        rows,
        f"MoEMB ({args.size}): width {text.hidden_size}, {text.num_hidden_layers} layers, "
        f"top-{text.num_experts_per_tok} of {text.num_experts} experts; {args.dtype}, "
        + describe_device(args.device),
    )
    return 0
