"""Qwen3.5-MoE VLM -> SMoES Qwen3.5-MoE (spec smoes.md §5): the same weights plus the SMoES buffers, by the steps of
`smoes_common`. The source is loaded with transformers' own `Qwen3_5MoeForConditionalGeneration`, which fuses the
per-expert 2D tensors of the checkpoint; Gaussian scores are the default on this hybrid host (spec §1.3)."""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3_5MoeForConditionalGeneration

from ..configuration.smoes import SmoesQwen3_5MoeConfig
from ..modeling.smoes.qwen3_5_moe import SmoesQwen3_5MoeForConditionalGeneration
from .common import ConversionResult
from .cost import PlannedOutput
from .smoes_common import (
    SmoesHost,
    add_smoes_arguments,
    convert_to_smoes,
    convert_with_processor,
    plan_smoes_output,
    synthetic_image_text_batch,
)


HOST = SmoesHost(
    title="Qwen3.5-MoE",
    source_model_types=("qwen3_5_moe",),
    source_class=Qwen3_5MoeForConditionalGeneration,
    config_class=SmoesQwen3_5MoeConfig,
    model_class=SmoesQwen3_5MoeForConditionalGeneration,
    default_score_type="gaussian",
)

__all__ = ["HOST", "add_arguments", "convert", "convert_qwen3_5_moe_to_smoes", "plan_output",
           "synthetic_image_text_batch"]


def convert_qwen3_5_moe_to_smoes(source: str | Path, **options) -> tuple[SmoesQwen3_5MoeForConditionalGeneration, dict]:
    """Convert a Qwen3.5-MoE VLM folder (`model_type: qwen3_5_moe`) into SMoES Qwen3.5-MoE; the options and the report
    are `smoes_common.convert_to_smoes`'s."""
    return convert_to_smoes(HOST, source, **options)


def add_arguments(parser) -> None:
    add_smoes_arguments(parser, HOST)


def convert(source: Path, **options) -> ConversionResult:
    """`moezoo convert --to smoes --from <Qwen3.5-MoE folder or Hub id>`."""
    return convert_with_processor(HOST, source, **options)


def plan_output(source: Path, **options) -> PlannedOutput:
    """`moezoo convert --to smoes --from <Qwen3.5-MoE folder> --dry-run`."""
    return plan_smoes_output(HOST, source, **options)
