"""`moezoo bench moe-layer`: every experts implementation on identical weights, timed in one run.

Implementations are timed round-robin (one call of each per round, in a shuffled order, median over rounds) so that
the drift of a shared, noisy machine hits all of them alike. In a model, a layer's expert weights (100 MB on the
default shape) come from memory, since all the layers' weights do not fit in the caches, while buffers reused from
layer to layer stay in them: so every call takes the next of several identical copies of the layer, as many as
exceed the last-level cache together, and finds its weights where a model's layer would, whichever implementation ran
before it. Measured in the same run: a dense matmul peak, against which each row's throughput is expressed, and the
time to read the weights of the experts a case hits once, which no implementation can beat when each expert sees
only a few tokens. Accuracy is measured against `eager`, and against `eager` in float64 (the exact result up to
float64 rounding) so that each implementation's error stands beside `eager`'s own. On the cases goals are set for
(`ALL_TARGETS`: moezoo's CPU implementation, and its Triton kernels on a GPU), `check_targets` gives each its verdict.

With `device="cuda"` the same cases run on a GPU (its L2 cache in place of the CPU's last-level cache), where moezoo's
Triton kernels (`moezoo_triton`) take the place of its CPU implementation.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from transformers import PreTrainedConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from ..kernels.native import native_library
from ..kernels.sorted_experts import NATIVE_MAX_PAIRS_PER_EXPERT
from ..modeling.moe import SORTED_EXPERTS_IMPLEMENTATION, TRITON_EXPERTS_IMPLEMENTATION, MoeLayerSpec, SwiGLUExperts
from ..terminal import console, print_table
from .timing import DEVICES, last_level_cache_bytes, time_round_robin


TRANSFORMERS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
DEFAULT_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", SORTED_EXPERTS_IMPLEMENTATION)
GPU_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", TRITON_EXPERTS_IMPLEMENTATION)
MODES = ("fwd", "fwd_bwd")
# batched_mm materialises one weight matrix per (token, slot) pair; rows that would need more are skipped.
BATCHED_MM_MEMORY_LIMIT_BYTES = 3 * 2**30
# Slow cases (eager's backward takes seconds) get this many rounds whatever the time budget: a median of three let one
# disturbed moment on a shared machine move a whole row (one 8192-token forward + backward read 1.45x instead of ~2.3x).
MIN_ROUNDS = 5
# The most copies of the layer the timed calls cycle through (small layers fit in the caches however many there are).
MAX_LAYER_COPIES = 16


@dataclass
class BenchRow:
    impl: str
    tokens: int
    mode: str
    ms: float | None
    gflops: float | None
    pct_of_matmul_peak: float | None
    max_abs_diff_vs_eager: float | None
    # max over the compared tensors of max|Δ| / max(1, max|eager|): relative where a tensor is larger than 1, as the
    # gradients are (~10-40: routing weights, expert weights summed over many tokens), which any change of summation
    # order moves by ~1e-5 in absolute terms; absolute below, where a relative error would magnify noise.
    max_rel_diff_vs_eager: float | None = None
    # max|Δ| against eager run in float64 on the same weights and inputs: eager's own row is its rounding error.
    max_abs_err_vs_fp64: float | None = None
    speedup_vs_best_transformers: float | None = None
    # time to read the weights of the experts this case hits once from memory (a streaming read), in ms
    weights_read_ms: float | None = None
    note: str = ""


# The goals of moezoo's experts implementations, each set for one case of this benchmark (its shape, dtype and device:
# `check_targets` checks nothing elsewhere). For each (tokens, mode) with a goal: the speed-up over a baseline, the
# time over the read floor measured in the same run (`weights_read_ms`), and the accuracy `max_rel_diff_vs_eager`.
BEST_TRANSFORMERS = "best transformers"  # the baseline that is transformers' fastest implementation of each case


@dataclass(frozen=True)
class ImplementationTargets:
    impl: str
    # run_moe_layer_bench's shape, dtype and device keyword arguments
    case: dict
    # BEST_TRANSFORMERS, or the one implementation whose time the speed-ups are over
    baseline: str
    # (tokens, mode) -> the least speed-up over the baseline
    min_speedups: dict[tuple[int, str], float]
    # (tokens, mode) -> the most time over the time of reading the weights of the experts hit once
    max_read_floor_ratios: dict[tuple[int, str], float] = field(default_factory=dict)
    # the most max_rel_diff_vs_eager of every (tokens, mode) with another goal; None: no accuracy goal
    max_rel_diff: float | None = None

    def cases(self) -> set[tuple[int, str]]:
        return set(self.min_speedups) | set(self.max_read_floor_ratios)


# `moezoo` on the CPU: the default shape in fp32.
CPU_TARGETS = ImplementationTargets(
    impl=SORTED_EXPERTS_IMPLEMENTATION,
    case={"num_experts": 64, "top_k": 8, "hidden": 512, "expert_width": 256, "dtype": torch.float32, "device": "cpu"},
    baseline=BEST_TRANSFORMERS,
    min_speedups={
        (64, "fwd"): 1.5, (2048, "fwd"): 1.2, (8192, "fwd"): 1.2,
        (64, "fwd_bwd"): 3.0, (2048, "fwd_bwd"): 1.5, (8192, "fwd_bwd"): 1.5,
    },
    max_read_floor_ratios={(64, "fwd"): 1.5},
    max_rel_diff=1e-5,
)
# `moezoo_triton` on a GPU: the same shape in bf16, against transformers' grouped_mm. "Within 10% of grouped_mm's
# time or better" at 8192 tokens is a speed-up of at least 1 / 1.1.
GPU_TARGETS = ImplementationTargets(
    impl=TRITON_EXPERTS_IMPLEMENTATION,
    case={**CPU_TARGETS.case, "dtype": torch.bfloat16, "device": "cuda"},
    baseline="grouped_mm",
    min_speedups={(64, "fwd"): 1.3, (8192, "fwd"): 1 / 1.1, (2048, "fwd_bwd"): 1.2},
)
ALL_TARGETS = (CPU_TARGETS, GPU_TARGETS)
TARGET_CASE = CPU_TARGETS.case


@dataclass
class TargetCheck:
    """One (tokens, mode) case of an implementation against its targets, beside the floors measured in the same run:
    no implementation is faster than reading the weights of the experts the case hits once, nor than doing its
    arithmetic at the dense matmul peak. A target left at None is not set for this case; its value is shown anyway."""

    impl: str
    tokens: int
    mode: str
    baseline: str
    ms: float
    read_floor_ms: float
    compute_floor_ms: float
    speedup: float  # the baseline's time / ms
    min_speedup: float | None
    read_floor_ratio: float  # ms / read_floor_ms
    max_read_floor_ratio: float | None
    rel_diff: float  # max_rel_diff_vs_eager
    max_rel_diff: float | None

    def verdicts(self) -> dict[str, bool]:
        """Whether each target this case has is met, by the name of the value it bounds."""
        verdicts = {}
        if self.min_speedup is not None:
            verdicts["speedup"] = self.speedup >= self.min_speedup
        if self.max_read_floor_ratio is not None:
            verdicts["read_floor_ratio"] = self.read_floor_ratio <= self.max_read_floor_ratio
        if self.max_rel_diff is not None:
            verdicts["rel_diff"] = self.rel_diff <= self.max_rel_diff
        return verdicts

    @property
    def met(self) -> bool:
        return all(self.verdicts().values())

    def as_dict(self) -> dict:
        return {**asdict(self), "verdicts": self.verdicts(), "met": self.met}


def check_implementations(implementations: Sequence[str]) -> None:
    """Raise a `ValueError` naming the registered experts implementations if one of `implementations` is not."""
    known = ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]
    for impl in implementations:
        if impl not in known:
            raise ValueError(f"unknown experts implementation {impl!r}; registered: {', '.join(known)}")


def default_implementations(device: str) -> tuple[str, ...]:
    return GPU_IMPLEMENTATIONS if device == "cuda" else DEFAULT_IMPLEMENTATIONS


def split_runnable(
    implementations: Sequence[str], pairs: int, hidden: int, expert_width: int, element_size: int, passes: int = 1,
    device: str = "cpu",
) -> tuple[list[str], dict[str, str]]:
    """The implementations to run on `pairs` (token, slot) pairs of SwiGLU experts, and the skipped ones with why:
    batched_mm copies the gate/up and down weights of one expert per pair (a backward pass copies them again);
    moezoo's Triton kernels run on GPUs only."""
    weight_copies = passes * pairs * 3 * hidden * expert_width * element_size
    runnable, skipped = [], {}
    for impl in implementations:
        if impl == "batched_mm" and weight_copies > BATCHED_MM_MEMORY_LIMIT_BYTES:
            skipped[impl] = f"skipped: would copy {weight_copies / 2**30:.1f} GiB of expert weights"
        elif impl == TRITON_EXPERTS_IMPLEMENTATION and device != "cuda":
            skipped[impl] = "skipped: Triton kernels, GPUs only (--device cuda)"
        else:
            runnable.append(impl)
    return runnable, skipped


def synchronize(device: str) -> None:
    """Wait for the work queued on `device` (GPU kernels run asynchronously; a CPU call has finished on return)."""
    if device == "cuda":
        torch.cuda.synchronize()


def check_device(device: str) -> None:
    """Raise a `ValueError` unless `device` is one the benchmarks run on, and present."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU here")


# The side of the square matmuls the peak is measured on: a GPU needs larger ones to reach its peak (an H200 does a
# 2048-sized one in ~25 µs, about what launching and timing it take).
MATMUL_PEAK_SIZES = {"cpu": 2048, "cuda": 8192}


def measure_matmul_peak(dtype: torch.dtype = torch.float32, repeats: int = 5, device: str = "cpu") -> float:
    """Best GFLOP/s of a dense (size x size) @ (size x size) matmul in `dtype` on `device`, now."""
    size = MATMUL_PEAK_SIZES[device]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _cache_bytes(device: str) -> int:
    """The cache a layer's weights would have to exceed: the CPU's last level, or the GPU's L2."""
    return torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else last_level_cache_bytes()


def _make_layers(num_experts, top_k, hidden, expert_width, dtype, seed, device="cpu"):
    """The config all implementations are selected on, identical copies of the experts (enough of them to exceed the
    last-level cache together, at most `MAX_LAYER_COPIES`), and a float64 copy (same config, same weights)."""
    torch.manual_seed(seed)
    config = PreTrainedConfig()
    spec = MoeLayerSpec(
        hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k, expert_intermediate_size=expert_width
    )
    experts = SwiGLUExperts(config, spec).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=hidden**-0.5)
        experts.down_proj.normal_(std=expert_width**-0.5)
    weight_bytes = sum(parameter.nbytes for parameter in experts.parameters())
    count = max(2, min(MAX_LAYER_COPIES, math.ceil(1.5 * _cache_bytes(device) / weight_bytes) + 1))
    layers = [experts.to(device)] + [_copy(config, spec, experts, dtype).to(device) for _ in range(count - 1)]
    return config, layers, _copy(config, spec, experts, torch.float64).to(device)


def _copy(config, spec, experts, dtype):
    copy = SwiGLUExperts(config, spec).to(dtype)
    copy.load_state_dict(experts.state_dict())
    return copy


def measure_weights_read_ms(layers: Sequence[torch.nn.Module], repeats: int = 5) -> float:
    """Median ms to read one layer's weights once from memory, cycling through the layers so that no read finds them
    in the caches: with moezoo's native streaming read, else (no C compiler, a GPU) with `torch.sum`."""
    library = native_library()
    total = torch.zeros(1)
    device = next(layers[0].parameters()).device.type

    def read(weight: torch.Tensor) -> None:
        if library is None or weight.dtype != torch.float32 or device != "cpu":
            weight.sum()
        else:
            library.moezoo_read_floats(weight.data_ptr(), weight.numel(), total.data_ptr(), torch.get_num_threads())

    weights = itertools.cycle([[p.detach().contiguous() for p in layer.parameters()] for layer in layers])
    times = []
    for _ in range(len(layers) + max(repeats, len(layers))):
        layer_weights = next(weights)
        synchronize(device)
        start = time.perf_counter()
        for weight in layer_weights:
            read(weight)
        synchronize(device)
        times.append(time.perf_counter() - start)
    times = times[len(layers):]  # the first pass over the layers may find some of them in the caches
    return sorted(times)[len(times) // 2] * 1e3


def _make_routing(tokens, num_experts, top_k, hidden, dtype, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed + tokens)
    hidden_states = torch.randn(tokens, hidden, generator=generator, dtype=torch.float32).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=generator)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    # A fixed, non-uniform upstream gradient (a stride-0 one from .sum() is not what models produce), computed in
    # float64 and rounded once, so that the float64 reference gets exactly the same one.
    upstream = torch.cos(torch.arange(tokens * hidden, dtype=torch.float64)).view(tokens, hidden).to(dtype)
    return tuple(tensor.to(device) for tensor in (hidden_states, index, weights, upstream))


def _run(config, experts, impl, mode, hidden_states, index, weights, upstream):
    """One call; returns the tensors to compare (output, then gradients of `upstream` for fwd_bwd)."""
    config._experts_implementation = impl
    if mode == "fwd":
        with torch.no_grad():
            return (experts(hidden_states, index, weights),)
    x = hidden_states.detach().requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    output = experts(x, index, w)
    output.backward(upstream)
    results = output.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad
    # Like optimizer.zero_grad() in a training step; the caller drops `results` inside the timed call, so each
    # implementation pays for freeing its own gradients, not the previous contender's.
    experts.zero_grad(set_to_none=True)
    return results


def _run_next(config, next_layer, device, impl, mode, *inputs):
    """`_run` on the next copy of the layer, finished on return (the timed call)."""
    results = _run(config, next_layer(), impl, mode, *inputs)
    synchronize(device)
    return results


def _max_diffs(results, reference, exact) -> tuple[float, float, float]:
    """max|Δ| against the eager results, the same over max(1, max|eager|) (`BenchRow.max_rel_diff_vs_eager`), and
    max|Δ| against float64; each the largest over the compared tensors."""
    absolute = [float((a.double() - b.double()).abs().max()) for a, b in zip(results, reference)]
    relative = [diff / max(float(b.double().abs().max()), 1.0) for diff, b in zip(absolute, reference)]
    error = [float((a.double() - b).abs().max()) for a, b in zip(results, exact)]
    return max(absolute), max(relative), max(error)


def run_moe_layer_bench(
    tokens: Sequence[int] = (64, 2048, 8192),
    num_experts: int = 64,
    top_k: int = 8,
    hidden: int = 512,
    expert_width: int = 256,
    dtype: torch.dtype = torch.float32,
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    modes: Sequence[str] = MODES,
    seconds_per_case: float = 6.0,
    max_rounds: int = 25,
    seed: int = 0,
    on_case_done: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> tuple[list[BenchRow], float]:
    """Time every implementation on every (tokens, mode) case; returns the rows and the matmul peak (GFLOP/s)."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if min(tokens) < 1:
        raise ValueError(f"token counts must be positive, got {min(tokens)}")
    check_device(device)
    check_implementations(implementations)
    config, layers, exact = _make_layers(num_experts, top_k, hidden, expert_width, dtype, seed, device)
    experts, next_layer = layers[0], itertools.cycle(layers).__next__
    # Measured before and after the cases, the best of both: a shared machine busy at one of them reads low.
    peak = measure_matmul_peak(dtype, device=device)
    layer_read_ms = measure_weights_read_ms(layers)
    element_size = torch.empty((), dtype=dtype).element_size()
    rows: list[BenchRow] = []
    experts_hit: dict[int, int] = {}
    for num_tokens in tokens:
        inputs = _make_routing(num_tokens, num_experts, top_k, hidden, dtype, seed, device)
        hidden_states, index, weights, upstream = inputs  # upstream: the gradient fwd_bwd calls propagate back
        pairs = num_tokens * top_k
        experts_hit[num_tokens] = index.unique().numel()
        forward_flops = 6 * pairs * hidden * expert_width
        for mode in modes:
            runnable, skipped = split_runnable(
                implementations, pairs, hidden, expert_width, element_size, passes=2 if mode == "fwd_bwd" else 1,
                device=device,
            )
            reference = _run(config, experts, "eager", mode, *inputs)
            exact_inputs = (hidden_states.double(), index, weights.double(), upstream.double())
            exact_results = _run(config, exact, "eager", mode, *exact_inputs)
            diffs = {
                impl: _max_diffs(_run(config, experts, impl, mode, *inputs), reference, exact_results)
                for impl in runnable
            }
            del reference, exact_results
            timings = time_round_robin(
                {impl: partial(_run_next, config, next_layer, device, impl, mode, *inputs) for impl in runnable},
                seconds_per_case,
                max_rounds,
                min_rounds=MIN_ROUNDS,
            )
            flops = forward_flops * (3 if mode == "fwd_bwd" else 1)
            case_rows = []
            for impl in implementations:
                if impl in skipped:
                    case_rows.append(BenchRow(impl, num_tokens, mode, None, None, None, None, note=skipped[impl]))
                    continue
                seconds = timings[impl]
                max_diff, max_rel_diff, max_error = diffs[impl]
                case_rows.append(
                    BenchRow(impl, num_tokens, mode, seconds * 1e3, flops / seconds / 1e9, None, max_diff,
                             max_rel_diff, max_error)
                )
            best = best_transformers_ms(case_rows)
            for row in case_rows:
                if best is not None and row.ms is not None:
                    row.speedup_vs_best_transformers = best / row.ms
            rows.extend(case_rows)
            if on_case_done:
                on_case_done(f"{num_tokens} tokens, {mode}")
    config._experts_implementation = None
    peak = max(peak, measure_matmul_peak(dtype, device=device))
    layer_read_ms = min(layer_read_ms, measure_weights_read_ms(layers))
    for row in rows:
        row.weights_read_ms = layer_read_ms * experts_hit[row.tokens] / num_experts
        if row.gflops is not None:
            row.pct_of_matmul_peak = 100 * row.gflops / peak
    return rows, peak


def best_transformers_ms(case_rows: Sequence[BenchRow]) -> float | None:
    """The time of transformers' fastest implementation among the rows of one (tokens, mode) case."""
    return min(
        (row.ms for row in case_rows if row.impl in TRANSFORMERS_IMPLEMENTATIONS and row.ms is not None), default=None
    )


def check_targets(rows: Sequence[BenchRow], **case) -> list[TargetCheck]:
    """The rows that have targets (`ALL_TARGETS`) checked against them; none unless `case` (the shape, `dtype` and
    `device` keyword arguments the rows were measured with) is one the targets are set for."""
    targets = next((targets for targets in ALL_TARGETS if targets.case == case), None)
    if targets is None:
        return []
    rows_by_case: dict[tuple[int, str], dict[str, BenchRow]] = {}
    for row in rows:
        rows_by_case.setdefault((row.tokens, row.mode), {})[row.impl] = row
    checks = []
    for (tokens, mode), case_rows in rows_by_case.items():
        row = case_rows.get(targets.impl)
        if (tokens, mode) not in targets.cases() or row is None or row.ms is None:
            continue
        if targets.baseline == BEST_TRANSFORMERS:
            baseline_ms = best_transformers_ms(list(case_rows.values()))
        else:
            baseline_ms = getattr(case_rows.get(targets.baseline), "ms", None)
        if baseline_ms is None:
            continue
        checks.append(TargetCheck(
            impl=targets.impl, tokens=tokens, mode=mode, baseline=targets.baseline, ms=row.ms,
            read_floor_ms=row.weights_read_ms, compute_floor_ms=row.ms * row.pct_of_matmul_peak / 100,
            speedup=baseline_ms / row.ms, min_speedup=targets.min_speedups.get((tokens, mode)),
            read_floor_ratio=row.ms / row.weights_read_ms,
            max_read_floor_ratio=targets.max_read_floor_ratios.get((tokens, mode)),
            rel_diff=row.max_rel_diff_vs_eager, max_rel_diff=targets.max_rel_diff,
        ))  # fmt: skip
    return checks


def _verdict(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "MISSED"


def _bound(bound: float | None, at_least: bool) -> str | None:
    return None if bound is None else f"{'>=' if at_least else '<='} {bound:.3g}"


def target_check_table(checks: Sequence[TargetCheck]) -> tuple[list[str], list[list[object]]]:
    """The columns and rows of the targets table (the terminal's, and `moezoo bench gpu-check`'s Markdown)."""
    columns = ["tokens", "mode", "ms", "read floor ms", "compute floor ms", f"× {checks[0].baseline}", "target",
               "verdict", "× read floor", "target", "verdict", "rel |Δ| vs eager", "target", "verdict"]  # fmt: skip
    rows = []
    for c in checks:
        verdicts = c.verdicts()
        rows.append([
            c.tokens, c.mode, c.ms, c.read_floor_ms, c.compute_floor_ms,
            c.speedup, _bound(c.min_speedup, True), _verdict(verdicts.get("speedup")),
            c.read_floor_ratio, _bound(c.max_read_floor_ratio, False), _verdict(verdicts.get("read_floor_ratio")),
            c.rel_diff, _bound(c.max_rel_diff, False), _verdict(verdicts.get("rel_diff")),
        ])  # fmt: skip
    return columns, rows


TARGETS_NOTE = (
    "read floor: the time to read the weights of the experts hit once; compute floor: the arithmetic at the dense "
    "matmul peak; both measured in the same run, and no implementation is faster than either. × read floor: ms / read "
    "floor. rel |Δ|: max|Δ| / max(1, max|eager|) over the output and every gradient."
)


def print_target_checks(checks: Sequence[TargetCheck]) -> None:
    if not checks:
        return
    print_table(f"{checks[0].impl} against its targets", *target_check_table(checks))
    console.print(
        f"{TARGETS_NOTE} A single run on a shared machine varies by about ±15%: a ratio within that of its target is "
        "not a verdict on its own."
    )


def rows_as_dicts(rows: Sequence[BenchRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def print_moe_layer_table(rows: Sequence[BenchRow], peak: float, title: str, device: str = "cpu") -> None:
    print_table(
        f"{title}; dense matmul peak {peak:.0f} GFLOP/s",
        ["impl", "tokens", "mode", "ms", "GFLOP/s", "% of peak", "max |Δ| vs eager", "rel |Δ|", "max |Δ| vs fp64",
         "× best transformers"],
        [
            [r.impl, r.tokens, r.mode, r.ms, r.gflops, r.pct_of_matmul_peak, r.max_abs_diff_vs_eager,
             r.max_rel_diff_vs_eager, r.max_abs_err_vs_fp64, r.note or r.speedup_vs_best_transformers]
            for r in rows
        ],
    )
    read_floors = {r.tokens: r.weights_read_ms for r in rows}
    console.print(
        "× best transformers: time of the fastest of eager / grouped_mm / batched_mm for that row, divided by the "
        "row's time. rel |Δ|: max|Δ| / max(1, max|eager|) over the output and, for fwd_bwd, every gradient. vs fp64: "
        "against eager in float64 on the same weights (eager's row is its own rounding error). Each call takes the next of "
        "identical copies of the layer that together exceed the last-level cache, as a model's layers do. Reading "
        "the weights of the experts hit once takes "
        + ", ".join(f"{ms:.2f} ms at {tokens} tokens" for tokens, ms in read_floors.items())
        + " (one streaming read, this run): no implementation's forward pass can be faster."
    )
    if device == "cuda":
        console.print(
            f"{TRITON_EXPERTS_IMPLEMENTATION}: moezoo's Triton kernels (gather + gate/up GEMM + activation, then down "
            "GEMM x routing weight); the other rows are transformers' implementations on this GPU. % of peak: of the "
            "dense matmul peak in this dtype, measured in this run."
        )
        return
    native = "built for this CPU" if native_library() is not None else "unavailable (no C compiler), PyTorch path"
    console.print(
        f"moezoo: native C kernels {native} for fp32 SwiGLU calls with at most {NATIVE_MAX_PAIRS_PER_EXPERT} "
        "(token, slot) pairs per expert; above that, BLAS GEMMs per expert with native SwiGLU passes between them."
    )
