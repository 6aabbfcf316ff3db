"""`moezoo bench mote`: per-sample latency, FLOPs and parameters of MoTE as the number of stored task experts grows,
against the dense model it is converted from (spec mote.md §3.6, §9 item 2; paper A.1 and Table 3).

A MoTE sample runs the shared expert and its one routed expert in every layer, however many experts are stored: the
stored parameters grow by one FFN per expert, the active parameters and the compute stay flat, at one FFN per layer
more than the dense model (the shared expert). The benchmark measures exactly that on text-only Llama decoders:

- the dense `LlamaForCausalLM` and `LlamaMoteForCausalLM` with 1 to 16 experts, all randomly initialised from one
  seed (fp32, eval mode, no autograd), each given the same sample of `tokens` token ids (the MoTE models on their last
  route);
- FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` (exact, independent of the machine's load);
- latencies timed round-robin in one run (one forward of each model per round, median over rounds), so every ratio
  compares measurements taken under the same load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from ..configuration.mote import LLAMA_3_2_1B_INSTRUCT, TINY_LLAMA, LlamaMoteConfig
from ..modeling.moe.accounting import count_parameters
from ..modeling.mote.llama import LlamaMoteForCausalLM
from ..terminal import console, print_table, progress_bar
from .timing import add_threads_argument, apply_threads, time_round_robin


# Decoder sizes by name. "cpu" keeps Llama-3.2-1B's proportions (FFN 4x the width, 4 query heads per KV head) at an
# eighth of its width and a quarter of its depth.
SIZES = {
    "cpu": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "tiny": TINY_LLAMA,
    "llama-3.2-1b": LLAMA_3_2_1B_INSTRUCT,
}
DEFAULT_SIZE = "cpu"
DEFAULT_EXPERTS = (1, 2, 4, 8, 16)


@dataclass
class MoteBenchRow:
    model: str  # "dense" or "mote"
    experts: int | None  # stored routed experts (MoTE rows)
    tokens: int  # per sample
    total_parameters: int
    active_parameters: int  # used by one sample
    gflops: float  # per sample
    ms: float  # per sample
    flops_vs_dense: float
    latency_vs_dense: float


def mote_config(base: dict, num_experts: int) -> LlamaMoteConfig:
    """The MoTE decoder of `base` with `num_experts` routed experts and a shared expert."""
    return LlamaMoteConfig(**base, mote_expert_names=[f"task_{index}" for index in range(num_experts)])


def _forward(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).logits


def count_flops(model, inputs: dict[str, torch.Tensor]) -> int:
    with FlopCounterMode(display=False) as counter:
        _forward(model, inputs)
    return counter.get_total_flops()


def run_mote_bench(
    base: dict,
    num_experts: Sequence[int] = DEFAULT_EXPERTS,
    tokens: int = 256,
    seconds: float = 20.0,
    max_rounds: int = 25,
    seed: int = 0,
    on_model_built: Callable[[str], None] | None = None,
) -> list[MoteBenchRow]:
    """The dense row, then one MoTE row per number of stored experts."""
    if tokens < 1 or any(count < 1 for count in num_experts):
        raise ValueError(f"tokens and every number of experts must be positive, got {tokens} and {list(num_experts)}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, base["vocab_size"], (1, tokens), generator=generator)
    models = {}
    torch.manual_seed(seed)
    models["dense"] = LlamaForCausalLM(LlamaConfig(**base)).eval()
    for count in num_experts:
        models[count] = LlamaMoteForCausalLM(mote_config(base, count)).eval()
        if on_model_built:
            on_model_built(f"{count} experts")
    inputs = {
        name: {"input_ids": input_ids} | ({} if name == "dense" else {"task_ids": torch.tensor([name - 1])})
        for name in models
    }
    with torch.no_grad():
        flops = {name: count_flops(model, inputs[name]) for name, model in models.items()}  # also the warm-up
        seconds_per_call = time_round_robin(
            {name: partial(_forward, model, inputs[name]) for name, model in models.items()}, seconds, max_rounds
        )
    rows = []
    for name, model in models.items():
        counts = count_parameters(model)
        rows.append(
            MoteBenchRow(
                model="dense" if name == "dense" else "mote",
                experts=None if name == "dense" else name,
                tokens=tokens,
                total_parameters=counts.total,
                active_parameters=counts.active,
                gflops=flops[name] / 1e9,
                ms=seconds_per_call[name] * 1e3,
                flops_vs_dense=flops[name] / flops["dense"],
                latency_vs_dense=seconds_per_call[name] / seconds_per_call["dense"],
            )
        )
    return rows


def print_mote_table(rows: Sequence[MoteBenchRow], title: str) -> None:
    print_table(
        title,
        ["model", "stored experts", "total params (M)", "active params (M)", "GFLOPs / sample", "ms / sample",
         "FLOPs × dense", "latency × dense"],
        [
            [row.model, row.experts, row.total_parameters / 1e6, row.active_parameters / 1e6, row.gflops, row.ms,
             row.flops_vs_dense, row.latency_vs_dense]
            for row in rows
        ],
    )
    console.print(
        "Each MoTE sample runs the shared expert and one routed expert per layer: the active parameters and FLOPs stay "
        "flat as experts are stored, one FFN per layer above the dense model; the stored parameters grow by one FFN "
        "per expert. × dense: over the dense model, measured in the same run."
    )


def add_bench_arguments(parser) -> None:
    parser.add_argument(
        "--size", choices=list(SIZES), default=DEFAULT_SIZE,
        help="cpu (width 256, 4 layers: Llama-3.2-1B's proportions), llama-3.2-1b (the paper's decoder: 3.2 GB of "
             "fp32 weights per stored expert) or tiny (for tests)",
    )  # fmt: skip
    parser.add_argument("--experts", type=int, nargs="+", default=list(DEFAULT_EXPERTS),
                        help="numbers of stored experts to measure")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--seconds", type=float, default=20.0, help="time budget for the timing rounds")
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_bench(args) -> int:
    apply_threads(args)
    base = SIZES[args.size]
    with progress_bar(transient=True) as progress:
        task = progress.add_task("building models", total=len(args.experts))
        rows = run_mote_bench(base, args.experts, tokens=args.tokens, seconds=args.seconds,
                              on_model_built=lambda done: progress.update(task, advance=1, description=done))
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    print_mote_table(
        rows,
        f"MoTE decoders ({args.size}): width {base['hidden_size']}, {base['num_hidden_layers']} layers, FFN "
        f"{base['intermediate_size']}; one sample of {args.tokens} tokens; fp32, threads: {torch.get_num_threads()}",
    )
    return 0
