"""`moezoo bench omnimoe_vl`: what the coupled visual-depth routed projector costs at inference, in one run.

OmniMoE-VL is timed against the same model with its projector replaced by LLaVA-1.5's dense one (Linear -> GELU ->
Linear on the last visual stream) of as many active parameters, all other weights shared: the very same vision tower,
language model and experts, the projector that a call measures swapped in before it. The routed projector computes
every stream's projection and the depth route at prefill, and its injection adds a low-rank update before each
selected anchor layer at every decode step (paper Table 6b measured OmniMoE-VL's decode 11.1% slower than
Qwen3-VL-8B's on two H800s).

The model is randomly initialised (fixed seed, eval mode, no autograd) and given one batch of random images and
prompts:
- prefill latency: one forward over the prompt and its image placeholders, filling the KV cache;
- generation: `generate` with greedy decoding of exactly `--new-tokens` tokens (the prefill included), reported in
  generated tokens per second over the batch.
Calls are timed round-robin (one of each per round, median over rounds), so that every ratio compares measurements
taken under the same load.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn

from ..configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from ..modeling.moe import count_parameters
from ..modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from ..modeling.omnimoe_vl_projector import OmniMoeVlProjectorOutput
from ..presets.omnimoe_vl import MID_OMNIMOE_VL, PAPER_OMNIMOE_VL
from ..terminal import console, print_table
from .moe_layer import check_device, synchronize
from .timing import DEVICES, add_threads_argument, apply_threads, time_round_robin

# Model sizes by name. "cpu" keeps the paper's structure (experts on even blocks of both stacks, top-1 vision and
# top-2 language, 16 prototypes, 8 router queries, top-4 depths, injection before the first layers) with 6 streams,
# at a width a CPU decodes in tens of milliseconds per token.
SIZES = {
    "cpu": dict(
        vision_config=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=11, num_attention_heads=3,
                           image_size=224, patch_size=16, num_experts=8, num_experts_per_tok=1),
        text_config=dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=2048, pad_token_id=0),
        image_token_id=4093, vision_start_token_id=4094, vision_end_token_id=4095,
        vision_feature_layers=[1, 3, 5, 7, 9, 11], injection_layers=list(range(6)), fusion_group_size=14,
        injection_rank=16, adapter_rank=16, projector_attn_dim=128, projector_attn_heads=4, depth_score_hidden=128,
    ),
    "tiny": TINY_OMNIMOE_VL,
    "mid": MID_OMNIMOE_VL,
    "paper": PAPER_OMNIMOE_VL,
}  # fmt: skip
DEFAULT_SIZE = "cpu"


class DenseMlpProjector(nn.Module):
    """LLaVA-1.5's projector in place of OmniMoE-VL's: `Linear(d_V, hidden) -> GELU -> Linear(hidden, d)` on the last
    visual stream, one token per patch. It returns what the model reads of a projector output, the fused tokens, and
    no route: the model then runs without injection."""

    def __init__(self, vision_width: int, text_width: int, hidden_width: int):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, hidden_width)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(hidden_width, text_width)

    def forward(
        self, streams: torch.Tensor, prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor, route_override=None
    ) -> OmniMoeVlProjectorOutput:  # streams (B, S, N, d_V) -> fused tokens (B, N, d); the prompt is not read
        return OmniMoeVlProjectorOutput(fused_tokens=self.linear_2(self.act(self.linear_1(streams[:, -1]))))


def dense_projector_width(parameters: int, vision_width: int, text_width: int) -> int:
    """The hidden width of a `DenseMlpProjector` with `parameters` parameters (nearest), which has
    `hidden * (vision_width + 1 + text_width) + text_width` of them."""
    return max(1, round((parameters - text_width) / (vision_width + 1 + text_width)))


def dense_projector_for(model: OmniMoeVlForConditionalGeneration) -> DenseMlpProjector:
    """A `DenseMlpProjector` of as many active parameters as the model's projector, on its device and dtype."""
    config = model.config
    vision_width, text_width = config.vision_config.hidden_size, config.text_config.hidden_size
    width = dense_projector_width(count_parameters(model.model.projector).active, vision_width, text_width)
    weight = model.model.projector.fusion_output_scale
    return DenseMlpProjector(vision_width, text_width, width).to(weight.device, weight.dtype)


@dataclass
class GenerationBenchRow:
    model: str  # "omnimoe_vl" or "dense_mlp"
    batch_size: int
    prompt_tokens: int  # per row, image placeholders included
    new_tokens: int  # generated per row
    projector_parameters: int
    active_parameters: int  # of the whole model, per token
    prefill_ms: float
    generate_ms: float
    tokens_per_second: float  # generated tokens of the batch per second of `generate`
    prefill_vs_dense: float  # prefill latency over the dense projector's
    tokens_per_second_vs_dense: float  # generation throughput over the dense projector's


def bench_inputs(config: OmniMoeVlConfig, batch_size: int, text_tokens: int, seed: int = 0,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random images (normalised pixels in [-1, 1]) and prompts `<|vision_start|> <|image_pad|> x N <|vision_end|>`
    followed by `text_tokens` random text tokens, which are the prompt the route reads."""
    generator = torch.Generator().manual_seed(seed)
    specials = (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id)
    # Text ids below the special ones (the tiny and Qwen3 vocabularies put them last): never an image placeholder.
    text = torch.randint(1, min(specials), (batch_size, text_tokens), generator=generator)
    image = torch.tensor([config.vision_start_token_id, *[config.image_token_id] * config.num_image_tokens,
                          config.vision_end_token_id]).expand(batch_size, -1)  # fmt: skip
    input_ids = torch.cat([image, text], dim=1)
    vision = config.vision_config
    pixel_values = torch.rand(batch_size, vision.num_channels, vision.image_size, vision.image_size,
                              generator=generator) * 2 - 1  # fmt: skip
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids).to(device),
            "pixel_values": pixel_values.to(device, dtype)}  # fmt: skip


def _prefill(model, projector: nn.Module, inputs: dict[str, torch.Tensor], device: str) -> torch.Tensor:
    model.model.projector = projector
    logits = model(**inputs, use_cache=True, logits_to_keep=1).logits
    synchronize(device)
    return logits


def _generate(model, projector: nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int, device: str):
    model.model.projector = projector
    output = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(device)
    return output


def run_omnimoe_vl_bench(
    config: OmniMoeVlConfig,
    batch_size: int = 1,
    text_tokens: int = 32,
    new_tokens: int = 16,
    seconds: float = 20.0,
    max_rounds: int = 25,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[GenerationBenchRow]:
    """One row per projector: OmniMoE-VL's, then the dense one in its place (the model's other weights are the same
    modules: each timed call sets the projector it measures)."""
    check_device(device)
    for name, value in (("batch size", batch_size), ("text tokens", text_tokens), ("new tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = OmniMoeVlForConditionalGeneration._from_config(config, dtype=dtype).eval()
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    projectors = {"omnimoe_vl": model.model.projector, "dense_mlp": dense_projector_for(model)}
    inputs = bench_inputs(config, batch_size, text_tokens, seed, device, dtype)
    calls, counts = {}, {}
    try:
        with torch.no_grad():
            for name, projector in projectors.items():
                calls[name, "prefill"] = partial(_prefill, model, projector, inputs, device)
                calls[name, "generate"] = partial(_generate, model, projector, inputs, new_tokens, device)
                for call in (calls[name, "prefill"], calls[name, "generate"]):  # warm-up: no round is a cold start
                    call()
                counts[name] = count_parameters(model)  # with this projector in place
            seconds_per_call = time_round_robin(calls, seconds, max_rounds)
    finally:
        model.model.projector = projectors["omnimoe_vl"]
    rows = []
    for name, projector in projectors.items():
        prefill, generate = seconds_per_call[name, "prefill"], seconds_per_call[name, "generate"]
        rows.append(
            GenerationBenchRow(
                model=name, batch_size=batch_size, prompt_tokens=inputs["input_ids"].shape[1], new_tokens=new_tokens,
                projector_parameters=count_parameters(projector).total, active_parameters=counts[name].active,
                prefill_ms=prefill * 1e3, generate_ms=generate * 1e3,
                tokens_per_second=batch_size * new_tokens / generate,
                prefill_vs_dense=prefill / seconds_per_call["dense_mlp", "prefill"],
                tokens_per_second_vs_dense=seconds_per_call["dense_mlp", "generate"] / generate,
            )
        )  # fmt: skip
    return rows


def print_omnimoe_vl_table(rows: Sequence[GenerationBenchRow], title: str) -> None:
    print_table(
        title,
        ["projector", "projector params (M)", "active params (M)", "batch", "prompt tokens", "new tokens",
         "prefill ms", "generate ms", "tokens/s", "prefill × dense", "tokens/s × dense"],
        [
            [row.model, row.projector_parameters / 1e6, row.active_parameters / 1e6, row.batch_size,
             row.prompt_tokens, row.new_tokens, row.prefill_ms, row.generate_ms, row.tokens_per_second,
             row.prefill_vs_dense, row.tokens_per_second_vs_dense]
            for row in rows
        ],
    )  # fmt: skip
    console.print(
        "dense_mlp: the same model with LLaVA's two-layer MLP projector on the last stream, of as many parameters as "
        "the routed projector, and no injection. × dense: over dense_mlp, measured in the same run (prefill: above 1 "
        "is slower; tokens/s: below 1 is slower)."
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo bench omnimoe_vl`."""
    parser.add_argument("--size", choices=list(SIZES), default=DEFAULT_SIZE,
                        help="cpu (vision width 192, 11 blocks, 196 patches; language width 256, 8 layers; 6 streams), "
                             "tiny (tests), mid (omnimoe-vl-qwen3-1.7b) or paper (omnimoe-vl-qwen3-8b: a GPU's "
                             "work)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--text-tokens", type=int, default=32, help="prompt tokens after the image placeholders")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per row")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seconds", type=float, default=20.0, help="time budget for the timing rounds")
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_bench(args: argparse.Namespace) -> int:
    """`moezoo bench omnimoe_vl` with the options of `add_bench_arguments`."""
    apply_threads(args)
    config = OmniMoeVlConfig(**copy.deepcopy(SIZES[args.size]))
    with console.status(f"timing OmniMoE-VL ({args.size}) against a dense MLP projector"):
        rows = run_omnimoe_vl_bench(
            config, batch_size=args.batch_size, text_tokens=args.text_tokens, new_tokens=args.new_tokens,
            seconds=args.seconds, device=args.device, dtype=getattr(torch, args.dtype),
        )  # fmt: skip
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    vision, text = config.vision_config, config.text_config
    print_omnimoe_vl_table(
        rows,
        f"OmniMoE-VL ({args.size}): vision width {vision.hidden_size}, {vision.num_hidden_layers} blocks, "
        f"{config.num_image_tokens} patches; language width {text.hidden_size}, {text.num_hidden_layers} layers; "
        f"{config.num_streams} streams, top-{config.depth_top_k}; {args.dtype}, "
        + (torch.cuda.get_device_name() if args.device == "cuda" else f"CPU threads: {torch.get_num_threads()}"),
    )
    return 0
