"""A Qwen3 language model and a SigLIP / SigLIP2 vision tower -> OmniMoE-VL, upcycled and streamed (spec omnimoe_vl.md
§5).

Vision (`siglip`: `SiglipModel` or `SiglipVisionModel`; `siglip2`: NaFlex `Siglip2Model` / `Siglip2VisionModel`):
    - blocks up to the last tap are kept (spec D23); later blocks, `post_layernorm`, the pooling head, the text tower
      and `logit_scale` / `logit_bias` are dropped (each reported with its reason);
    - the MLP of every block in `moe_layers` becomes `num_experts` copies (`experts.up_proj (E, I, D)`,
      `up_proj_bias`, `down_proj (E, D, I)`, `down_proj_bias`) and a new router N(0, 0.02);
    - a NaFlex patch embedding `Linear(C p p, D)` on channel-last patches becomes SigLIP's `Conv2d(C, D, p)`; the
      fixed grid is the source's position-embedding grid (`num_patches`).
Language (`qwen3`, `Qwen3ForCausalLM`):
    - the MLP of every MoE layer (even layers) becomes `num_experts` copies in transformers' fused layout
      (`experts.gate_up_proj (E, 2I, H)` gate rows first, `experts.down_proj (E, H, I)`) and a new router N(0, 0.02);
      routing is top-2 renormalised, so at initialisation each MoE layer equals the dense MLP;
    - everything else is copied under `model.language_model.` (`lm_head.weight` as is).
Projector: new, initialised as `OmniMoeVlForConditionalGeneration._init_weights` does (spec §5.2) with `seed`, its
fusion output scale set to the mean row RMS of `embed_tokens` (spec D15), and the injection gates at 0: right after
conversion the model is the LLaVA-style composition of the sources (invariants C1-C3 of spec §5.3).

Memory: sources are read shard by shard and the output written shard by shard; the plan is checked on the `meta`
device from the shard headers before any data is read (`moezoo.conversion.streaming`). The verification runs the
sources and the converted model one after the other, each layer by layer (`streaming.load_layer_by_layer`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, Qwen3ForCausalLM, SiglipVisionModel
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.omnimoe_vl import OmniMoeVlConfig
from ..modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from ..processors.build_omnimoe_vl import conversion_processor
from ..processors.qwen_tokens import IMAGE_TOKEN, VISION_END, VISION_START
from ..terminal import quiet_libraries
from .common import ConversionResult, local_source, option_name, source_tokenizer
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, output_dtype
from .streaming import (
    ShardWriter,
    SourceCheckpoint,
    StreamedModel,
    TensorGroup,
    check_plan,
    copy_as,
    load_layer_by_layer,
    stream_groups,
)


TEXT_SOURCE_TYPES = ("qwen3",)
VISION_SOURCE_TYPES = ("siglip", "siglip_vision_model", "siglip2", "siglip2_vision_model")
ROUTER_INIT_STD = 0.02
LICENSE = "apache-2.0"  # Qwen3 and SigLIP / SigLIP2 are both Apache-2.0
TARGET = "OmniMoE-VL"
_VISION_LAYER = re.compile(r"(?:vision_model\.)?encoder\.layers\.(\d+)\.(.+)")
_VISION_DROPPED = {
    "text tower": (re.compile(r"text_model\..+|logit_scale|logit_bias"), "the contrastive text tower and logit scale"),
    "pooling head": (re.compile(r"(?:vision_model\.)?head\..+"), "the attention-pooling head: the streams are patches"),
    "post-layernorm": (re.compile(r"(?:vision_model\.)?post_layernorm\..+"),
                       "the final norm: streams are intermediate hidden states (spec D23)"),
}
_TEXT_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
EMBED_TOKENS = "model.embed_tokens.weight"
# The vision token ids' options and the Qwen3 tokens they default to.
VISION_TOKENS = {"image_token_id": IMAGE_TOKEN, "vision_start_token_id": VISION_START,
                 "vision_end_token_id": VISION_END}


def convert_omnimoe_vl_checkpoints(
    text_source: str | Path,
    vision_source: str | Path,
    output: str | Path,
    *,
    vision_feature_layers: list[int] | None = None,
    injection_layers: list[int] | None = None,
    projector: dict | None = None,
    num_experts: int = 8,
    text_top_k: int = 2,
    vision_top_k: int = 1,
    image_token_id: int | None = None,
    vision_start_token_id: int | None = None,
    vision_end_token_id: int | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    seed: int = 0,
) -> dict:
    """Convert a Qwen3 folder and a SigLIP / SigLIP2 folder (config.json + safetensors each) into an OmniMoE-VL
    folder at `output` (which must be new or empty).

    Args:
        vision_feature_layers: the stream taps (indices into the vision hidden states, 1-based block outputs);
            default the paper's blocks 1, 5, ..., 37, which needs a tower of at least 37 blocks.
        injection_layers: the anchor layer of each stream (default 0, 1, ..., S - 1).
        projector: other `OmniMoeVlConfig` fields (query, routing, fusion, injection and projector sizes).
        num_experts / text_top_k / vision_top_k: experts per MoE block and per-token top-k of each stack.
        image_token_id / vision_start_token_id / vision_end_token_id: default the ids of `<|image_pad|>`,
            `<|vision_start|>`, `<|vision_end|>` in the Qwen3 source's tokenizer (an error names the option when the
            source has no tokenizer, or its tokenizer not the token).
        dtype: `"float32"`, `"bfloat16"` or `"float16"` for every output tensor (default: the Qwen3 source's).
        seed: seeds the new routers and the projector.

    Returns:
        A report: sources, the config choices, key accounting (copied, upcycled, converted, new, dropped by reason).

    Raises:
        ValueError: a source of another family (or an already-MoE Qwen3), a tower that cannot feed the taps, missing or
            unexpected tensors (named), bad options; nothing is written then.
    """
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} is not empty: convert into a new or empty folder")
    text, vision, config = _sources_and_config(
        text_source, vision_source, vision_feature_layers=vision_feature_layers, injection_layers=injection_layers,
        projector=projector, num_experts=num_experts, text_top_k=text_top_k, vision_top_k=vision_top_k,
        image_token_id=image_token_id, vision_start_token_id=vision_start_token_id,
        vision_end_token_id=vision_end_token_id,
    )
    dtype = output_dtype(dtype, text.folder)
    groups, dropped = _plan(text, vision, config, seed)
    with torch.device("meta"):
        expected = {key: tuple(value.shape)
                    for key, value in OmniMoeVlForConditionalGeneration(config).state_dict().items()}
    check_plan([text, vision], groups, [key for keys in dropped.values() for key in keys], expected, TARGET)

    output.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(output, convert_file_size_to_int(max_shard_size), dtype)
    for key, tensor in stream_groups([text, vision], groups):
        writer.add(key, tensor)
    writer.finish()
    config.architectures = [OmniMoeVlForConditionalGeneration.__name__]
    config.dtype = dtype
    config.save_pretrained(output)
    if (text.folder / "generation_config.json").is_file():
        shutil.copy2(text.folder / "generation_config.json", output / "generation_config.json")

    text_mlp = sum(1 for key in text.shapes if _TEXT_MLP.fullmatch(key) and config.text_config.is_moe_layer(
        int(_TEXT_MLP.fullmatch(key)[1])))
    vision_mlp = sum(1 for key in vision.shapes if (match := _VISION_LAYER.fullmatch(key)) and match[2].startswith(
        "mlp.") and int(match[1]) in config.vision_config.moe_layers)
    all_dropped = sum(len(keys) for keys in dropped.values())
    return {
        "source": str(text_source),
        "vision_source": str(vision_source),
        "source_model_types": {"text": text.model_type, "vision": vision.model_type},
        "dtype": str(dtype).removeprefix("torch."),
        "license": LICENSE,
        "vision_feature_layers": config.vision_feature_layers,
        "injection_layers": config.injection_layers,
        "vision_layers_kept": config.vision_config.num_hidden_layers,
        "key_accounting": {
            "source_tensors": len(text.shapes) + len(vision.shapes),
            "copied": len(text.shapes) + len(vision.shapes) - all_dropped - text_mlp - vision_mlp,
            "upcycled_into_experts": text_mlp + vision_mlp,
            "dropped": {name: {"tensors": len(keys), "reason": _DROP_REASONS[name]}
                        for name, keys in dropped.items() if keys},
            "written": writer.num_tensors,
        },
        "new_parameters": "projector (spec §5.2), expert routers N(0, 0.02), seed " + str(seed),
    }


# --- the sources -----------------------------------------------------------------------------------------------------


def _sources_and_config(text_source, vision_source, vision_feature_layers=None, injection_layers=None, projector=None,
                        num_experts=8, text_top_k=2, vision_top_k=1, image_token_id=None, vision_start_token_id=None,
                        vision_end_token_id=None, **_other_options):  # fmt: skip
    """Both sources' headers, checked, and the OmniMoE-VL config they convert into (no weight read); `projector` is a
    dict or the command's `(field, value)` pairs, and options that do not shape the config are ignored."""
    text = SourceCheckpoint(Path(text_source), "the language source")
    vision = SourceCheckpoint(Path(vision_source), "the vision source")
    _check_text_source(text)
    _check_vision_source(vision)
    config = _omnimoe_vl_config(
        text, vision, vision_feature_layers, injection_layers, dict(projector or {}), num_experts, text_top_k,
        vision_top_k, image_token_id, vision_start_token_id, vision_end_token_id,
    )
    return text, vision, config


def plan_output(source: Path, vision: str | Path, **options) -> PlannedOutput:
    """What `convert` writes, from the sources' configs, tokenizer and safetensors headers alone (`moezoo convert
    --dry-run`, and the disk-space check before a conversion)."""
    text, vision, config = _sources_and_config(source, local_source(vision), **options)
    return PlannedOutput(config, (text.folder, vision.folder))


def _check_text_source(text: SourceCheckpoint) -> None:
    if text.model_type == "qwen3":
        if text.config.get("use_sliding_window"):
            raise ValueError(
                f"the language source {text.folder} uses sliding-window attention (use_sliding_window=true), which "
                "OmniMoE-VL's language model does not implement; convert a full-attention Qwen3 checkpoint"
            )
        return
    if text.model_type in ("qwen3_moe", "qwen3_vl_moe"):
        raise ValueError(
            f"the language source {text.folder} is already a mixture of experts ({text.model_type!r}): OmniMoE-VL "
            "upcycles a dense Qwen3 (model_type 'qwen3', e.g. Qwen/Qwen3-8B)"
        )
    raise ValueError(
        f"the language source {text.folder} is a {text.model_type!r} checkpoint; OmniMoE-VL converts a dense Qwen3 "
        "language model (model_type 'qwen3', e.g. Qwen/Qwen3-8B) with --from"
    )


def _check_vision_source(vision: SourceCheckpoint) -> None:
    if vision.model_type not in VISION_SOURCE_TYPES:
        raise ValueError(
            f"the vision source {vision.folder} is a {vision.model_type!r} checkpoint; OmniMoE-VL takes a SigLIP "
            f"or SigLIP2 vision tower ({', '.join(VISION_SOURCE_TYPES)}, e.g. google/siglip2-giant-opt-patch16-384) "
            "with --vision"
        )


def _vision_source_config(vision: SourceCheckpoint):
    config = AutoConfig.from_pretrained(vision.folder)
    return config.vision_config if vision.model_type in ("siglip", "siglip2") else config


def _is_naflex(vision: SourceCheckpoint) -> bool:
    return vision.model_type.startswith("siglip2")


def _omnimoe_vl_config(text, vision, taps, anchors, projector, num_experts, text_top_k, vision_top_k, image_token_id,
                       vision_start_token_id, vision_end_token_id) -> OmniMoeVlConfig:
    source_text = AutoConfig.from_pretrained(text.folder)
    source_vision = _vision_source_config(vision)
    num_vision_layers = source_vision.num_hidden_layers
    taps = list(range(1, 38, 4)) if taps is None else list(taps)
    if not taps or max(taps) > num_vision_layers or min(taps) < 1:
        raise ValueError(
            f"{option_name('vision_feature_layers', taps)} must tap block outputs 1..{num_vision_layers} of the vision "
            f"source ({vision.folder} has {num_vision_layers} blocks); choose taps within the tower"
        )
    if _is_naflex(vision):
        side = math.isqrt(source_vision.num_patches)
        if side * side != source_vision.num_patches:
            raise ValueError(
                f"the SigLIP2 vision source has num_patches={source_vision.num_patches}, not a square grid: its "
                "position embeddings cannot serve a fixed-resolution tower"
            )
        image_size = side * source_vision.patch_size
    else:
        image_size = source_vision.image_size
    vision_config = dict(
        hidden_size=source_vision.hidden_size, intermediate_size=source_vision.intermediate_size,
        num_hidden_layers=max(taps), num_attention_heads=source_vision.num_attention_heads,
        num_channels=source_vision.num_channels, image_size=image_size, patch_size=source_vision.patch_size,
        hidden_act=source_vision.hidden_act, layer_norm_eps=source_vision.layer_norm_eps,
        attention_dropout=source_vision.attention_dropout, num_experts=num_experts,
        num_experts_per_tok=vision_top_k, top1_straight_through=vision_top_k == 1,
    )
    layers = source_text.num_hidden_layers
    text_config = dict(
        vocab_size=source_text.vocab_size, hidden_size=source_text.hidden_size,
        intermediate_size=source_text.intermediate_size, moe_intermediate_size=source_text.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=source_text.num_attention_heads,
        num_key_value_heads=source_text.num_key_value_heads, head_dim=source_text.head_dim,
        hidden_act=source_text.hidden_act, max_position_embeddings=source_text.max_position_embeddings,
        rms_norm_eps=source_text.rms_norm_eps, rope_parameters=dict(source_text.rope_parameters),
        attention_bias=source_text.attention_bias, attention_dropout=source_text.attention_dropout,
        tie_word_embeddings=source_text.tie_word_embeddings, pad_token_id=source_text.pad_token_id,
        bos_token_id=source_text.bos_token_id, eos_token_id=source_text.eos_token_id,
        num_experts=num_experts, num_experts_per_tok=text_top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=list(range(1, layers, 2)),
    )
    tokens = _vision_token_ids(text.folder, {"image_token_id": image_token_id,
                                             "vision_start_token_id": vision_start_token_id,
                                             "vision_end_token_id": vision_end_token_id})
    own_options = {"vision_config", "text_config", "vision_feature_layers", "injection_layers", *tokens}
    clashes = set(projector) & own_options
    if clashes:
        raise ValueError(f"projector options may not set {sorted(clashes)}: they have options of their own")
    return OmniMoeVlConfig(
        vision_config=vision_config, text_config=text_config, vision_feature_layers=taps,
        injection_layers=list(range(len(taps))) if anchors is None else list(anchors),
        tie_word_embeddings=source_text.tie_word_embeddings, **tokens, **projector,
    )


def _vision_token_ids(folder: Path, given: dict[str, int | None]) -> dict[str, int]:
    """The vision token ids: as given, else those of the Qwen3 source's tokenizer, whose vocabulary the converted
    model keeps (the released Qwen3's ids would not fit a smaller or reordered vocabulary)."""
    missing = [name for name, value in given.items() if value is None]
    tokenizer = source_tokenizer(folder) if missing else None
    ids = dict(given)
    for name in missing:
        token = VISION_TOKENS[name]
        token_id = None if tokenizer is None else tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            lacking = "has no tokenizer" if tokenizer is None else f"has no {token} in its tokenizer"
            raise ValueError(
                f"the language source {folder} {lacking} to take the id of {token} from: pass {option_name(name)}, "
                "the id the model's tokenizer gives it"
            )
        ids[name] = token_id
    return ids


# --- the plan --------------------------------------------------------------------------------------------------------


_DROP_REASONS = {
    **{name: reason for name, (_, reason) in _VISION_DROPPED.items()},
    "vision blocks after the last tap": "blocks whose output no stream reads (spec D23)",
}


def _plan(text: SourceCheckpoint, vision: SourceCheckpoint, config: OmniMoeVlConfig, seed: int):
    """Groups covering every kept source tensor, and the dropped tensors by kind."""
    groups: list[TensorGroup] = []
    dropped: dict[str, list[str]] = {name: [] for name in _DROP_REASONS}
    text_config, vision_config = config.text_config, config.vision_config
    dense_mlps: dict[int, list[str]] = {}
    for key in text.shapes:
        match = _TEXT_MLP.fullmatch(key)
        if match and text_config.is_moe_layer(int(match[1])):
            dense_mlps.setdefault(int(match[1]), []).append(key)
        elif key == EMBED_TOKENS:
            groups.append(TensorGroup((key,), _embedding_and_fusion_scale))
        else:
            groups.append(copy_as(key, key if key.startswith("lm_head.") else "model.language_model." + key[6:]))
    for layer, keys in sorted(dense_mlps.items()):
        prefix = f"model.layers.{layer}.mlp"
        sources = tuple(f"{prefix}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj"))
        if set(keys) != set(sources):
            raise ValueError(f"the language source's MLP {prefix} lacks {sorted(set(sources) - set(keys))}")
        groups.append(TensorGroup(sources, _upcycled_swiglu(prefix, layer, text_config, seed)))

    vision_mlps: dict[int, str] = {}  # MoE block -> its source MLP's prefix
    for key in vision.shapes:
        kind = next((name for name, (pattern, _) in _VISION_DROPPED.items() if pattern.fullmatch(key)), None)
        match = _VISION_LAYER.fullmatch(key)
        if kind is not None:
            dropped[kind].append(key)
        elif match and int(match[1]) >= vision_config.num_hidden_layers:
            dropped["vision blocks after the last tap"].append(key)
        elif match and int(match[1]) in vision_config.moe_layers and match[2].startswith("mlp."):
            vision_mlps[int(match[1])] = key[: key.index(".mlp.")] + ".mlp"
        else:
            target = "model.vision_tower." + key.removeprefix("vision_model.")
            if key.endswith("embeddings.patch_embedding.weight") and _is_naflex(vision):
                groups.append(TensorGroup((key,), _naflex_patch_embedding(key, target, vision_config)))
            else:
                groups.append(copy_as(key, target))
    for layer, prefix in sorted(vision_mlps.items()):
        sources = tuple(f"{prefix}.{name}" for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
        groups.append(TensorGroup(sources, _upcycled_gelu(prefix, layer, vision_config, seed)))
    groups.append(TensorGroup((), _new_projector(config, seed)))
    return groups, dropped


def _embedding_and_fusion_scale(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The embedding matrix, and the projector's output scale: the mean row RMS of the embeddings, so that image
    tokens start at the scale of text tokens (spec D15)."""
    weight = tensors[EMBED_TOKENS]
    if device == "meta":
        scale = torch.empty((), device="meta")
    else:
        scale = weight.float().square().mean(dim=-1).sqrt().mean()
    return {"model.language_model.embed_tokens.weight": weight, "model.projector.fusion_output_scale": scale}


def _router(num_experts: int, hidden_size: int, seed: int, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(num_experts, hidden_size, device="meta")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, hidden_size, generator=generator) * ROUTER_INIT_STD


def _upcycled_swiglu(prefix: str, layer: int, config, seed: int):
    target = "model.language_model." + prefix[6:]

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        gate, up, down = (tensors[f"{prefix}.{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj"))
        experts = config.num_experts
        return {
            f"{target}.experts.gate_up_proj": torch.cat([gate, up])[None].repeat(experts, 1, 1),
            f"{target}.experts.down_proj": down[None].repeat(experts, 1, 1),
            f"{target}.gate.weight": _router(experts, config.hidden_size, seed + layer, device).to(gate.dtype),
        }

    return build


def _upcycled_gelu(source_prefix: str, layer: int, config, seed: int):
    target = f"model.vision_tower.encoder.layers.{layer}.mlp"

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        def expand(name: str) -> torch.Tensor:
            tensor = tensors[f"{source_prefix}.{name}"]
            return tensor[None].repeat(config.num_experts, *([1] * tensor.ndim))

        # Vision routers are seeded apart from the language ones (1000 + layer: towers have fewer layers).
        router = _router(config.num_experts, config.hidden_size, seed + 1000 + layer, device)
        return {
            f"{target}.experts.up_proj": expand("fc1.weight"),
            f"{target}.experts.up_proj_bias": expand("fc1.bias"),
            f"{target}.experts.down_proj": expand("fc2.weight"),
            f"{target}.experts.down_proj_bias": expand("fc2.bias"),
            f"{target}.gate.weight": router.to(tensors[f"{source_prefix}.fc1.weight"].dtype),
        }

    return build


def _naflex_patch_embedding(key: str, target: str, config):
    """SigLIP2's `Linear(C p p, D)` on patches flattened channel-last (p, p, C) -> `Conv2d(C, D, p, p)`."""
    patch, channels = config.patch_size, config.num_channels

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        weight = tensors[key]
        return {target: weight.reshape(weight.shape[0], patch, patch, channels).permute(0, 3, 1, 2)}

    return build


def _new_projector(config: OmniMoeVlConfig, seed: int):
    """The projector's parameters and buffers initialised by the model's own `_init_weights` (spec §5.2), except the
    fusion output scale, which comes from the embeddings."""

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = OmniMoeVlForConditionalGeneration(config)
        projector = model.model.projector
        if device != "meta":
            projector.to_empty(device=device)
            torch.manual_seed(seed)
            for module in projector.modules():
                model._init_weights(module)
        return {f"model.projector.{key}": value for key, value in projector.state_dict().items()
                if key != "fusion_output_scale"}

    return build


# --- fidelity against the sources ------------------------------------------------------------------------------------


@torch.no_grad()
def measure_differences(
    text_source: str | Path, vision_source: str | Path, converted: str | Path, seed: int = 0
) -> dict[str, float]:
    """Invariants C1 and C2 of spec §5.3, in fp32 with eager experts: text-only logits against `Qwen3ForCausalLM`, and
    the visual streams against the source tower's hidden states at the taps. The sources and the converted folder run
    one after the other, each layer by layer (`load_layer_by_layer`), so the memory this takes does not grow with the
    depth."""
    config = OmniMoeVlConfig.from_pretrained(converted)
    generator = torch.Generator().manual_seed(seed)
    vocab_size = min(config.text_config.vocab_size, config.image_token_id)  # text tokens only
    input_ids = torch.randint(0, vocab_size, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    real = attention_mask.bool()
    vision = config.vision_config
    pixel_values = torch.randn(2, vision.num_channels, vision.image_size, vision.image_size, generator=generator)
    with tempfile.TemporaryDirectory(prefix="omnimoe-vl-verification-") as offload:
        reference_text = load_layer_by_layer(Qwen3ForCausalLM, text_source, Path(offload) / "text",
                                             dtype=torch.float32)  # fmt: skip
        expected = reference_text(input_ids=input_ids, attention_mask=attention_mask).logits
        del reference_text
        reference_streams = _source_vision_streams(Path(vision_source), pixel_values, config, Path(offload) / "vision")
        model = load_layer_by_layer(OmniMoeVlForConditionalGeneration, converted, Path(offload) / "converted",
                                    dtype=torch.float32)  # fmt: skip
        model.set_experts_implementation("eager")
        got = model(input_ids=input_ids, attention_mask=attention_mask).logits
        streams = model.model.visual_streams(model.model.get_image_features(pixel_values))
    return {
        "text_logits": float((got[real] - expected[real]).abs().max()),
        "vision_streams": float((streams - reference_streams).abs().max()),
    }


def _source_vision_streams(folder: Path, pixel_values: torch.Tensor, config: OmniMoeVlConfig, offload: Path
                           ) -> torch.Tensor:  # fmt: skip
    """The source tower's hidden states at the taps (B, S, N, d_V): SigLIP on the image, SigLIP2 on its patches; the
    tower runs layer by layer, its weights offloaded under `offload`."""
    model_type = SourceCheckpoint(folder, "the vision source").model_type
    taps = config.vision_feature_layers
    if model_type.startswith("siglip2"):
        from transformers import Siglip2VisionModel

        model = load_layer_by_layer(Siglip2VisionModel, folder, offload, dtype=torch.float32)
        patches, mask, shapes = naflex_patches(pixel_values, config.vision_config.patch_size)
        outputs = model(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes,
                        output_hidden_states=True)
    else:
        with quiet_libraries():  # the vision tower of a dual encoder: the text tower's keys are unexpected
            model = load_layer_by_layer(SiglipVisionModel, folder, offload, dtype=torch.float32)
        outputs = model(pixel_values=pixel_values, output_hidden_states=True)
    return torch.stack([outputs.hidden_states[index] for index in taps], dim=1)


def naflex_patches(pixel_values: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images (B, C, H, W) -> SigLIP2's NaFlex inputs: patches flattened channel-last (B, N, p p C) in raster order,
    an all-ones patch mask and the grid shapes (B, 2)."""
    batch, channels, height, width = pixel_values.shape
    rows, columns = height // patch, width // patch
    patches = pixel_values.reshape(batch, channels, rows, patch, columns, patch).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(batch, rows * columns, patch * patch * channels)
    mask = torch.ones(batch, rows * columns, dtype=torch.long)
    return patches, mask, torch.tensor([[rows, columns]] * batch)


# --- `moezoo convert --to omnimoe_vl --from <qwen3> --vision <siglip or siglip2> --out DIR` ---------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--vision", required=True, help="the SigLIP / SigLIP2 vision checkpoint (folder or Hub id)")
    parser.add_argument("--vision-feature-layers", type=_int_list, default=None,
                        help="stream taps, comma-separated hidden-state indices (default 1,5,...,37)")
    parser.add_argument("--num-experts", type=int, default=8, help="experts per MoE block of both stacks")
    for name, token in (("image", "<|image_pad|>"), ("vision-start", "<|vision_start|>"),
                        ("vision-end", "<|vision_end|>")):
        parser.add_argument(f"--{name}-token-id", type=int, default=None,
                            help=f"default: the id of {token} in the Qwen3 source's tokenizer")
    parser.add_argument("--projector", type=_projector_option, action="append", default=None, metavar="FIELD=VALUE",
                        help="an OmniMoeVlConfig field of the projector, e.g. depth_top_k=2 (JSON values; repeatable)")
    add_dtype_argument(parser)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--seed", type=int, default=0, help="seeds the new routers and the projector")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip loading both sources in fp32 to measure max |Δ|")


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def _projector_option(text: str) -> tuple[str, object]:
    field, separator, value = text.partition("=")
    if not separator or not field:
        raise argparse.ArgumentTypeError(f"--projector takes FIELD=VALUE, e.g. depth_top_k=2, got {text!r}")
    try:
        return field.strip(), json.loads(value)
    except json.JSONDecodeError:
        return field.strip(), value  # a bare string, e.g. injection_type=none


def convert(source: Path, vision: str | Path, verify: bool = True, **options) -> ConversionResult:
    """The converter behind the command: stream the conversion into a temporary folder (the result's `StreamedModel`,
    which `moezoo convert` moves into its output) and measure it against the sources, each model run layer by
    layer."""
    vision_source = local_source(vision)
    if isinstance(options.get("projector"), list):  # the command's repeated --projector FIELD=VALUE
        options["projector"] = dict(options["projector"])
    model = StreamedModel(OmniMoeVlForConditionalGeneration, "omnimoe-vl-conversion-")
    report = convert_omnimoe_vl_checkpoints(source, vision_source, model.folder, **options)
    # Before the measurement: a tokenizer that does not fit the config fails fast.
    processor = conversion_processor(model.config, Path(source), Path(vision_source))
    differences = measure_differences(source, vision_source, model.folder) if verify else None
    report |= {
        "base_model": str(source),
        "max_abs_diff": None if differences is None else max(differences.values()),
        "max_abs_diff_by_output": differences,
        "notes": [
            "max_abs_diff compares text-only logits with Qwen3ForCausalLM and the visual streams with the source "
            "tower's hidden states, in fp32 with eager experts; the projector is new (no source to compare).",
        ],
    }
    return ConversionResult(model=model, processor=processor, provenance=report)
