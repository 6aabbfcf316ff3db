"""Llama-3.2 (+ SigLIP 2) -> VideoLLM-MoTE, or Llama alone -> LlamaMote (spec mote.md §5.2), streamed shard by shard
(`mote_common`), and verified with every model run layer by layer.

The decoder FFNs `model.layers.{l}.mlp.{gate,up,down}_proj.weight` of each converted layer become the experts of §5.3
(by default routed copies and a shared expert whose `down_proj` is zero, so every route is the dense Llama exactly);
every other Llama tensor is copied, under `model.language_model.` in VideoLLM-MoTE. The LM head stays tied.

With a vision checkpoint (a FixRes SigLIP 2 `SiglipModel` or `SiglipVisionModel`, `model_type` `siglip` /
`siglip_vision_model`), `vision_model.*` becomes the frozen `model.vision_tower.*`; SigLIP's text tower and
contrastive scale/bias are dropped. The two-layer projector is new: initialised N(0, initializer_range) with zero
biases from `seed`, and reported as such; or it is VideoLLM-online's trained connector (`projector_from`). The
`<v>` placeholder reuses a reserved Llama-3 special token, so the embedding table keeps its size (spec A17); its id
and the id of `,` (between frames) come from the Llama tokenizer unless given.
"""

import json
import re
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

from ..configuration.mote import COIN_EXPERTS, LlamaMoteConfig, VideoLlmMoteConfig
from ..hub.sources import locate, source_name
from ..modeling.mote.llama import LlamaMoteForCausalLM
from ..modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from ..processors.build_mote import make_videollm_mote_processor
from ..terminal import quiet_libraries
from .common import (
    ConversionResult,
    load_safetensors,
    option_name,
    plain_config_fields,
    read_config,
    source_tokenizer,
)
from .cost import PlannedOutput
from .dtypes import output_dtype
from .mote_common import (
    LLAMA_FFN,
    MotePlan,
    add_common_arguments,
    as_experts,
    conversion_report,
    dense_fields,
    largest_differences,
    measure_routes,
    mote_fields,
    route_logits,
    write_mote_checkpoint,
)
from .streaming import SourceCheckpoint, StreamedModel, load_layer_by_layer


_SIGLIP_DROPPED = re.compile(r"text_model\..*|logit_scale|logit_bias")
# VideoLLM-online's connector (Linear, GELU, Linear) below any prefix (`base_model.model.` in its PEFT checkpoints).
_CONNECTOR = re.compile(r"(?:.*\.)?connector\.(0|2)\.(weight|bias)")
_CONNECTOR_LORA = re.compile(r"(?:.*\.)?connector\.(0|2)\.lora_(A|B)(?:\.\w+)?\.weight")
PROJECTOR_LAYERS = {"0": "linear_1", "2": "linear_2"}
PROJECTOR_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "pytorch_model.bin")
VIDEO_TOKEN = "<|reserved_special_token_0|>"
FRAME_SEPARATOR = ","


def stream_llama_to_mote(
    llm: str | Path,
    experts=tuple(COIN_EXPERTS),
    vision: str | Path | None = None,
    construction: str = "copy",
    default_route: str | None = None,
    mote_layers: list[int] | None = None,
    num_shared_experts: int = 1,
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
    verify: bool = True,
    video_token: str = VIDEO_TOKEN,
    video_token_id: int | None = None,
    frame_token_interval_id: int | None = None,
    dense: bool = False,
    projector_from: str | Path | None = None,
    max_shard_size: int | str = "5GB",
) -> tuple[StreamedModel, dict]:
    """Convert a Llama checkpoint folder (`model_type: llama`, safetensors) into `LlamaMoteForCausalLM`, or, with
    `vision`, a SigLIP checkpoint folder too, into `VideoLlmMoteForConditionalGeneration`, streamed shard by shard into
    a temporary folder (the returned `StreamedModel`).

    Args:
        experts / construction / default_route / mote_layers / num_shared_experts / dtype / seed: as in
            `stream_glm_ocr_to_mote` (the dtype defaults to the Llama source's); the default experts are the five
            COIN routes.
        verify: run the dense Llama (and SigLIP) and every route on synthetic inputs (two video examples for
            VideoLLM-MoTE: frames through both vision towers, then the same projector), each model layer by layer, and
            report the differences.
        video_token / video_token_id / frame_token_interval_id: the `<v>` placeholder and the `,` between frames
            (VideoLLM-MoTE only); the ids default to the Llama tokenizer's.
        projector_from: VideoLLM-online's checkpoint, whose connector becomes the projector (default: a new one).
        dense: no task experts: every FFN stays as it is, the matched dense baseline (with `vision`, VideoLLM-online
            1B-v1+ in this class); the expert options do not apply.
        max_shard_size: the largest output shard (bytes or a string like `"5GB"`).
    """
    folder = Path(llm)
    if projector_from is not None and vision is None:
        raise ValueError(
            f"{option_name('projector_from')} (VideoLLM-online's connector) needs {option_name('vision')}: the "
            "projector is VideoLLM-MoTE's"
        )
    config, vision_folder = _mote_config(folder, experts, vision, construction, default_route, mote_layers,
                                         num_shared_experts, video_token, video_token_id, frame_token_interval_id,
                                         dense)  # fmt: skip
    dtype = output_dtype(dtype, folder)
    if vision_folder is None:
        model_class, prefix = LlamaMoteForCausalLM, "model."
    else:
        model_class, prefix = VideoLlmMoteForConditionalGeneration, "model.language_model."
    text_config = config.get_text_config()
    with torch.device("meta"):
        model = model_class(config)

    llama = SourceCheckpoint(folder, "the Llama checkpoint")
    checkpoints = [llama]
    plan = MotePlan(LLAMA_FFN, text_config, construction, seed)
    experts_from = plan.add_ffns({
        f"{prefix}layers.{i}.mlp": {p: f"model.layers.{i}.mlp.{p}" for p in LLAMA_FFN.projections}
        for i in range(text_config.num_hidden_layers) if text_config.is_mote_layer(i)
    }, llama.shapes)  # fmt: skip
    for key in llama.shapes:
        if key in experts_from:
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            plan.drop(key, "the LM head is tied to the token embeddings")
        else:
            plan.copy(key, prefix + key.removeprefix("model.") if key.startswith("model.") else key)
    if vision_folder is not None:
        siglip = SourceCheckpoint(vision_folder, "the SigLIP checkpoint")
        checkpoints.append(siglip)
        for key in siglip.shapes:
            if _SIGLIP_DROPPED.fullmatch(key):
                plan.drop(key, "SigLIP's text tower and contrastive scale/bias are not part of VideoLLM-MoTE")
            else:
                plan.copy(key, "model.vision_tower." + key.removeprefix("vision_model."))
        if projector_from is None:
            _initialise_projector(plan, model, text_config.initializer_range, seed)
        else:
            _import_projector(plan, Path(projector_from), config)
    streamed = StreamedModel(model_class, "mote-conversion-")
    write_mote_checkpoint(plan, checkpoints, model, dtype, streamed.folder, max_shard_size)

    differences = None
    if verify:
        differences = (
            measure_routes(LlamaForCausalLM, folder, model_class, streamed.folder, dtype, synthetic_text_inputs(config))
            if vision_folder is None else measure_videollm_routes(folder, vision_folder, streamed.folder, dtype)
        )
    report = conversion_report(model, folder, "llama", None if dense else construction, plan.accounting, differences,
                               "the dense Llama's on synthetic inputs")  # fmt: skip
    report["vision_source"] = None if vision_folder is None else source_name(vision_folder)
    if vision_folder is not None:
        report["projector_source"] = None if projector_from is None else str(projector_from)
        projector = (f"The projector is new (seed {seed}): train it before use." if projector_from is None
                     else f"The projector is VideoLLM-online's connector from {projector_from}.")  # fmt: skip
        report["notes"].append(
            f"{projector} Video frames are written as "
            f"{config.frame_num_tokens} x {video_token!r} (id {config.video_token_id}) separated by id "
            f"{config.frame_token_interval_id}."
        )
    return streamed, report


def convert_llama_to_mote(
    llm: str | Path, **options
) -> tuple[LlamaMoteForCausalLM | VideoLlmMoteForConditionalGeneration, dict]:
    """`stream_llama_to_mote`, the converted model then loaded in memory, in eval mode (for small models and tests;
    `moezoo convert` keeps it on disk)."""
    streamed, report = stream_llama_to_mote(llm, **options)
    return streamed.load(dtype=streamed.config.dtype), report


def _mote_config(folder: Path, experts, vision, construction, default_route, mote_layers, num_shared_experts,
                 video_token, video_token_id, frame_token_interval_id,
                 dense) -> tuple[LlamaMoteConfig | VideoLlmMoteConfig, Path | None]:  # fmt: skip
    """The converted config, from the Llama's (and the SigLIP's) config.json and the Llama tokenizer, and the SigLIP
    folder (None for the text-only LlamaMote)."""
    llm_fields = plain_config_fields(read_config(folder, ("llama",), "Llama"))
    if dense:
        text_fields = llm_fields | dense_fields(base_model=source_name(folder))
    else:
        text_fields = llm_fields | mote_fields(
            as_experts(experts), construction, LlamaConfig(**llm_fields).intermediate_size, num_shared_experts,
            default_route, mote_layers, base_model=source_name(folder),
        )
    vision_folder = None if vision is None else locate(
        vision, "the SigLIP checkpoint", f"give {option_name('vision')} a local folder"
    )
    if vision_folder is None:
        return LlamaMoteConfig(**text_fields), None
    vision_source = read_config(vision_folder, ("siglip", "siglip_vision_model"), "FixRes SigLIP (2)")
    vision_fields = plain_config_fields(vision_source.get("vision_config", vision_source))
    video_token_id, frame_token_interval_id = _placeholder_ids(
        folder, video_token, video_token_id, frame_token_interval_id
    )
    config = VideoLlmMoteConfig(
        text_config=text_fields, vision_config=vision_fields, video_token=video_token,
        video_token_id=video_token_id, frame_token_interval_id=frame_token_interval_id,
        frame_resolution=SiglipVisionConfig(**vision_fields).image_size,
        tie_word_embeddings=LlamaConfig(**llm_fields).tie_word_embeddings,
    )
    return config, vision_folder


def plan_output(source: Path, experts=tuple(COIN_EXPERTS), vision: str | Path | None = None, construction="copy",
                default_route=None, mote_layers=None, num_shared_experts=1, video_token=VIDEO_TOKEN,
                video_token_id=None, frame_token_interval_id=None, dense=False, projector_from=None,
                **_other_options) -> PlannedOutput:  # fmt: skip
    """What `convert` writes, from the sources' configs and the Llama tokenizer alone (`moezoo convert --dry-run`, the
    disk-space check)."""
    config, vision_folder = _mote_config(Path(source), experts, vision, construction, default_route, mote_layers,
                                         num_shared_experts, video_token, video_token_id, frame_token_interval_id,
                                         dense)  # fmt: skip
    sources = (Path(source),) + (() if vision_folder is None else (vision_folder,))
    return PlannedOutput(config, sources + (() if projector_from is None else (Path(projector_from),)))


def _placeholder_ids(folder: Path, video_token: str, video_token_id, frame_token_interval_id) -> tuple[int, int]:
    """The ids of `<v>` and of the frame separator: given, or looked up in the Llama tokenizer."""
    if video_token_id is not None and frame_token_interval_id is not None:
        return video_token_id, frame_token_interval_id
    tokenizer = source_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(
            f"{folder} has no tokenizer to look up the ids of {video_token!r} and {FRAME_SEPARATOR!r}: pass "
            f"{option_name('video_token_id')} and {option_name('frame_token_interval_id')}"
        )
    if video_token_id is None:
        video_token_id = tokenizer.convert_tokens_to_ids(video_token)
        if video_token_id is None or video_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the Llama tokenizer has no token {video_token!r}; pass {option_name('video_token_id')}")
    if frame_token_interval_id is None:
        separator = tokenizer.encode(FRAME_SEPARATOR, add_special_tokens=False)
        if len(separator) != 1:
            raise ValueError(
                f"{FRAME_SEPARATOR!r} is not one token of the Llama tokenizer; pass "
                f"{option_name('frame_token_interval_id')}"
            )
        frame_token_interval_id = separator[0]
    return video_token_id, frame_token_interval_id


def _import_projector(plan: MotePlan, source: Path, config: VideoLlmMoteConfig) -> None:
    """
    VideoLLM-online's connector as the projector (spec §5.2): `connector.0` -> `linear_1`, `connector.2` -> `linear_2`,
    with a LoRA on the connector merged in (scale `lora_alpha / r` from `adapter_config.json`). `source` is
    VideoLLM-online's PEFT checkpoint folder (`adapter_model.safetensors` or `.bin`, the connector saved as a module
    to save) or one safetensors / PyTorch file. Its other tensors (the LLM's LoRA) are dropped: MoTE starts from the
    base Llama.
    """
    tensors = _read_projector_checkpoint(source)
    weights, lora = {}, {}
    for key, tensor in tensors.items():
        if match := _CONNECTOR.fullmatch(key):
            weights[match[1], match[2]] = (key, tensor)
        elif match := _CONNECTOR_LORA.fullmatch(key):
            lora[match[1], match[2]] = tensor
            plan.drop(key, f"LoRA of connector.{match[1]}, merged into its weight")
        else:
            plan.drop(key, "not the connector (VideoLLM-online's LLM adapter): MoTE starts from the base Llama")
    wanted = [(layer, kind) for layer in PROJECTOR_LAYERS for kind in ("weight", "bias")
              if kind == "weight" or config.multimodal_projector_bias]  # fmt: skip
    missing = [f"connector.{layer}.{kind}" for layer, kind in wanted if (layer, kind) not in weights]
    if missing:
        raise ValueError(
            f"{source} has no {', '.join(missing)}: --projector-from takes a VideoLLM-online checkpoint (its PEFT "
            f"folder, or a file with the connector's two linear layers); it holds {len(tensors)} tensors"
        )
    halves = sorted({layer for layer, _ in lora if ((layer, "A") in lora) != ((layer, "B") in lora)})
    if halves:
        raise ValueError(f"{source} has half a LoRA (lora_A or lora_B alone) on connector.{', '.join(halves)}")
    scale = _lora_scale(source) if lora else None
    for layer, kind in wanted:
        key, tensor = weights[layer, kind]
        if kind == "weight" and (layer, "A") in lora:
            tensor = tensor + scale * (lora[layer, "B"].float() @ lora[layer, "A"].float()).to(tensor.dtype)
        plan.copy_tensor(key, f"model.multi_modal_projector.{PROJECTOR_LAYERS[layer]}.{kind}", tensor)


def _read_projector_checkpoint(source: Path) -> dict[str, torch.Tensor]:
    if source.is_dir():
        files = [source / name for name in PROJECTOR_FILES if (source / name).is_file()]
        if not files:
            raise ValueError(f"{source} holds none of {', '.join(PROJECTOR_FILES)}: not a VideoLLM-online checkpoint")
        source = files[0]
    if source.suffix == ".safetensors":
        return load_safetensors(source)
    return torch.load(source, map_location="cpu", weights_only=True)


def _lora_scale(source: Path) -> float:
    config_file = (source if source.is_dir() else source.parent) / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"the connector of {source} carries a LoRA, but there is no {config_file} to scale it with")
    config = json.loads(config_file.read_text())
    return config["lora_alpha"] / config["r"]


def _initialise_projector(plan: MotePlan, model: VideoLlmMoteForConditionalGeneration, std: float, seed: int) -> None:
    """The projector has no source (spec §5.2): N(0, std) weights and zero biases, from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"model.multi_modal_projector.{name}": (
            torch.zeros(parameter.shape) if name.endswith("bias")
            else torch.randn(parameter.shape, generator=generator) * std
        )
        for name, parameter in model.model.multi_modal_projector.named_parameters()
    }
    plan.initialise(tensors, f"new: N(0, {std}) weights, zero biases, seed {seed}")


# --- measuring the conversion ------------------------------------------------------------------------------------


def synthetic_text_inputs(config: LlamaMoteConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two examples of 8 random tokens."""
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


@torch.no_grad()
def measure_videollm_routes(llm: Path, vision: Path, converted: Path, dtype: torch.dtype) -> dict[str, float]:
    """Two examples with two frames each. The reference runs the source SigLIP, the (shared, new) projector and the
    dense Llama on embeddings; `"vision_tower"` is the difference of the frame tokens. The three models run layer by
    layer (`load_layer_by_layer`), one after the other: the source SigLIP, the converted model (which also gives the
    projector of the source's frame tokens), the dense Llama."""
    config = VideoLlmMoteConfig.from_pretrained(converted)
    inputs = synthetic_video_inputs(config)
    with tempfile.TemporaryDirectory(prefix="mote-verification-") as offload:
        with quiet_libraries():  # the vision tower of a dual encoder: the text tower's keys are unexpected
            reference_vision = load_layer_by_layer(SiglipVisionModel, vision, Path(offload) / "vision", dtype=dtype)
        frames = reference_vision(pixel_values=inputs["pixel_values_videos"].to(dtype))
        del reference_vision
        model = load_layer_by_layer(VideoLlmMoteForConditionalGeneration, converted, Path(offload) / "converted",
                                    dtype=dtype)  # fmt: skip
        reference_tokens = model.model.frame_tokens(frames.last_hidden_state, frames.pooler_output).flatten(0, 1)
        tokens = torch.cat(model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output)
        video_embeds = model.model.multi_modal_projector(reference_tokens)
        logits = route_logits(model, inputs)
        del model
        with quiet_libraries():
            reference_llm = load_layer_by_layer(LlamaForCausalLM, llm, Path(offload) / "llm", dtype=dtype)
        embeds = reference_llm.get_input_embeddings()(inputs["input_ids"])
        embeds = embeds.masked_scatter((inputs["input_ids"] == config.video_token_id)[..., None], video_embeds)
        expected = reference_llm(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
    differences = largest_differences(logits, expected)
    differences["vision_tower"] = float((tokens - reference_tokens).abs().max())
    return differences


def synthetic_video_inputs(config: VideoLlmMoteConfig, frames_per_video: int = 2, seed: int = 0) -> dict:
    """Two examples `text [<v> x frame_num_tokens , <v> x frame_num_tokens] text` with random frames in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    frame = [config.video_token_id] * config.frame_num_tokens
    stream = frame
    for _ in range(frames_per_video - 1):
        stream = [*stream, config.frame_token_interval_id, *frame]
    special = min(config.video_token_id, config.frame_token_interval_id)
    text = torch.randint(0, max(special, 1), (2, 6), generator=generator)
    input_ids = torch.cat([text[:, :3], torch.tensor(stream).expand(2, -1), text[:, 3:]], dim=1)
    size = config.vision_config.image_size
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values_videos": torch.rand(2 * frames_per_video, 3, size, size, generator=generator) * 2 - 1,
        "video_num_frames": torch.tensor([frames_per_video, frames_per_video]),
    }


# --- `moezoo convert --to videollm_mote --from <Llama folder> --vision <SigLIP folder>` -----------------------------


def add_arguments(parser) -> None:
    add_common_arguments(parser, default_experts=",".join(COIN_EXPERTS))
    parser.add_argument("--vision", default=None,
                        help="a FixRes SigLIP 2 folder (e.g. siglip2-large-patch16-384): converts into VideoLLM-MoTE; "
                             "without it, into the text-only LlamaMote")
    parser.add_argument("--projector-from", default=None,
                        help="a VideoLLM-online checkpoint (PEFT folder or file) whose connector becomes the projector "
                             "(default: a new projector)")
    parser.add_argument("--dense", action="store_true",
                        help="the dense baseline in the same class: no task experts (--experts and the expert "
                             "options do not apply)")
    parser.add_argument("--video-token", default=VIDEO_TOKEN, help="the reserved Llama-3 token used as <v>")
    parser.add_argument("--video-token-id", type=int, default=None, help="its id (default: the tokenizer's)")
    parser.add_argument("--frame-token-interval-id", type=int, default=None,
                        help=f"the id of {FRAME_SEPARATOR!r} between frames (default: the tokenizer's)")


def convert(source: Path, **options) -> ConversionResult:
    """The converter behind the command: the model streamed into a temporary folder (a `StreamedModel`, which `moezoo
    convert` moves into its output) with the Llama tokenizer (and its chat template), inside a
    `VideoLlmMoteProcessor` for VideoLLM-MoTE; nothing beside the model when the source has no tokenizer."""
    model, report = stream_llama_to_mote(source, **options)
    tokenizer = source_tokenizer(Path(source))
    if tokenizer is not None and model.model_class is VideoLlmMoteForConditionalGeneration:
        return ConversionResult(model, make_videollm_mote_processor(model.config, tokenizer), report)
    return ConversionResult(model, tokenizer, report)
