"""MoDES calibration for MoEMB (spec §3.8, adapted to embeddings: A-24): the layer scales s_ℓ^m from the embedding
distortion of disabling one layer's routed experts for one modality, and the dual thresholds (τ_text, τ_visual)
from MoDES's frontier search for a target share of routed slots skipped.

    D_ℓ^m = mean_x (1 − cos(e_skip(x), e_full(x)))      all routed experts of layer ℓ off for tokens of modality m
    s_ℓ^m = L · D_ℓ^m / Σ_ℓ' D_ℓ'^m                      mean 1 over the layers, so τ is on α's scale
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from ...configuration.moemb_adaptive import MODES_MODALITIES, AdaptiveSettings
from .routing import edited_routing


def frontier_search(
    text_grid: Sequence[float],
    visual_grid: Sequence[float],
    skip_ratio: Callable[[float, float], float],
    distortion: Callable[[float, float], float],
    target_skip: float,
) -> tuple[float, float]:
    """MoDES's frontier search: the (τ_text, τ_visual) of the grids with the least `distortion` among those whose
    `skip_ratio` reaches `target_skip`, both non-decreasing in each threshold. For each τ_text in increasing order, a
    pointer on τ_visual moves down to the smallest value still reaching the target, so `skip_ratio` is called at most
    len(text_grid) + len(visual_grid) times and `distortion` at most len(text_grid) times, each point once."""
    text_grid, visual_grid = sorted(text_grid), sorted(visual_grid)
    cache: dict[tuple[int, int], float] = {}

    def reaches(i: int, j: int) -> bool:
        if (i, j) not in cache:
            cache[(i, j)] = skip_ratio(text_grid[i], visual_grid[j])
        return cache[(i, j)] >= target_skip

    best, best_distortion = None, math.inf
    j, on_frontier = len(visual_grid) - 1, False
    for i in range(len(text_grid)):
        # Once (i - 1, j) reaches the target, (i, j) does too (monotone in τ_text): no evaluation needed.
        if not on_frontier and not reaches(i, j):
            continue  # even the largest τ_visual does not skip enough with this τ_text
        on_frontier = True
        while j > 0 and reaches(i, j - 1):
            j -= 1
        value = distortion(text_grid[i], visual_grid[j])
        if value < best_distortion:
            best, best_distortion = (text_grid[i], visual_grid[j]), value
    if best is None:
        raise ValueError(
            f"target_skip={target_skip} is not reached anywhere on the threshold grids (at most "
            f"{max(cache.values()):.3f}): lower it or raise tau_max"
        )
    return best


def exponential_grid(tau_max: float, points: int, sharpness: float = 5.0) -> list[float]:
    """`points` thresholds from 0 to `tau_max`, denser near 0 (where routing weights are)."""
    steps = torch.linspace(0, 1, points, dtype=torch.float64)
    return (tau_max * torch.expm1(sharpness * steps) / math.expm1(sharpness)).tolist()


def is_visual_token(config, batch: dict) -> torch.Tensor:
    """`(B, S)` bool: the image and video tokens of a processed batch."""
    types = batch.get("mm_token_type_ids")
    if types is not None:
        return types > 0
    ids = batch["input_ids"]
    return (ids == config.image_token_id) | (ids == config.video_token_id)


def check_calibration_modalities(config, batches: Sequence[dict]) -> None:
    """MoDES calibrates one threshold for text and one for visual tokens: both must occur in the data."""
    if not any(bool(is_visual_token(config, batch).any()) for batch in batches):
        raise ValueError(
            "calibration_inputs hold text only: MoDES calibrates a threshold for text and one for visual tokens, so "
            "add inputs with images or videos"
        )


@torch.no_grad()
def calibrate_modes(
    model,
    calibration_inputs: Sequence[dict],
    target_skip: float,
    grid_points: int = 100,
    tau_max: float | None = None,
) -> dict:
    """MoDES's layer scales and thresholds for `model` (a `MoEmbForEmbedding`) on `calibration_inputs` (batches as
    the processor returns them, with images or videos and text), skipping `target_skip` of the routed slots.
    Returns the `adaptive` settings to store in the config: `{"top_k": "modes", "modes_thresholds": ...,
    "modes_layer_scales": ...}`. Costs 2·L forwards per batch for the scales, then at most 2·grid_points passes."""
    if not 0 <= target_skip < 1:
        raise ValueError(f"target_skip={target_skip} must lie in [0, 1): the share of routed slots skipped")
    check_calibration_modalities(model.config, calibration_inputs)
    layers = model.model.language_model.layers
    full = [model(**batch, adaptive={}).embeddings for batch in calibration_inputs]

    def distortion_of(embeddings: list[torch.Tensor]) -> float:
        # 1 − cos, clamped: a cosine of unchanged embeddings can exceed 1 in the last bit
        distances = [(1 - F.cosine_similarity(e, f, dim=-1)).clamp(min=0) for e, f in zip(embeddings, full)]
        return float(torch.cat(distances).mean())

    distortions = torch.zeros(len(layers), len(MODES_MODALITIES), dtype=torch.float64)
    for layer in layers:
        for modality_class in range(len(MODES_MODALITIES)):
            skipped = []
            for batch in calibration_inputs:
                disable = _disable_modality(
                    is_visual_token(model.config, batch), batch.get("attention_mask"), modality_class
                )
                with edited_routing(layer.mlp.gate, disable):
                    skipped.append(model(**batch, adaptive={}).embeddings)
            distortions[layer.layer_idx, modality_class] = distortion_of(skipped)
    scales = len(layers) * distortions / distortions.sum(0).clamp(min=torch.finfo(torch.float64).tiny)
    layer_scales = scales.tolist()

    def settings(tau_text: float, tau_visual: float) -> AdaptiveSettings:
        return AdaptiveSettings(
            top_k="modes", modes_thresholds={"text": tau_text, "visual": tau_visual}, modes_layer_scales=layer_scales
        )

    runs: dict[tuple[float, float], tuple[float, float]] = {}

    def run(tau_text: float, tau_visual: float) -> tuple[float, float]:
        if (tau_text, tau_visual) not in runs:
            outputs = [model(**batch, adaptive=settings(tau_text, tau_visual)) for batch in calibration_inputs]
            executed = sum(output.adaptive.executed_slots for output in outputs)
            skip_ratio = 1 - executed / sum(output.adaptive.routed_slots for output in outputs)
            runs[(tau_text, tau_visual)] = (skip_ratio, distortion_of([output.embeddings for output in outputs]))
        return runs[(tau_text, tau_visual)]

    tau_max = float(scales.max()) if tau_max is None else tau_max  # s · α ≤ s: every slot skipped at the top
    grid = exponential_grid(tau_max, grid_points)
    tau_text, tau_visual = frontier_search(
        grid, grid, lambda t, v: run(t, v)[0], lambda t, v: run(t, v)[1], target_skip
    )
    return settings(tau_text, tau_visual).to_dict()


def _disable_modality(is_visual: torch.Tensor, attention_mask: torch.Tensor | None, modality_class: int):
    """A routing edit that zeroes every routed slot of the tokens of one MoDES modality class (0 text, 1 visual);
    the block routes the real tokens in row-major order."""
    routed_visual = is_visual.flatten() if attention_mask is None else is_visual[attention_mask.bool()]
    of_class = routed_visual if modality_class == 1 else ~routed_visual

    def edit(logits, weights, index):
        return weights * ~of_class.to(weights.device)[:, None]

    return edit

