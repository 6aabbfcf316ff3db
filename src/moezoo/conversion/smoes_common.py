"""A transformers MoE VLM -> its SMoES host (spec smoes.md §5): the same weights plus the SMoES buffers. What every
SMoES converter shares; each host's module (`smoes_qwen3_5_moe`, `smoes_qwen3_vl_moe`) names its classes in a
`SmoesHost`.

SMoES adds no parameter, so the conversion is a copy, streamed tensor by tensor (DESIGN.md, "Real scale"), in the
order the spec prescribes:

1. the source's tensors are accounted for without reading one: its transformers class
   (`Qwen3_5MoeForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`) is loaded on the meta device, and a
   checkpoint it would load with missing or unexpected weights is refused;
2. the SMoES config is the source's config plus the `smoes_*` fields;
3. every source tensor is copied under its own name, in the source's checkpoint layout (the SMoES classes load it
   with the same checkpoint conversion: Qwen3.5-MoE's per-expert 2D tensors -> fused 3D experts, Qwen3-VL-MoE's
   transposed fused experts -> the in-memory layout), in `dtype` (default the source's; each tensor checked to fit
   it), then the SMoES buffers at their initial values; the SMoES class, loaded on the meta device, must find every
   tensor it needs and no other (the ones transformers ignores, `mtp.*`, are dropped and reported);
4. max |Δ| of the logits against the source model on a synthetic image-text batch is measured, both models run layer
   by layer (0 by construction: SMoES changes no forward computation);
5. optionally (`calibrate`), training-mode forwards without gradient on synthetic image-text batches initialise the
   Gaussian statistics, the dispatch counts and the bins, so that the first training step sees non-trivial scores;
   this loads the converted model whole.

The memory a conversion takes is one source tensor and one output shard (`max_shard_size`), and for the verification
one decoder layer of each model beside the embeddings, whatever the depth. Saving (the streamed folder, the processor,
the provenance) is `moezoo convert`'s, atomic.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils.hub import convert_file_size_to_int

from ..modeling.moe.smoes.scores import SCORE_TYPES
from ..modeling.moe.smoes.state import SmoesLayerState
from ..processors.build_smoes import make_smoes_processor
from ..terminal import quiet_libraries
from .common import (
    ConversionResult,
    option_name,
    plain_config_fields,
    read_config,
    source_license,
    source_tokenizer,
)
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, output_dtype
from .streaming import (
    ShardWriter,
    SourceCheckpoint,
    StreamedModel,
    copy_as,
    load_layer_by_layer,
    stream_groups,
)


# The paper's bin count (spec §2.6), and the expert-parallel devices bins are placed on when it divides the bins.
DEFAULT_NUM_BINS = 8
DEFAULT_EP_DEVICES = 8


@dataclass(frozen=True)
class SmoesHost:
    """What a converter needs to know of one SMoES host.

    Args:
        title: how the source is named in errors ("Qwen3.5-MoE").
        source_model_types: the `model_type`s of the source's `config.json`.
        source_class: the transformers class that loads the source (and applies its checkpoint conversion).
        config_class: the SMoES host's top-level config class.
        model_class: the SMoES host's model class.
        default_score_type: the soft modality score the host defaults to (spec §1.3).
    """

    title: str
    source_model_types: tuple[str, ...]
    source_class: type[PreTrainedModel]
    config_class: type[PreTrainedConfig]
    model_class: type[PreTrainedModel]
    default_score_type: str


def smoes_config_from(host: SmoesHost, source_config: dict, smoes_fields: dict) -> PreTrainedConfig:
    """The SMoES config of a source `config.json` (as a dict): every field kept, `smoes_fields` added to the text
    config. Option values are checked here first, so that errors name the command's options."""
    text_fields = plain_config_fields(source_config.get("text_config", {}))
    # Qwen's own config.json files say `num_experts`; transformers' Qwen3-VL-MoE config saves it as `num_local_experts`.
    num_experts = text_fields.get("num_experts", text_fields.get("num_local_experts"))
    num_bins = smoes_fields["smoes_num_bins"]
    if not isinstance(num_bins, int) or num_bins < 1 or num_experts % num_bins:
        raise ValueError(
            f"{option_name('num_bins', num_bins)} must divide the source's {num_experts} experts per layer; "
            f"choose a divisor of {num_experts}"
        )
    ep_devices = smoes_fields["smoes_ep_devices"]
    if not isinstance(ep_devices, int) or ep_devices < 1 or num_bins % ep_devices:
        raise ValueError(
            f"{option_name('ep_devices', ep_devices)} must divide {option_name('num_bins', num_bins)}: each "
            "expert-parallel device holds whole bins"
        )
    return host.config_class(
        **plain_config_fields(source_config)
        | dict(
            text_config=text_fields | smoes_fields,
            vision_config=plain_config_fields(source_config.get("vision_config", {})),
        )
    )


def initial_smoes_buffers(host: SmoesHost, config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """What SMoES adds to the source's tensors, by state-dict key: each MoE layer's statistics, dispatch counts and bins
    at their initial values (float32), and the step counter at 0. The model is built on the meta device and only its
    SMoES states are materialised."""
    with torch.device("meta"):
        model = host.model_class(config)
    buffers = {"model.language_model.smoes_step": torch.zeros((), dtype=torch.long)}
    for name, module in model.named_modules():
        if isinstance(module, SmoesLayerState):
            module.to_empty(device="cpu")
            module.init_buffers()
            buffers |= {f"{name}.{key}": tensor for key, tensor in module.state_dict().items()}
    return buffers


def synthetic_image_text_batch(config: PreTrainedConfig, batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """`batch_size` examples of a few text tokens, one image of 4x4 patches (4 image tokens after the 2x2 merge)
    between `<|vision_start|>` and `<|vision_end|>`, and more text, as Qwen3-VL's processor lays them out."""
    generator = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    special = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    text_ids = torch.randint(0, min(*special, 1000), (batch_size, 8), generator=generator)
    grid = (1, 2 * vision.spatial_merge_size, 2 * vision.spatial_merge_size)
    image = torch.tensor([config.vision_start_token_id] + [config.image_token_id] * 4 + [config.vision_end_token_id])
    input_ids = torch.cat([text_ids[:, :3], image.expand(batch_size, -1), text_ids[:, 3:]], dim=1)
    patches = grid[1] * grid[2]
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(batch_size * patches, patch_values, generator=generator),
        "image_grid_thw": torch.tensor([grid] * batch_size),
        "mm_token_type_ids": (input_ids == config.image_token_id).int(),
    }


@torch.no_grad()
def calibrate_statistics(model: PreTrainedModel, batches: int, seed: int = 0) -> None:
    """`batches` training-mode forwards without gradient or optimiser (spec §5 step 5): they update the Gaussian
    statistics, the dispatch counts and the bins. The step counter is set back to 0 afterwards, so that the alpha_MI
    warm-up and the bin-freezing schedule count training steps only."""
    was_training = model.training
    model.train()
    parameter = next(model.parameters())
    for index in range(batches):
        batch = synthetic_image_text_batch(model.config, seed=seed + index)
        batch["pixel_values"] = batch["pixel_values"].to(parameter.dtype)
        model(**{key: value.to(parameter.device) for key, value in batch.items()})
    model.model.language_model.smoes_step.zero_()
    model.train(was_training)


@torch.no_grad()
def logit_difference(host: SmoesHost, source: Path, converted: Path) -> float:
    """max |logits| difference of the source and the converted folder in fp32, eval mode, on a synthetic image-text
    batch; each runs layer by layer (`load_layer_by_layer`), one after the other, so the memory does not grow with the
    depth."""
    with tempfile.TemporaryDirectory(prefix="smoes-verification-") as offload:
        with quiet_libraries():
            base = load_layer_by_layer(host.source_class, source, Path(offload) / "source", dtype=torch.float32)
        batch = synthetic_image_text_batch(base.config)
        expected = base(**batch).logits
        del base  # one model at a time
        model = load_layer_by_layer(host.model_class, converted, Path(offload) / "converted", dtype=torch.float32)
        return (model(**batch).logits - expected).abs().max().item()


def _smoes_config(host: SmoesHost, folder: Path, num_bins: int, score_type: str | None,
                  ep_devices: int | None) -> PreTrainedConfig:
    """The SMoES config of the source's config.json, with the options' defaults resolved."""
    source_config = read_config(folder, host.source_model_types, f"{host.title} vision-language")
    score_type = score_type or host.default_score_type
    if score_type not in SCORE_TYPES:
        raise ValueError(f"{option_name('score_type', score_type)} must be one of {', '.join(SCORE_TYPES)}")
    if ep_devices is None:
        ep_devices = DEFAULT_EP_DEVICES if num_bins % DEFAULT_EP_DEVICES == 0 else num_bins
    smoes_fields = {"smoes_num_bins": num_bins, "smoes_score_type": score_type, "smoes_ep_devices": ep_devices}
    return smoes_config_from(host, source_config, smoes_fields)


def plan_smoes_output(host: SmoesHost, source: Path, num_bins: int = DEFAULT_NUM_BINS, score_type: str | None = None,
                      ep_devices: int | None = None, **_other_options) -> PlannedOutput:
    """What the conversion into `host` writes, from the source's config alone (`moezoo convert --dry-run`, the
    disk-space check)."""
    return PlannedOutput(_smoes_config(host, Path(source), num_bins, score_type, ep_devices), (Path(source),))


def convert_to_smoes(
    host: SmoesHost,
    source: str | Path,
    num_bins: int = DEFAULT_NUM_BINS,
    score_type: str | None = None,
    ep_devices: int | None = None,
    calibrate: int = 0,
    seed: int = 0,
    verify: bool = True,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> tuple[StreamedModel | PreTrainedModel, dict]:
    """Convert a folder of `host`'s source model into the SMoES host, streamed tensor by tensor.

    Args:
        num_bins: expert bins per MoE layer (the paper: 8); must divide the experts per layer.
        score_type: `"gaussian"`, `"attention"` or `"hard"` (an ablation); default: the host's.
        ep_devices: expert-parallel devices the bins are placed on; must divide `num_bins` (default: 8 when it
            divides `num_bins`, else one device per bin).
        calibrate: this many training-mode forwards without gradient initialise the SMoES statistics and bins.
        seed: seeds the synthetic calibration batches.
        verify: measure max |Δ| of the logits against the source model, both in fp32.
        dtype: of the converted model's weights (default: the source's); the SMoES buffers stay fp32.
        max_shard_size: the largest output shard (bytes or a string like `"5GB"`), which the conversion holds in
            memory before writing it.

    Returns:
        The converted model, as the folder it was streamed into (`StreamedModel`), or loaded and in eval mode when
        `calibrate` asks for forwards; and a report: source, licence, SMoES settings, tensor accounting, max |Δ|.
    """
    folder = Path(source)
    if not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"{option_name('calibrate', calibrate)} must be 0 or a number of batches")
    config = _smoes_config(host, folder, num_bins, score_type, ep_devices)
    score_type, ep_devices = config.text_config.smoes_score_type, config.text_config.smoes_ep_devices

    checkpoint = SourceCheckpoint(folder, "the source")
    with quiet_libraries():  # on the meta device: the keys transformers would load, and no weight read
        base, loading = host.source_class.from_pretrained(str(folder), device_map="meta", output_loading_info=True)
    # transformers only reports these: a source missing weights would be converted with random ones.
    incomplete = {kind: sorted(loading[kind])[:8] for kind in ("missing_keys", "unexpected_keys") if loading[kind]}
    if incomplete:
        raise ValueError(f"{folder} is not a complete {host.title} checkpoint: {incomplete}")
    dtype = output_dtype(dtype, folder)
    ignored = [re.compile(pattern) for pattern in host.source_class._keys_to_ignore_on_load_unexpected or ()]
    dropped = sorted(key for key in checkpoint.shapes if any(pattern.search(key) for pattern in ignored))
    copied = [copy_as(key, key) for key in checkpoint.shapes if key not in dropped]

    model = StreamedModel(host.model_class, "smoes-conversion-")
    writer = ShardWriter(model.folder, convert_file_size_to_int(max_shard_size), dtype)
    for key, tensor in stream_groups([checkpoint], copied):
        writer.add(key, tensor)
    smoes_buffers = initial_smoes_buffers(host, config)
    for key, tensor in smoes_buffers.items():
        writer.add(key, tensor, cast=False)
    writer.finish()
    config.architectures = [host.model_class.__name__]
    config.dtype = dtype
    config.save_pretrained(model.folder)
    base.generation_config.save_pretrained(model.folder)
    with quiet_libraries():
        _, loading = host.model_class.from_pretrained(model.folder, device_map="meta", output_loading_info=True)
    unplaced = {kind: sorted(loading[kind])[:8] for kind in ("missing_keys", "unexpected_keys") if loading[kind]}
    if unplaced:
        raise ValueError(f"the SMoES model does not load the copied {host.title} tensors: {unplaced}")
    accounting = {"copied": len(copied), "smoes_buffers": len(smoes_buffers), "dropped": dropped}

    difference = logit_difference(host, folder, model.folder) if verify else None
    if calibrate:
        model = model.load()
        calibrate_statistics(model, calibrate, seed)
    report = {
        "source": str(folder),
        "base_model": str(folder),
        "license": source_license(folder),
        "dtype": str(dtype).removeprefix("torch."),
        "smoes": {"num_bins": num_bins, "score_type": score_type, "ep_devices": ep_devices},
        "calibration_batches": calibrate,
        "accounting": accounting,
        "max_abs_diff": difference,
        "notes": [
            f"max_abs_diff: the logits of transformers' {host.source_class.__name__} and of the SMoES model, both in "
            "eval mode on a synthetic image-text batch.",
        ],
    }
    return model, report


# --- `moezoo convert --to smoes --from <source folder or Hub id>` ---------------------------------------------------


def add_smoes_arguments(parser, host: SmoesHost) -> None:
    """The options of a converter into `host`."""
    parser.add_argument("--num-bins", type=int, default=DEFAULT_NUM_BINS,
                        help="expert bins per MoE layer (the paper: 8); must divide the experts per layer")
    parser.add_argument("--score-type", choices=SCORE_TYPES, default=host.default_score_type,
                        help=f"the soft modality score: gaussian, attention or hard (an ablation); default on "
                             f"{host.title}: {host.default_score_type}")
    parser.add_argument("--ep-devices", type=int, default=None,
                        help="expert-parallel devices the bins are placed on; must divide --num-bins (default: 8 "
                             "when it divides --num-bins, else one per bin)")
    parser.add_argument("--calibrate", type=int, default=0, metavar="N",
                        help="N training-mode forwards without gradient on synthetic image-text batches, which "
                             "initialise the SMoES statistics and bins")
    parser.add_argument("--seed", type=int, default=0, help="seeds the calibration batches")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest output shard, which the conversion holds in memory before writing it")
    add_dtype_argument(parser)
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip measuring max |Δ| against the source model")


def convert_with_processor(host: SmoesHost, source: Path, **options) -> ConversionResult:
    """The converter behind the command: the model and its processor, the source's tokenizer and image processor
    settings where it has them (a tiny tokenizer built offline, or Qwen3.5's, where it has none)."""
    model, report = convert_to_smoes(host, source, **options)
    folder = Path(source)
    image_processor = (
        Qwen2VLImageProcessorPil.from_pretrained(str(folder))
        if (folder / "preprocessor_config.json").is_file()
        else None
    )
    processor = make_smoes_processor(model.config, tokenizer=source_tokenizer(folder), image_processor=image_processor)
    return ConversionResult(model, processor, report)
