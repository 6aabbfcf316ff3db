"""MoEMB's inference-time adaptive computation (spec moemb.md §3.3-3.9, §3.12), selected by
`MoEmbConfig.adaptive` or `model(..., adaptive=...)` (`moezoo.configuration.moemb_adaptive.AdaptiveSettings`)."""

from .forward import AdaptiveForward, AdaptiveReport, TokenMetadata
from .modes import calibrate_modes, frontier_search


__all__ = ["AdaptiveForward", "AdaptiveReport", "TokenMetadata", "calibrate_modes", "frontier_search"]
