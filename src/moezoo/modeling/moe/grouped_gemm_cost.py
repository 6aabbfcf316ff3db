"""The grouped-GEMM cost model of routed experts (MoEMB spec §3.14, App. C.3 of the paper): a utility for choosing
expert-skip budgets that turn into wall-clock savings.

A grouped GEMM runs each expert's rows in tiles of M = 128 rows, so its cost grows with the tiles, not the rows:

    cost ∝ Σ_j ⌈n_j / 128⌉            n_j: the (token, slot) rows expert j executes

Under balanced routing every expert gets n = T·k / E rows (T tokens, top-k of E experts), and skipping a fraction s of
the routed slots leaves n·(1 − s). A skip saves time only when it takes an expert below a tile boundary: at
T = 4096, k = 8, E = 256 an expert has 128 rows, one tile, and a 52.9% skip (≈ 60 rows) still runs one tile (the
paper measures a 0.91× slowdown from the gate's overhead); at T = 8192 an expert has 256 rows, two tiles, and a 69.6%
skip (≈ 78 rows) runs one (1.11× measured, the rest of the layer unchanged).
"""

from __future__ import annotations

import math

import torch


GROUPED_GEMM_TILE_ROWS = 128


def _check_tile_rows(tile_rows: int) -> None:
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive integer (rows per GEMM tile), got {tile_rows!r}")


def expert_tiles(rows_per_expert: torch.Tensor, tile_rows: int = GROUPED_GEMM_TILE_ROWS) -> torch.Tensor:
    """Σ_j ⌈n_j / tile_rows⌉ over the last dimension of `rows_per_expert` (`(..., E)` rows each expert executes, e.g.
    the `routing_counts` of a forward summed over modalities): the tiles a grouped GEMM runs, per leading index."""
    _check_tile_rows(tile_rows)
    if rows_per_expert.is_floating_point() or (rows_per_expert < 0).any():
        raise ValueError("rows_per_expert must be non-negative integer row counts")
    return torch.div(rows_per_expert + tile_rows - 1, tile_rows, rounding_mode="floor").sum(-1)


def balanced_rows_per_expert(num_tokens: int, top_k: int, num_experts: int, skip_fraction: float = 0.0) -> float:
    """n = T·k / E · (1 − s): the rows of each expert when routing is balanced and a fraction s of slots is skipped."""
    if not 0.0 <= skip_fraction <= 1.0:
        raise ValueError(f"skip_fraction must lie in [0, 1], got {skip_fraction!r}")
    if num_tokens < 0 or not 0 < top_k <= num_experts:
        raise ValueError(
            f"need num_tokens >= 0 and 0 < top_k <= num_experts, got num_tokens={num_tokens}, top_k={top_k}, "
            f"num_experts={num_experts}"
        )
    return num_tokens * top_k / num_experts * (1.0 - skip_fraction)


def balanced_expert_tiles(num_tokens: int, top_k: int, num_experts: int, skip_fraction: float = 0.0,
                          tile_rows: int = GROUPED_GEMM_TILE_ROWS) -> int:  # fmt: skip
    """E · ⌈n / tile_rows⌉: the tiles one layer's grouped GEMM runs under balanced routing."""
    _check_tile_rows(tile_rows)
    rows = balanced_rows_per_expert(num_tokens, top_k, num_experts, skip_fraction)
    return num_experts * math.ceil(rows / tile_rows)


def expert_tile_speedup(num_tokens: int, top_k: int, num_experts: int, skip_fraction: float,
                        tile_rows: int = GROUPED_GEMM_TILE_ROWS) -> float:  # fmt: skip
    """How many times fewer expert tiles a skip fraction runs than full routing (1.0: no gain from the experts; the
    rest of the layer, attention, shared expert and dispatch, is not in it)."""
    skipped = balanced_expert_tiles(num_tokens, top_k, num_experts, skip_fraction, tile_rows)
    full = balanced_expert_tiles(num_tokens, top_k, num_experts, 0.0, tile_rows)
    return math.inf if skipped == 0 else full / skipped


def smallest_skip_saving_a_tile(num_tokens: int, top_k: int, num_experts: int,
                                tile_rows: int = GROUPED_GEMM_TILE_ROWS) -> float:  # fmt: skip
    """The smallest skip fraction that takes every expert one tile lower under balanced routing: 1 − (c − 1)·M / n for
    n rows in c tiles of M rows. 1.0 when the experts run a single tile (only skipping everything saves it), 0.0
    when they run none."""
    _check_tile_rows(tile_rows)
    rows = balanced_rows_per_expert(num_tokens, top_k, num_experts)
    tiles = math.ceil(rows / tile_rows)
    if tiles == 0:
        return 0.0
    return 1.0 - (tiles - 1) * tile_rows / rows
