"""`moezoo bench moe-vie`: images per second of the MoE-ViE vision tower, with every experts implementation, against
a dense tower of the same active parameters and transformers' SigLIP2 tower of the same width and depth.

All towers are randomly initialised (fixed seed, fp32 unless asked otherwise, eval mode, no autograd) and see the
same NaFlex batch: random pre-patchified pixels, a full square patch grid per image. They are timed round-robin in one
run (one forward of each per round, median over rounds), so every ratio compares measurements taken under the same
machine load. With `device="cuda"` they run on a GPU, where moezoo's Triton kernels (`moezoo_triton`) take the place
of its CPU implementation: the paper's Tab. 7 protocol (MoE-ViE-H/14 with its "vanilla" expert loop, i.e. `eager`,
against the kernels, beside dense towers) is `--size h14 --device cuda --dtype bfloat16 --batch-size 16 32 64 128`.

- The dense tower is the MoE-ViE configuration without MoE layers whose MLPs are as wide as the active experts of a
  token, `(n_shared_experts + num_experts_per_tok) * moe_intermediate_size`: the same per-token compute and, up to
  the router and the MLP biases, the same active parameters as the MoE tower. That holds for block 0 too (dense in
  both towers) when its width `intermediate_size` is that active width, as in B/16, L/16 and the smaller sizes here;
  in H/14 (1 + 7 experts of width 854 against 3413) the dense tower's block 0 is twice as wide.
- The SigLIP2 tower (`transformers.models.siglip2.Siglip2VisionModel`) has the width, depth, heads, patch size and
  tokens of the MoE tower and a GELU MLP of its dense width `intermediate_size` (two matrices, where a SwiGLU of
  that width has three).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers.models.siglip2 import Siglip2VisionConfig, Siglip2VisionModel

from ..configuration.moe_vie import OFFICIAL_MOE_VIE_CONFIGS, TINY_MOE_VIE, MoeVieVisionConfig
from ..modeling.moe import ParameterCounts, count_parameters
from ..modeling.moe_vie import MoeVieVisionModel
from ..terminal import console, print_table
from .moe_layer import (
    DEFAULT_IMPLEMENTATIONS,
    TRANSFORMERS_IMPLEMENTATIONS,
    check_device,
    check_implementations,
    split_runnable,
    synchronize,
)
from .timing import time_round_robin


# Vision configurations by name. "cpu" keeps the B/16 proportions (32 experts of width I/4, 1 shared + top-3 routed,
# MoE in every block but the first, 16 px patches at 224 px = 196 tokens) at half the width and depth.
SIZES = {
    "cpu": dict(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536, moe_intermediate_size=384,
        pooling_intermediate_size=1536,
    ),
    "tiny": TINY_MOE_VIE["vision_config"],
    "b16": OFFICIAL_MOE_VIE_CONFIGS["MoEViE-B16-224"]["vision_config"],
    "l16": OFFICIAL_MOE_VIE_CONFIGS["MoEViE-L16-384"]["vision_config"],
    "h14": OFFICIAL_MOE_VIE_CONFIGS["MoEViE-H14-448"]["vision_config"],
}
DEFAULT_SIZE = "cpu"


@dataclass
class VieBenchRow:
    model: str  # "moe_vie", "dense" (same active parameters) or "siglip2"
    impl: str | None  # the experts implementation of the moe_vie rows
    batch_size: int
    tokens: int  # per image
    ms: float | None  # per batch
    images_per_second: float | None
    total_parameters: int
    active_parameters: int
    # Images per second over those of the dense / SigLIP2 tower, and for the moe_vie rows over the fastest of
    # transformers' experts implementations.
    speedup_vs_dense: float | None = None
    speedup_vs_siglip2: float | None = None
    speedup_vs_best_transformers: float | None = None
    max_abs_diff_vs_eager: float | None = None  # of the pooled output, moe_vie rows only
    note: str = ""


def moe_vie_bench_config(
    size: str = DEFAULT_SIZE, image_size: int | None = None, num_layers: int | None = None
) -> MoeVieVisionConfig:
    """The MoE tower to benchmark: a named size, optionally at another resolution or depth (MoE layers stay every
    block but the first)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    fields = dict(SIZES[size], moe_layers=None)
    if image_size is not None:
        fields["image_size"] = image_size
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config = MoeVieVisionConfig(**fields)
    if config.image_size % config.patch_size:
        raise ValueError(f"image size {config.image_size} is not a multiple of the patch size {config.patch_size}")
    return config


def dense_equivalent_config(config: MoeVieVisionConfig) -> MoeVieVisionConfig:
    """No MoE layers; every MLP as wide as the experts one token activates (shared + routed top-k)."""
    active_width = (config.n_shared_experts + config.num_experts_per_tok) * config.moe_intermediate_size
    return dataclasses.replace(config, moe_layers=[], intermediate_size=active_width)


def siglip2_config(config: MoeVieVisionConfig) -> Siglip2VisionConfig:
    """transformers' SigLIP2 tower of the same width, depth, heads, patches and dense MLP width; its learned position
    grid has exactly the benchmark's tokens, so it is resized to itself."""
    return Siglip2VisionConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_channels=config.num_channels,
        patch_size=config.patch_size,
        num_patches=(config.image_size // config.patch_size) ** 2,
    )


def _naflex_batch(
    config: MoeVieVisionConfig, batch_size: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random normalised pixels (mean = std = 0.5 puts them in [-1, 1]) on a full square patch grid per image."""
    grid = config.image_size // config.patch_size
    patch_dim = config.num_channels * config.patch_size**2
    generator = torch.Generator().manual_seed(seed + batch_size)
    return dict(
        pixel_values=(torch.rand(batch_size, grid * grid, patch_dim, generator=generator) * 2 - 1).to(device, dtype),
        pixel_attention_mask=torch.ones(batch_size, grid * grid, dtype=torch.int32, device=device),
        spatial_shapes=torch.tensor([[grid, grid]] * batch_size, device=device),
    )


def _pooled(model, inputs: dict[str, torch.Tensor], impl: str | None = None, device: str = "cpu") -> torch.Tensor:
    """One forward, finished on return; `impl` switches the experts implementation first (a walk over the modules,
    ~0.2 ms)."""
    if impl is not None:
        model.set_experts_implementation(impl)
    pooled = model(**inputs).pooler_output
    synchronize(device)
    return pooled


def _row(
    model: str, impl: str | None, batch_size: int, tokens: int, ms: float | None, counts: ParameterCounts, **fields
) -> VieBenchRow:
    """A row with its time (None when skipped) and parameter counts; the ratios are filled in afterwards."""
    images_per_second = None if ms is None else batch_size * 1e3 / ms
    return VieBenchRow(model, impl, batch_size, tokens, ms, images_per_second, counts.total, counts.active, **fields)


def run_moe_vie_bench(
    config: MoeVieVisionConfig,
    batch_sizes: Sequence[int] = (1, 8),
    implementations: Sequence[str] = DEFAULT_IMPLEMENTATIONS,
    seconds_per_case: float = 20.0,
    max_rounds: int = 25,
    seed: int = 0,
    on_case_done: Callable[[str], None] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[VieBenchRow]:
    """Time the SigLIP2, dense and MoE towers (the latter with every implementation) at every batch size."""
    check_device(device)
    check_implementations(implementations)
    if not config.moe_layers:
        raise ValueError(f"the MoE tower has no MoE layer (num_hidden_layers={config.num_hidden_layers}); use >= 2")
    for batch_size in batch_sizes:
        if batch_size < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_size}")
    torch.manual_seed(seed)
    siglip2 = Siglip2VisionModel(siglip2_config(config)).to(device, dtype).eval()
    dense = MoeVieVisionModel(dense_equivalent_config(config)).to(device, dtype).eval()
    moe = MoeVieVisionModel(config).to(device, dtype).eval()
    counts = {"siglip2": count_parameters(siglip2), "dense": count_parameters(dense), "moe_vie": count_parameters(moe)}
    tokens = (config.image_size // config.patch_size) ** 2
    rows: list[VieBenchRow] = []
    with torch.no_grad():
        for batch_size in batch_sizes:
            inputs = _naflex_batch(config, batch_size, seed, device, dtype)
            pairs = batch_size * tokens * config.num_experts_per_tok
            runnable, skipped = split_runnable(
                implementations, pairs, config.hidden_size, config.moe_intermediate_size, moe.dtype.itemsize,
                device=device,
            )
            reference = _pooled(moe, inputs, "eager", device)
            diffs = {impl: float((_pooled(moe, inputs, impl, device) - reference).abs().max()) for impl in runnable}
            calls = {
                "siglip2": partial(_pooled, siglip2, inputs, device=device),
                "dense": partial(_pooled, dense, inputs, device=device),
            }
            for warm_up in calls.values():  # the MoE implementations have run for the accuracy check
                warm_up()
            calls |= {impl: partial(_pooled, moe, inputs, impl, device) for impl in runnable}
            timings = time_round_robin(calls, seconds_per_case, max_rounds)
            ms = {name: seconds * 1e3 for name, seconds in timings.items()}

            case_rows = [
                _row("siglip2", None, batch_size, tokens, ms["siglip2"], counts["siglip2"]),
                _row("dense", None, batch_size, tokens, ms["dense"], counts["dense"]),
            ]
            for impl in implementations:
                if impl in skipped:
                    case_rows.append(_row("moe_vie", impl, batch_size, tokens, None, counts["moe_vie"],
                                          note=skipped[impl]))
                else:
                    case_rows.append(_row("moe_vie", impl, batch_size, tokens, ms[impl], counts["moe_vie"],
                                          max_abs_diff_vs_eager=diffs[impl]))
            best_transformers = min(
                (ms[impl] for impl in runnable if impl in TRANSFORMERS_IMPLEMENTATIONS), default=None
            )
            for row in case_rows:
                if row.ms is None:
                    continue
                row.speedup_vs_dense = ms["dense"] / row.ms
                row.speedup_vs_siglip2 = ms["siglip2"] / row.ms
                if row.model == "moe_vie" and best_transformers is not None:
                    row.speedup_vs_best_transformers = best_transformers / row.ms
            rows.extend(case_rows)
            if on_case_done:
                on_case_done(f"batch {batch_size}")
    return rows


def print_moe_vie_table(rows: Sequence[VieBenchRow], title: str) -> None:
    print_table(
        title,
        ["model", "impl", "batch", "ms", "images/s", "total params (M)", "active params (M)", "× dense", "× SigLIP2",
         "× best transformers", "max |Δ| vs eager"],
        [
            [r.model, r.impl, r.batch_size, r.ms, r.images_per_second, r.total_parameters / 1e6,
             r.active_parameters / 1e6, r.speedup_vs_dense, r.speedup_vs_siglip2,
             r.note or r.speedup_vs_best_transformers, r.max_abs_diff_vs_eager]
            for r in rows
        ],
    )
    console.print(
        "× dense / × SigLIP2 / × best transformers: the row's images per second over those of the dense tower with "
        "the same active parameters, of transformers' SigLIP2 tower of the same width and depth, and of the fastest of "
        "eager / grouped_mm / batched_mm, in the same run. max |Δ| vs eager: of the pooled image features."
    )
