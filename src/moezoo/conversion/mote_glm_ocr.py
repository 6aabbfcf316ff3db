"""GLM-OCR -> GLM-OCR-MoTE (spec mote.md §5.1), streamed shard by shard (`mote_common`), and verified with both models
run layer by layer.

Only the decoder FFNs change: `model.language_model.layers.{l}.mlp.{gate_up_proj,down_proj}.weight` of each converted
layer become the experts of §5.3 (by default routed copies and a shared expert whose `down_proj` is zero, so every
route is GLM-OCR exactly). The vision tower and the merger, whose MLPs have the same projection names, are copied
unchanged: the FFN pattern is anchored on `model.language_model.layers`. The multi-token-prediction layer
(`model.language_model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers: 1` in the release) is dropped, as
MoTE does not support MTP decoding (spec A22); the report lists every dropped tensor.
"""

import logging
import re
from pathlib import Path

import torch
from transformers import GlmOcrForConditionalGeneration, GlmOcrTextConfig

from ..configuration.mote import GlmOcrMoteConfig
from ..hub.sources import source_name
from ..modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from ..processors.build_mote import make_glm_ocr_mote_processor
from .common import ConversionResult, plain_config_fields, read_config, source_tokenizer
from .cost import PlannedOutput
from .dtypes import output_dtype
from .mote_common import (
    GLM_FFN,
    MotePlan,
    add_common_arguments,
    as_experts,
    conversion_report,
    measure_routes,
    mote_fields,
    write_mote_checkpoint,
)
from .streaming import SourceCheckpoint, StreamedModel


logger = logging.getLogger(__name__)

_DECODER_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\..+")


def stream_glm_ocr_to_mote(
    source: str | Path,
    experts=("ocr", "kie"),
    construction: str = "copy",
    default_route: str | None = "ocr",
    mote_layers: list[int] | None = None,
    num_shared_experts: int = 1,
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
) -> tuple[StreamedModel, dict]:
    """Convert a GLM-OCR checkpoint folder (`model_type: glm_ocr`, safetensors) into GLM-OCR-MoTE, streamed shard by
    shard into a temporary folder (the returned `StreamedModel`).

    Args:
        experts: expert names in route order, optionally with descriptions (`{"ocr": None, "kie": "..."}`, a list of
            names, or the `--experts` text `"ocr,kie:extract fields"`); a missing description is the default of a
            known route name.
        construction: `"copy"` (default, function-preserving), `"copy_half"`, `"paper_literal"` or `"split"`
            (spec §5.3).
        default_route: the expert used without `task_ids`; `"ocr"` makes the model act as GLM-OCR by default.
        mote_layers: the decoder layers to convert (default: all).
        num_shared_experts: 1 (default) or 0.
        dtype: of the converted model (and of the source model the routes are measured against); default: the
            source's.
        seed: seeds the neuron partition of `split`.
        verify: run GLM-OCR and every route on two synthetic image + text examples, each model layer by layer; the
            report gets the largest logit difference of each route (`max_abs_diff_by_route`) and overall
            (`max_abs_diff`).
        max_shard_size: the largest output shard (bytes or a string like `"5GB"`).

    Returns:
        The converted model as its folder, and a report: source, licence, configuration, key accounting (copied,
        turned into experts, dropped with the reason), parameter counts, measured differences.
    """
    folder = Path(source)
    config, num_mtp_layers = _mote_config(folder, experts, construction, default_route, mote_layers,
                                          num_shared_experts)
    dtype = output_dtype(dtype, folder)
    text_config = config.text_config
    num_layers = text_config.num_hidden_layers
    with torch.device("meta"):
        model = GlmOcrMoteForConditionalGeneration(config)

    checkpoint = SourceCheckpoint(folder, "the GLM-OCR checkpoint")
    plan = MotePlan(GLM_FFN, text_config, construction, seed)
    ffn_prefixes = [f"model.language_model.layers.{i}.mlp" for i in range(num_layers) if text_config.is_mote_layer(i)]
    experts_from = plan.add_ffns(
        {prefix: {p: f"{prefix}.{p}" for p in GLM_FFN.projections} for prefix in ffn_prefixes}, checkpoint.shapes
    )
    for key in checkpoint.shapes:
        layer = _DECODER_LAYER.fullmatch(key)
        if key in experts_from:
            continue
        if layer and num_layers <= int(layer[1]) < num_layers + num_mtp_layers:
            plan.drop(key, "the multi-token-prediction (MTP) layer: MoTE does not support MTP decoding")
        else:
            plan.copy(key, key)
    if plan.accounting["dropped"]:
        logger.info("dropped %d tensors of the MTP layer", len(plan.accounting["dropped"]))
    streamed = StreamedModel(GlmOcrMoteForConditionalGeneration, "mote-conversion-")
    write_mote_checkpoint(plan, [checkpoint], model, dtype, streamed.folder, max_shard_size)

    differences = None
    if verify:
        differences = measure_routes(GlmOcrForConditionalGeneration, folder, GlmOcrMoteForConditionalGeneration,
                                     streamed.folder, dtype, synthetic_inputs(config))  # fmt: skip
    report = conversion_report(model, folder, "glm_ocr", construction, plan.accounting, differences,
                               "GLM-OCR's on two synthetic image + text examples")  # fmt: skip
    report["notes"].append("The MTP layer is dropped: MoTE does not support multi-token-prediction decoding.")
    return streamed, report


def convert_glm_ocr_to_mote(source: str | Path, **options) -> tuple[GlmOcrMoteForConditionalGeneration, dict]:
    """`stream_glm_ocr_to_mote`, the converted model then loaded in memory, in eval mode (for small models and tests;
    `moezoo convert` keeps it on disk)."""
    streamed, report = stream_glm_ocr_to_mote(source, **options)
    return streamed.load(dtype=streamed.config.dtype), report


def _mote_config(folder: Path, experts, construction, default_route, mote_layers,
                 num_shared_experts) -> tuple[GlmOcrMoteConfig, int]:
    """The GLM-OCR-MoTE config of the source's config.json, and how many multi-token-prediction layers it drops."""
    source_config = read_config(folder, ("glm_ocr",), "GLM-OCR")
    text_fields = plain_config_fields(source_config.get("text_config", {}))
    # The MTP layer is dropped, so the converted config does not announce one.
    num_mtp_layers = text_fields.pop("num_nextn_predict_layers", 0)
    dense_text_config = GlmOcrTextConfig(**text_fields)
    config = GlmOcrMoteConfig(
        **plain_config_fields(source_config)
        | dict(
            text_config=text_fields | mote_fields(
                as_experts(experts), construction, dense_text_config.intermediate_size, num_shared_experts,
                default_route, mote_layers, base_model=source_name(folder),
            ),
            vision_config=plain_config_fields(source_config.get("vision_config", {})),
        )
    )
    return config, num_mtp_layers


def plan_output(source: Path, experts=("ocr", "kie"), construction: str = "copy", default_route: str | None = "ocr",
                mote_layers: list[int] | None = None, num_shared_experts: int = 1, **_other_options) -> PlannedOutput:
    """What `convert` writes, from the source's config alone (`moezoo convert --dry-run`, the disk-space check)."""
    config, _ = _mote_config(Path(source), experts, construction, default_route, mote_layers, num_shared_experts)
    return PlannedOutput(config, (Path(source),))


def synthetic_inputs(config: GlmOcrMoteConfig, batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """`batch_size` examples of one 4x4-patch image (4 image tokens) between a few text tokens, as GLM-OCR's processor
    lays them out."""
    generator = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    special = (config.image_token_id, config.video_token_id, config.image_start_token_id, config.image_end_token_id,
               config.video_start_token_id, config.video_end_token_id)
    text_ids = torch.randint(0, min(*special, 1000), (batch_size, 6), generator=generator)
    tokens_per_image = 16 // vision.spatial_merge_size**2
    image = torch.tensor(
        [config.image_start_token_id] + [config.image_token_id] * tokens_per_image + [config.image_end_token_id]
    )
    input_ids = torch.cat([text_ids[:, :3], image.expand(batch_size, -1), text_ids[:, 3:]], dim=1)
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(batch_size * 16, patch_values, generator=generator),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch_size),
        "mm_token_type_ids": (input_ids == config.image_token_id).int(),
    }


# --- `moezoo convert --to glm_ocr_mote --from <GLM-OCR folder or Hub id>` ------------------------------------------


def add_arguments(parser) -> None:
    add_common_arguments(parser, default_experts="ocr,kie")
    parser.set_defaults(default_route="ocr")


def convert(source: Path, **options) -> ConversionResult:
    """The converter behind the command: the model streamed into a temporary folder (a `StreamedModel`, which `moezoo
    convert` moves into its output) and a `GlmOcrMoteProcessor` around GLM-OCR's tokenizer (and its chat template); no
    processor when the source has no tokenizer."""
    model, report = stream_glm_ocr_to_mote(source, **options)
    tokenizer = source_tokenizer(Path(source))
    processor = None if tokenizer is None else make_glm_ocr_mote_processor(model.config, tokenizer)
    return ConversionResult(model, processor, report)
