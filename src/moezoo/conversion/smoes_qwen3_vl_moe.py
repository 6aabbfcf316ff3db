"""Qwen3-VL-MoE VLM -> SMoES Qwen3-VL-MoE (spec smoes.md §1.3, §5): the same weights plus the SMoES buffers, by the
steps of `smoes_common`. The source is loaded with transformers' own `Qwen3VLMoeForConditionalGeneration`, which
applies the checkpoint's transposition of the fused experts; attention scores are the default on this all-softmax-
attention host (spec §1.3)."""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3VLMoeForConditionalGeneration

from ..configuration.smoes import SmoesQwen3VLMoeConfig
from ..modeling.smoes.qwen3_vl_moe import SmoesQwen3VLMoeForConditionalGeneration
from .common import ConversionResult
from .cost import PlannedOutput
from .smoes_common import SmoesHost, add_smoes_arguments, convert_to_smoes, convert_with_processor, plan_smoes_output


HOST = SmoesHost(
    title="Qwen3-VL-MoE",
    source_model_types=("qwen3_vl_moe",),
    source_class=Qwen3VLMoeForConditionalGeneration,
    config_class=SmoesQwen3VLMoeConfig,
    model_class=SmoesQwen3VLMoeForConditionalGeneration,
    default_score_type="attention",
)


def convert_qwen3_vl_moe_to_smoes(
    source: str | Path, **options
) -> tuple[SmoesQwen3VLMoeForConditionalGeneration, dict]:
    """Convert a Qwen3-VL-MoE VLM folder (`model_type: qwen3_vl_moe`) into SMoES Qwen3-VL-MoE; the options and the
    report are `smoes_common.convert_to_smoes`'s."""
    return convert_to_smoes(HOST, source, **options)


def add_arguments(parser) -> None:
    add_smoes_arguments(parser, HOST)


def convert(source: Path, **options) -> ConversionResult:
    """`moezoo convert --to smoes --from <Qwen3-VL-MoE folder or Hub id>`."""
    return convert_with_processor(HOST, source, **options)


def plan_output(source: Path, **options) -> PlannedOutput:
    """`moezoo convert --to smoes --from <Qwen3-VL-MoE folder> --dry-run`."""
    return plan_smoes_output(HOST, source, **options)
