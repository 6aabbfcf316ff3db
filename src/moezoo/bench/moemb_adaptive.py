"""`moezoo bench moemb --adaptive`: what MoEMB's inference-time actions (spec moemb.md §3.3-3.9, §3.12) save in
wall-clock time with packed varlen execution (§3.14), against full compute on the same weights and inputs, in one run.

For every action and budget: embeddings per second, the logical FLOPs saving S (Eq. 6-7, vision tower included), the
ideal speedup 1 / (1 − S), the realised speedup over full compute and its share of the ideal. Full compute is the
faster of the padded forward and the packed one without an action (an action is never credited with what packing
alone saves). Targets (issue 20): every action realises at least 90% of its ideal speedup; MoDES + GDN-β at about
29% FLOPs saving runs at least 1.35× (the paper measures 1.44× on an H200).

Beside each row, the physical floor: the speedup the measured time shares allow (`time_model_speedup`): each part of
the full-compute forward (vision tower, each layer's token mixer, shared expert and router, routed experts) timed
on its own, and scaled by the work the action leaves it (tokens reaching the layer, routed slots executed). Where a
part costs a larger share of time than of FLOPs (the vision tower, the Gated DeltaNet recurrence on a CPU), the ideal
is out of reach however the experts are run; the rest between the model and the measure is the actions' own
overhead (scores, per-sample selection, compaction). The grouped-GEMM tile model of §3.14 is printed for the routed
experts' rows (`moezoo.modeling.moe.grouped_gemm_cost`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch

from ..configuration.moemb import MoEmbConfig
from ..modeling.moe.grouped_gemm_cost import GROUPED_GEMM_TILE_ROWS, expert_tile_speedup
from ..modeling.moemb import MoEmbForEmbedding
from ..modeling.moemb_adaptive import calibrate_modes
from ..modeling.moemb_adaptive.packed import PaddedBatch
from ..terminal import console, print_table
from .moe_layer import check_device, synchronize
from .moemb_inputs import MIXED_INPUTS, bench_inputs
from .timing import describe_device, time_round_robin


SHARE_OF_IDEAL_TARGET = 0.9
COMBINED_TARGET = (0.29, 1.35)  # MoDES + GDN-β: about this FLOPs saving, at least this speedup
COMBINED_ACTION = "modes+gdn-beta"
# name -> the fixed settings of an action; MoDES's come from a calibration on the benchmark's own inputs.
FIXED_ACTIONS = {
    "gdn-beta keep 0.5": dict(token_pruning="gdn_beta", keep_ratio=0.5),
    "gdn-beta keep 0.25": dict(token_pruning="gdn_beta", keep_ratio=0.25),
    "beta-rank skip 0.3": dict(expert_skip="beta_rank", skip_fraction=0.3),
    "beta-rank skip 0.5": dict(expert_skip="beta_rank", skip_fraction=0.5),
    "beta-threshold 0.5": dict(expert_skip="beta_threshold", beta_threshold=0.5),
    "otsu-beta": dict(expert_skip="otsu_beta"),
    "otsu-logit": dict(expert_skip="otsu_router_logit"),
    "threshold 0.1": dict(top_k="threshold", score_threshold=0.1),
}
MODES_TARGETS = (0.5, 0.75)  # shares of routed slots skipped (MoDES's own budget axis)
COMBINED_KEEP_RATIOS = (0.5, 0.25)
COMBINED_SKIP_TARGETS = MODES_TARGETS
MODES_GRID_POINTS = 16  # per threshold grid of MoDES's frontier search
PAPER_PRUNE_DEPTH = 4 / 40  # GDN-β decides after block 4 of the A3B's 40 (spec §3.3)


@dataclass
class AdaptiveBenchRow:
    action: str  # "full (padded)", "full (packed)", or an action and its budget
    settings: dict  # the `adaptive` settings (empty for full compute)
    ms: float  # per batch
    embeddings_per_second: float
    flops_saving: float  # S, logical (Eq. 6-7), vision tower included
    slot_skip_ratio: float  # routed slots not executed
    ideal_speedup: float  # 1 / (1 - S)
    realised_speedup: float  # full compute's time over this row's
    share_of_ideal: float  # realised / ideal
    time_model_speedup: float  # the physical floor: the time shares of full compute scaled by the work left
    share_of_time_model: float  # realised / time model
    max_abs_diff_vs_masked: float | None  # packed against the masked reference of the same action
    parts_ms: dict  # per batch, scaled to `ms`: vision tower, token mixers, MoE blocks, routed experts within them
    tokens: int  # real tokens of the batch
    flops_shares: dict  # of full compute's logical FLOPs: vision tower, token mixers, MoE blocks, routed experts
    target: str = ""
    met: bool | None = None


def packed_inputs(inputs: dict) -> dict:
    """The batch as one packed row with `cu_seqlens` (what the processor's padded batch holds, padding removed)."""
    padded = PaddedBatch.from_mask(inputs["attention_mask"], inputs["input_ids"].shape, inputs["input_ids"].device)
    packed = {key: value for key, value in inputs.items() if key != "attention_mask"}
    for key in ("input_ids", "mm_token_type_ids"):
        if key in packed:
            packed[key] = padded.pack(packed[key])
    if "pooled_index" in packed:
        packed["pooled_index"] = padded.packed_index(packed["pooled_index"])
    return packed | {"cu_seqlens": padded.cu_seqlens}


@contextmanager
def part_timer(model: MoEmbForEmbedding):
    """Seconds spent in each part of the forwards run inside: "vision", ("mixer", ℓ), ("moe", ℓ), ("routed", ℓ)."""
    seconds: dict = defaultdict(float)
    started: dict = {}

    def timed(module: torch.nn.Module, key) -> list:
        def start(*_):
            started[key] = time.perf_counter()

        def stop(*_):
            seconds[key] += time.perf_counter() - started.pop(key)

        return [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]

    handles = timed(model.model.visual, "vision")
    for layer in model.model.language_model.layers:
        mixer = layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn
        handles += timed(mixer, ("mixer", layer.layer_idx)) + timed(layer.mlp, ("moe", layer.layer_idx))
        handles += timed(layer.mlp.experts, ("routed", layer.layer_idx))
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()


def part_shares(parts: dict, scale: float) -> dict:
    """The times of `part_timer` summed by kind ("vision", "mixers", "moe", "routed"), times `scale`."""
    kinds = {"vision": "vision", "mixer": "mixers", "moe": "moe", "routed": "routed"}
    summed = dict.fromkeys(kinds.values(), 0.0)
    for key, seconds in parts.items():
        summed[kinds[key if isinstance(key, str) else key[0]]] += seconds * scale
    return summed


def time_model_speedup(parts: dict, total: float, report, top_k: int) -> float:
    """Full compute's time over the time its parts would take with the work `report` (an `AdaptiveReport`) leaves
    them: the vision tower in full, each layer's mixer, shared expert and router by the share of tokens reaching the
    layer, its routed experts by the share of routed slots executed there; the rest (embedding, norms) unchanged."""
    if report is None:
        return 1.0
    drop, skip, experts = report.decisions.drop, report.decisions.skip, report.decisions.experts_per_token
    reach = torch.cat([torch.ones_like(drop[:, :1]), torch.cumprod(1 - drop, dim=1)[:, :-1]], dim=1)
    alive = reach.mean(0)
    executed = (reach * (1 - skip - drop) * experts).mean(0) / top_k
    scaled = total
    for layer in range(drop.shape[1]):
        routed, moe, mixer = parts[("routed", layer)], parts[("moe", layer)], parts[("mixer", layer)]
        scaled -= (1 - alive[layer]) * (mixer + moe - routed) + (1 - executed[layer]) * routed
    return float(total / scaled)


def prune_after_layer(layer_types: list[str]) -> int:
    """The Gated DeltaNet block at the paper's relative depth of the GDN-β decision (block 4 of 40), or the first one
    after it: K = 4 of a 40-layer model would leave a shallow one no layer to save."""
    depth = round(PAPER_PRUNE_DEPTH * len(layer_types))
    return next(i for i, kind in enumerate(layer_types) if kind == "linear_attention" and i >= depth)


def action_settings(model: MoEmbForEmbedding, calibration: list[dict], on_step: Callable[[str], None]) -> dict:
    """Every benchmarked action's settings: the fixed ones (GDN-β deciding at the paper's relative depth), MoDES at
    each target skip, and MoDES + GDN-β with the target skip and keep ratio whose FLOPs saving is closest to the
    combined target's."""
    depth = {"prune_after_layer": prune_after_layer(model.config.text_config.layer_types)}
    actions = {name: settings | depth if "token_pruning" in settings else settings
               for name, settings in FIXED_ACTIONS.items()}  # fmt: skip
    top_k = model.config.text_config.num_experts_per_tok
    for kept in sorted({max(top_k // 2, 1), max(top_k // 4, 1)}, reverse=True):
        actions[f"top-k' {kept}"] = dict(top_k="uniform", experts_per_token=kept)
    modes = {}
    for target in sorted({*MODES_TARGETS, *COMBINED_SKIP_TARGETS}):
        on_step(f"MoDES calibration, skip {target}")
        modes[target] = calibrate_modes(model, calibration, target_skip=target, grid_points=MODES_GRID_POINTS)
    for target in MODES_TARGETS:
        actions[f"modes skip {target}"] = modes[target]
    saving_goal, _ = COMBINED_TARGET
    candidates = {}
    with torch.no_grad():
        for target in COMBINED_SKIP_TARGETS:
            for keep in COMBINED_KEEP_RATIOS:
                settings = dict(modes[target], token_pruning="gdn_beta", keep_ratio=keep, **depth)
                saving = np.mean([model(**batch, adaptive=settings).adaptive.flops_saving for batch in calibration])
                candidates[(target, keep)] = (abs(saving - saving_goal), settings)
    (target, keep), (_, settings) = min(candidates.items(), key=lambda entry: entry[1][0])
    actions[f"{COMBINED_ACTION} (skip {target}, keep {keep})"] = settings
    return actions


@torch.no_grad()
def run_adaptive_bench(
    config: MoEmbConfig,
    batch_size: int = 8,
    text_tokens: int = 64,
    image_size: int = 224,
    seconds: float = 60.0,
    max_rounds: int = 15,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    on_step: Callable[[str], None] = lambda step: None,
) -> list[AdaptiveBenchRow]:
    """Time full compute and every action (packed execution) round-robin on one batch of image + text and text
    inputs, with randomly initialised weights (routers drawn wider than the initialiser's, so that routing is decisive
    as a trained router's is)."""
    check_device(device)
    torch.manual_seed(seed)
    model = MoEmbForEmbedding(config).eval()
    for layer in model.model.language_model.layers:
        layer.mlp.gate.weight.normal_(0, 0.5)
    model.to(device, dtype)
    inputs = bench_inputs(config, MIXED_INPUTS, batch_size, text_tokens, image_size, seed).to(device=device, dtype=dtype)
    calibration = [bench_inputs(config, MIXED_INPUTS, 4, text_tokens, image_size, seed + 1).to(device=device,
                                                                                               dtype=dtype)]
    actions = action_settings(model, calibration, on_step)
    packed = packed_inputs(inputs)

    def forward(batch: dict, adaptive: dict):
        output = model(**batch, adaptive=adaptive)
        synchronize(device)
        return output

    calls = {"full (padded)": partial(forward, inputs, {}), "full (packed)": partial(forward, packed, {})}
    calls |= {name: partial(forward, inputs, settings) for name, settings in actions.items()}
    on_step("exactness and time shares")
    reports, diffs = {}, {}
    for name, settings in actions.items():
        output = calls[name]()
        reports[name] = output.adaptive
        masked = model(**inputs, adaptive=dict(settings, execution="masked")).embeddings
        diffs[name] = float((output.embeddings - masked).abs().max())
    parts, totals = {}, {}
    for name, call in calls.items():  # summed over two forwards: the time model reads full compute's shares
        with part_timer(model) as parts[name]:
            started = time.perf_counter()
            for _ in range(2):
                call()
            totals[name] = time.perf_counter() - started
    on_step("timing")
    ms = {name: value * 1e3 for name, value in time_round_robin(calls, seconds, max_rounds).items()}
    reference = min(ms["full (padded)"], ms["full (packed)"])
    full_flops = next(iter(reports.values())).full_flops
    flops_shares = {
        "vision": full_flops.vision, "mixers": full_flops.token_mixers + full_flops.attention_context,
        "moe": full_flops.shared_experts + full_flops.routed_experts + full_flops.routers,
        "routed": full_flops.routed_experts,
    }  # fmt: skip
    flops_shares = {part: value / full_flops.total for part, value in flops_shares.items()}
    top_k = config.text_config.num_experts_per_tok
    rows = []
    for name, time_ms in ms.items():
        report = reports.get(name)
        saving = 0.0 if report is None else report.flops_saving
        ideal, realised = 1 / (1 - saving), reference / time_ms
        row = AdaptiveBenchRow(
            action=name, settings=actions.get(name, {}), ms=time_ms, embeddings_per_second=batch_size * 1e3 / time_ms,
            flops_saving=saving, slot_skip_ratio=0.0 if report is None else report.slot_skip_ratio,
            ideal_speedup=ideal, realised_speedup=realised, share_of_ideal=realised / ideal,
            time_model_speedup=time_model_speedup(parts["full (packed)"], totals["full (packed)"], report, top_k),
            share_of_time_model=0.0, parts_ms=part_shares(parts[name], time_ms / totals[name]),
            max_abs_diff_vs_masked=diffs.get(name), flops_shares=flops_shares, tokens=int(inputs["attention_mask"].sum()),
        )  # fmt: skip
        row.share_of_time_model = realised / row.time_model_speedup
        if report is not None:
            row.target = f"≥ {SHARE_OF_IDEAL_TARGET:.0%} of ideal"
            row.met = row.share_of_ideal >= SHARE_OF_IDEAL_TARGET
            if name.startswith(COMBINED_ACTION):
                row.target += f"; ≥ {COMBINED_TARGET[1]}× at ~{COMBINED_TARGET[0]:.0%}"
                row.met = row.met and realised >= COMBINED_TARGET[1]
        rows.append(row)
    order = ["full (padded)", "full (packed)", *actions]
    return sorted(rows, key=lambda row: order.index(row.action))


def tile_model_line(config: MoEmbConfig, tokens: int, slot_skip: float) -> str:
    """The §3.14 grouped-GEMM tile model for `tokens` routed tokens at a given skip of routed slots."""
    text = config.text_config
    speedup = expert_tile_speedup(tokens, text.num_experts_per_tok, text.num_experts, slot_skip)
    return (
        f"grouped-GEMM tile model ({GROUPED_GEMM_TILE_ROWS}-row tiles, balanced routing, {tokens} tokens, "
        f"top-{text.num_experts_per_tok} of {text.num_experts}): a {slot_skip:.0%} slot skip runs {speedup:.2f}× "
        "fewer expert tiles (GPU kernels; CPU experts run row by row)"
    )


def print_adaptive_table(rows: list[AdaptiveBenchRow], title: str, config: MoEmbConfig) -> None:
    print_table(
        title,
        ["action", "ms", "routed experts ms", "emb/s", "FLOPs saving", "ideal ×", "realised ×", "of ideal",
         "time model ×", "of time model", "max |Δ| vs masked", "target", "verdict"],
        [
            [r.action, r.ms, r.parts_ms["routed"], r.embeddings_per_second, f"{r.flops_saving:.1%}",
             f"{r.ideal_speedup:.3f}",
             f"{r.realised_speedup:.3f}", f"{r.share_of_ideal:.0%}", f"{r.time_model_speedup:.3f}",
             f"{r.share_of_time_model:.0%}", r.max_abs_diff_vs_masked, r.target,
             "" if r.met is None else ("met" if r.met else "MISSED")]
            for r in rows
        ],
    )  # fmt: skip
    full = next(r for r in rows if r.action == "full (packed)")
    console.print(
        "full compute (packed), share of time / of logical FLOPs: "
        + ", ".join(f"{part} {full.parts_ms[part] / full.ms:.0%} / {full.flops_shares[part]:.0%}"
                    for part in ("vision", "mixers", "moe", "routed"))  # fmt: skip
        + " (routed experts are part of the MoE blocks)"
    )
    missed = [r for r in rows if r.met is False]
    console.print(
        f"{sum(r.met is True for r in rows)} of {sum(r.met is not None for r in rows)} targets met. Realised: full "
        "compute's time (the faster of padded and packed) over the action's, packed execution. Time model: the "
        "speedup the full-compute time shares of the vision tower, the mixers, the shared experts and routers and the "
        "routed experts allow, each scaled by the work the action leaves it (the physical floor; the rest is the "
        "actions' own overhead)."
    )
    if missed:
        worst = max(missed, key=lambda r: r.slot_skip_ratio)
        console.print(tile_model_line(config, worst.tokens, worst.slot_skip_ratio))


def run(args: argparse.Namespace, config: MoEmbConfig, image_size: int) -> int:
    """`moezoo bench moemb --adaptive` (the options of `moezoo.bench.moemb.add_bench_arguments`)."""
    rows = run_adaptive_bench(
        config, batch_size=args.batch_size, text_tokens=args.text_tokens, image_size=image_size,
        seconds=args.seconds_per_case, device=args.device, dtype=getattr(torch, args.dtype),
        on_step=lambda step: console.print(f"[dim]{step}[/dim]") if not args.json else None,
    )  # fmt: skip
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    text = config.text_config
    print_adaptive_table(
        rows,
        f"MoEMB adaptive computation ({args.size}): width {text.hidden_size}, {text.num_hidden_layers} layers "
        f"({text.layer_types.count('linear_attention')} Gated DeltaNet), top-{text.num_experts_per_tok} of "
        f"{text.num_experts} experts + shared; batch {args.batch_size}, {args.dtype}, " + describe_device(args.device),
        config,
    )
    return 0
