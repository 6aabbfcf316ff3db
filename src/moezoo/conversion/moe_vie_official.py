"""Official MoE-ViE OpenCLIP checkpoints -> `MoeVieModel`, exactly (spec moe_vie.md §6.1).

The official release (`facebook/MoEViE-{B16-224, L16-384, H14-448}`, CC BY-NC 4.0) is an OpenCLIP state dict in a
`.pt` file, possibly wrapped in `{"state_dict": ...}` and with `module.` prefixes. It is read with
`torch.load(weights_only=True)` only. Every step of the key map is a pure reshape (fused `in_proj` split into
q/k/v, conv patch embedding flattened to a linear one in (py, px, c) order, projections transposed), so the
converted model computes the official forward up to float reassociation.

Memory: a pickle cannot be read tensor by tensor the way safetensors can, but the zipfile format `torch.save` writes
can be memory-mapped (`torch.load(mmap=True, weights_only=True)`): the tensors stay in the file (the page cache's,
reclaimable, not the process's) until each is written, so `moezoo convert` holds one output shard in the output dtype
plus the few small tensors the key map transposes (projections, patch embedding), whatever the depth. There is no
source model to verify against (the official forward is not run here; see `max_abs_diff` in the report).

The configuration is inferred from the tensor shapes. What shapes cannot tell (text and pooling heads, the routed
top-k, the image size) comes from the official OpenCLIP model config when one is given or lies beside the
checkpoint (`open_clip_config.json` or `<checkpoint name>.json`), else from the matching released configuration
(`OFFICIAL_MOE_VIE_CONFIGS`); either way every value is cross-checked against the shapes.

The OpenCLIP model-config keys read (the format of `open_clip/model_configs/*.json`, optionally wrapped as
`{"model_cfg": ...}` like OpenCLIP's Hub configs): `embed_dim`; `vision_cfg.{width, layers, heads, patch_size,
image_size, attn_pooler_heads, num_of_expert, split, k, moe_layers, use_ln_pre, use_ln_post, rope_theta}`;
`text_cfg.{width, layers, heads, context_length, vocab_size, use_ln_post}`. The routed top-k is `k * split` minus the
number of shared experts (`k = 1` for B and L, 2 for H, with one shared expert: spec §2.1).
"""

import json
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers.initialization import no_init_weights
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.moe_vie import OFFICIAL_MOE_VIE_CONFIGS, MoeVieConfig
from ..modeling.moe.accounting import count_parameters
from ..modeling.moe_vie import MoeVieModel, rope_2d_inverse_frequencies
from ..hub.sources import TOKENIZER_FILES, locate
from ..processors.build import CLIP_TOKENIZER_REPO, load_clip_tokenizer, make_moe_vie_processor
from .common import ConversionResult, option_name
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, cast_model, checkpoint_tensors, load_checked, output_dtype, saved_tensors
from .streaming import ShardWriter, StreamedModel


LICENSE = "cc-by-nc-4.0"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin")
OPEN_CLIP_CONFIG_NAME = "open_clip_config.json"
# The official preprocessing (spec §7, §11 item 14), recorded for the processor and the model card.
PREPROCESSING = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": "bicubic"}

Transform = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def convert_official_checkpoint(
    path: str | Path,
    open_clip_config: str | Path | Mapping | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[MoeVieModel, dict]:
    """Convert an official MoE-ViE checkpoint (a `.pt` file, or a folder holding one) into a `MoeVieModel` in memory
    (for tests and small models; `convert` streams the conversion into a folder, see `write_official_checkpoint`).

    Args:
        path: the checkpoint file, or a folder with exactly one `.pt`/`.pth`/`.bin` file.
        open_clip_config: the official OpenCLIP model config (a JSON file or its parsed dict); by default
            `open_clip_config.json` or `<checkpoint name>.json` beside the checkpoint, if there is one. Needed only
            for checkpoints whose shapes match none of the released configurations.
        dtype: the dtype of the returned model (default: the checkpoint's); the balancing biases stay fp32 whatever
            it is.

    Returns:
        The model in eval mode, and a report: the source, the configuration's origin, the key accounting
        (converted, dropped after a check, unexpected), parameter counts, preprocessing and licence.

    Raises:
        ValueError: the file is not a readable weights-only checkpoint, is not a MoE-ViE checkpoint, lacks tensors,
            or has tensors that disagree with each other or with the given config.
    """
    conversion = _OfficialConversion(Path(path), open_clip_config, dtype)
    with no_init_weights():
        model = cast_model(MoeVieModel(conversion.config), conversion.dtype, check=False)
    load_checked(model, conversion.hf_state_dict, strict=True)
    return model.eval(), conversion.report()


def write_official_checkpoint(
    path: str | Path,
    output: str | Path,
    open_clip_config: str | Path | Mapping | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> dict:
    """`convert_official_checkpoint` streamed into the folder `output` (config.json and safetensors shards of at most
    `max_shard_size`), the model never built: the checkpoint is memory-mapped (`torch.load(mmap=True)`), so its
    tensors are read from the file as each is written, and the conversion holds one output shard (in the output
    dtype) and the few tensors the key map transposes or reshapes. Returns the report."""
    conversion = _OfficialConversion(Path(path), open_clip_config, dtype)
    with torch.device("meta"):
        skeleton = MoeVieModel(conversion.config)
    kept_in_float32 = {name for name, _, float32_kept in saved_tensors(skeleton) if float32_kept}
    writer = ShardWriter(Path(output), convert_file_size_to_int(max_shard_size), conversion.dtype)
    for key, tensor in conversion.hf_state_dict.items():
        writer.add(key, tensor, cast=key not in kept_in_float32)
    writer.finish()
    config = conversion.config
    config.architectures = [MoeVieModel.__name__]
    config.dtype = conversion.dtype
    config.save_pretrained(output)
    return conversion.report()


class _OfficialConversion:
    """An official checkpoint memory-mapped, its configuration, and its tensors under the `MoeVieModel` names (views
    of the mapped file where the key map only renames or splits)."""

    def __init__(self, path: Path, open_clip_config: str | Path | Mapping | None, dtype: str | torch.dtype | None):
        self.checkpoint_file = _checkpoint_file(path)
        self.open_clip_config, model_cfg = _open_clip_config_of(self.checkpoint_file, open_clip_config)
        state_dict = load_official_state_dict(self.checkpoint_file)
        self.config, self.config_origin = infer_official_config(state_dict, model_cfg)
        self.hf_state_dict, self.accounting = convert_state_dict(state_dict, self.config)
        self.dtype = output_dtype(dtype, self.checkpoint_file)

    def report(self) -> dict:
        with torch.device("meta"):
            model = MoeVieModel(self.config)
        vision = count_parameters(model.vision_model)
        config_origin = self.config_origin
        return {
            "source": str(self.checkpoint_file),
            "source_format": "official MoE-ViE OpenCLIP state dict, read with torch.load(weights_only=True, mmap=True)",
            "base_model": f"facebook/{config_origin}" if config_origin in OFFICIAL_MOE_VIE_CONFIGS else None,
            "config_origin": config_origin,
            "open_clip_config": (str(self.open_clip_config) if isinstance(self.open_clip_config, (str, Path))
                                 else None),  # fmt: skip
            "license": LICENSE,
            "license_name": "CC BY-NC 4.0",
            "dtype": str(self.dtype).removeprefix("torch."),
            "key_accounting": self.accounting,
            "parameters": {
                "total": sum(p.numel() for p in model.parameters()),
                "vision_total": vision.total,
                "vision_active": vision.active,
            },
            "image_size": self.config.vision_config.image_size,
            **PREPROCESSING,
            # The official forward cannot run here; the key map is a pure reshape and the tests check a converted
            # checkpoint against an independent reference forward of the official model (<= 1e-5 in fp32).
            "max_abs_diff": None,
            "notes": [
                "Router logits are computed in fp32; the official code runs the router under bf16 autocast, so "
                "near-tied top-k choices may differ in bf16 (spec §11, item 20).",
                "The text tower pools the first EOS token; for CLIP's tokenizer this is the official "
                "argmax(input_ids).",
            ],
        }


def _open_clip_config_of(checkpoint_file: Path, open_clip_config: str | Path | Mapping | None):
    """The OpenCLIP config given, or found beside the checkpoint (None without one), and its parsed content."""
    if open_clip_config is None:
        beside = [checkpoint_file.with_name(OPEN_CLIP_CONFIG_NAME), checkpoint_file.with_suffix(".json")]
        open_clip_config = next((candidate for candidate in beside if candidate.is_file()), None)
    return open_clip_config, _read_open_clip_config(open_clip_config) if open_clip_config is not None else None


def plan_output(source: Path, open_clip_config: str | None = None, **_other_options) -> PlannedOutput:
    """What `convert` writes, from the checkpoint's tensor shapes alone (`torch.load(mmap=True)` reads no tensor data):
    `moezoo convert --dry-run` and the disk-space check."""
    checkpoint_file = _checkpoint_file(Path(source))
    _, model_cfg = _open_clip_config_of(checkpoint_file, open_clip_config)
    shapes = {key.removeprefix("module."): torch.empty(header.shape, dtype=header.dtype, device="meta")
              for key, header in checkpoint_tensors(checkpoint_file).items()}  # fmt: skip
    config, _ = infer_official_config(shapes, model_cfg)
    return PlannedOutput(config, (checkpoint_file,))


def load_official_state_dict(checkpoint_file: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an OpenCLIP checkpoint file, unwrapped from `{"state_dict": ...}` and `module.` prefixes, mapped
    from the file (`torch.load(mmap=True)`): a tensor's bytes are read when it is used, and belong to the page cache,
    not to the process."""
    try:
        loaded = torch.load(checkpoint_file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise ValueError(
            f"{checkpoint_file} is not a readable PyTorch checkpoint for torch.load(weights_only=True, mmap=True) "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); a corrupt or truncated "
            "download, a pickle with arbitrary objects (which is never loaded), or the legacy (pre-1.6) format, which "
            "cannot be mapped: re-save it with torch.save"
        ) from error
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{checkpoint_file} holds a {type(loaded).__name__}, not a state dict of tensors")
    not_tensors = [key for key, value in loaded.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"{checkpoint_file} is not a state dict: entries {not_tensors[:5]} are not tensors")
    return {key.removeprefix("module."): value for key, value in loaded.items()}


def infer_official_config(
    state_dict: Mapping[str, torch.Tensor], open_clip_config: Mapping | None = None
) -> tuple[MoeVieConfig, str]:
    """The `MoeVieConfig` of an official state dict (tensors on any device, `meta` included), and the name of the
    released configuration it equals (`"MoEViE-B16-224"`, ...) or `"open_clip_config"` for another one."""
    _require_moe_vie(state_dict)
    derived = _config_from_shapes(state_dict)
    if open_clip_config is not None:
        model_cfg = open_clip_config.get("model_cfg", open_clip_config)
        _check_against_open_clip_config(derived, model_cfg)
        undetermined = _fields_from_open_clip_config(derived, model_cfg)
    else:
        undetermined = _fields_from_official_config(_matching_official_config(derived))
    vision = derived["vision_config"] | undetermined["vision_config"]
    text = derived["text_config"] | undetermined["text_config"]
    try:
        config = MoeVieConfig(projection_dim=derived["projection_dim"], vision_config=vision, text_config=text)
    except ValueError as error:
        raise ValueError(f"the checkpoint's configuration is invalid: {error}") from error
    released = (name for name, fields in OFFICIAL_MOE_VIE_CONFIGS.items()
                if MoeVieConfig(**fields).to_dict() == config.to_dict())
    return config, next(released, "open_clip_config")


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: MoeVieConfig
) -> tuple[dict[str, torch.Tensor], dict]:
    """Apply the key map of spec §6.1. Returns the `MoeVieModel` state dict and the key accounting; raises on
    missing tensors and on shapes that disagree with `config`."""
    hf_state_dict, missing, mismatched, dropped = {}, [], [], []
    key_map = _key_map(config)
    for official_key, expected_shape, transform in key_map:
        tensor = state_dict.get(official_key)
        if tensor is None:
            missing.append(official_key)
        elif tuple(tensor.shape) != expected_shape:
            mismatched.append(f"{official_key}: {tuple(tensor.shape)}, expected {expected_shape}")
        else:
            converted = transform(tensor)
            if not converted:
                dropped.append(official_key)
            hf_state_dict.update(converted)
    if missing or mismatched:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensors: {_listing(missing)}")
        if mismatched:
            problems.append(f"{len(mismatched)} tensors whose shape disagrees with the configuration: "
                            f"{_listing(mismatched)}")
        raise ValueError("the checkpoint does not match a MoE-ViE model: " + "; ".join(problems))
    mapped = {official_key for official_key, _, _ in key_map}
    unexpected = sorted(set(state_dict) - mapped)
    accounting = {
        "source_tensors": len(state_dict),
        "converted": len(mapped) - len(dropped),
        "dropped_after_check": {key: "recomputed from the config and checked equal" for key in dropped},
        "unexpected": unexpected,  # ignored, as the official loader (strict=False) ignores them
    }
    return hf_state_dict, accounting


# --- locating and reading the sources -----------------------------------------------------------------------------


def _checkpoint_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    candidates = sorted(p for p in path.iterdir() if p.suffix in CHECKPOINT_SUFFIXES)
    if len(candidates) != 1:
        found = ", ".join(p.name for p in candidates) or "none"
        raise ValueError(
            f"{path} must hold exactly one official checkpoint ({'/'.join(CHECKPOINT_SUFFIXES)}); found {found}"
        )
    return candidates[0]


def _read_open_clip_config(source: str | Path | Mapping) -> Mapping:
    if isinstance(source, Mapping):
        return source
    try:
        return json.loads(Path(source).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not valid JSON: {error}") from error


# --- configuration ------------------------------------------------------------------------------------------------


def _require_moe_vie(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Fail early, with the reason, on checkpoints of other architectures."""
    if "visual.conv1.weight" not in state_dict or "token_embedding.weight" not in state_dict:
        raise ValueError(
            "not an OpenCLIP image-text checkpoint: it lacks visual.conv1.weight or token_embedding.weight"
        )
    if not any(".mlp.moe.w1" in key for key in state_dict):
        hint = ""
        if "visual.class_embedding" in state_dict or "visual.positional_embedding" in state_dict:
            hint = " It looks like a dense OpenCLIP ViT (class token, absolute positions)."
        raise ValueError(
            "not a MoE-ViE checkpoint: no vision block has MoE experts (visual.transformer.resblocks.*.mlp.moe.w1)."
            + hint
        )
    if "visual.transformer.resblocks.0.attn.attn.rope.freqs" not in state_dict:
        raise ValueError(
            "not a MoE-ViE checkpoint: vision block 0 has no 2D RoPE frequencies "
            "(visual.transformer.resblocks.0.attn.attn.rope.freqs)"
        )
    if "visual.ln_post.weight" in state_dict or "ln_final.weight" in state_dict:
        raise ValueError(
            "the checkpoint has a final LayerNorm (visual.ln_post / ln_final), which no released MoE-ViE has "
            "(use_ln_post = false); this converter does not map it"
        )


def _num_blocks(state_dict: Mapping[str, torch.Tensor], prefix: str) -> int:
    blocks = 0
    while f"{prefix}{blocks}.attn.ln.weight" in state_dict:
        blocks += 1
    return blocks


def _config_from_shapes(state_dict: Mapping[str, torch.Tensor]) -> dict:
    def shape(key: str) -> tuple[int, ...]:
        if key not in state_dict:
            raise ValueError(f"the checkpoint lacks {key}, which the configuration is read from")
        return tuple(state_dict[key].shape)

    width, channels, patch_size, _ = shape("visual.conv1.weight")
    blocks = "visual.transformer.resblocks."
    vision_layers = _num_blocks(state_dict, blocks)
    moe_layers = [i for i in range(vision_layers) if f"{blocks}{i}.mlp.moe.w1" in state_dict]
    first_moe = f"{blocks}{moe_layers[0]}.mlp.moe."
    routed, twice_expert_width, _ = shape(first_moe + "w1")
    expert_width = twice_expert_width // 2
    shared_width = shape(first_moe + "_shared_module.gate_proj.weight")[0]
    dense = next((i for i in range(vision_layers) if i not in moe_layers), None)
    head_dim = 4 * shape(f"{blocks}0.attn.attn.rope.freqs")[0]
    vocab_size, text_width = shape("token_embedding.weight")
    vision = dict(
        hidden_size=width, num_hidden_layers=vision_layers, num_attention_heads=width // head_dim,
        num_channels=channels, patch_size=patch_size, mlp_type="swiglu", hidden_act="silu",
        # Without a dense block the dense width is unused; record the usual granularity of 4.
        intermediate_size=(
            shape(f"{blocks}{dense}.mlp.mlp.gate_proj.weight")[0] if dense is not None else 4 * expert_width
        ),
        mlp_bias=dense is None or f"{blocks}{dense}.mlp.mlp.gate_proj.bias" in state_dict,
        moe_intermediate_size=expert_width, n_routed_experts=routed, n_shared_experts=shared_width // expert_width,
        moe_layers=moe_layers, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0,
        shared_expert_scale=1.0, position_embedding_type="rope_2d", rope_interleaved=True, rope_position_offset=1,
        use_pre_layernorm="visual.ln_pre.weight" in state_dict, use_post_layernorm=False, patch_embedding_bias=False,
        attention_bias=True, layer_norm_eps=1e-5, pooling_hidden_act="gelu",
        pooling_intermediate_size=shape("visual.attn_pool.mlp.c_fc.weight")[0],
    )
    text = dict(
        vocab_size=vocab_size, hidden_size=text_width,
        num_hidden_layers=_num_blocks(state_dict, "transformer.resblocks."),
        intermediate_size=shape("transformer.resblocks.0.mlp.mlp.gate_proj.weight")[0], mlp_type="swiglu",
        hidden_act="silu", mlp_bias="transformer.resblocks.0.mlp.mlp.gate_proj.bias" in state_dict,
        max_position_embeddings=shape("positional_embedding")[0], is_causal=True, pooling_type="eos",
        use_final_layer_norm=False, layer_norm_eps=1e-5,
        # CLIP's BPE puts <start_of_text> and <end_of_text> last, so the official argmax(input_ids) pooling is the
        # first EOS; pads are 0.
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=0,
    )
    return {"projection_dim": shape("visual.proj")[1], "vision_config": vision, "text_config": text}


def _routed_top_k(coarse_k: int, split: int, shared_experts: int) -> int:
    return coarse_k * split - shared_experts


def _check_against_open_clip_config(derived: dict, model_cfg: Mapping) -> None:
    vision, text = derived["vision_config"], derived["text_config"]
    vision_cfg, text_cfg = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    checks = [
        ("embed_dim", model_cfg.get("embed_dim"), derived["projection_dim"], "visual.proj"),
        ("vision_cfg.width", vision_cfg.get("width"), vision["hidden_size"], "visual.conv1.weight"),
        ("vision_cfg.layers", vision_cfg.get("layers"), vision["num_hidden_layers"], "visual.transformer.resblocks"),
        ("vision_cfg.heads", vision_cfg.get("heads"), vision["num_attention_heads"], "rope.freqs (head_dim / 4)"),
        ("vision_cfg.patch_size", vision_cfg.get("patch_size"), vision["patch_size"], "visual.conv1.weight"),
        ("vision_cfg.moe_layers", vision_cfg.get("moe_layers"), vision["moe_layers"], "the blocks with mlp.moe.*"),
        ("vision_cfg.use_ln_pre", vision_cfg.get("use_ln_pre"), vision["use_pre_layernorm"], "visual.ln_pre"),
        ("vision_cfg.use_ln_post", vision_cfg.get("use_ln_post"), False, "visual.ln_post"),
        ("text_cfg.width", text_cfg.get("width"), text["hidden_size"], "token_embedding.weight"),
        ("text_cfg.layers", text_cfg.get("layers"), text["num_hidden_layers"], "transformer.resblocks"),
        ("text_cfg.context_length", text_cfg.get("context_length"), text["max_position_embeddings"],
         "positional_embedding"),
        ("text_cfg.vocab_size", text_cfg.get("vocab_size"), text["vocab_size"], "token_embedding.weight"),
        ("text_cfg.use_ln_post", text_cfg.get("use_ln_post"), False, "ln_final"),
    ]
    if "num_of_expert" in vision_cfg and "split" in vision_cfg:
        checks.append(("vision_cfg.num_of_expert * split", vision_cfg["num_of_expert"] * vision_cfg["split"],
                       vision["n_routed_experts"] + vision["n_shared_experts"], "mlp.moe.w1 and _shared_module"))
    for name, stated, found, source in checks:
        if stated is not None and _normalised(stated) != _normalised(found):
            raise ValueError(
                f"the official model config says {name}={stated!r} but the checkpoint's tensors give {found!r} "
                f"(from {source}): the checkpoint and its config do not belong together"
            )


def _normalised(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _fields_from_open_clip_config(derived: dict, model_cfg: Mapping) -> dict:
    vision_cfg, text_cfg = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    required = {"vision_cfg": ("image_size", "attn_pooler_heads", "k", "split"), "text_cfg": ("heads",)}
    absent = [f"{section}.{key}" for section, keys in required.items() for key in keys
              if key not in model_cfg.get(section, {})]
    if absent:
        raise ValueError(
            f"the official model config lacks {', '.join(absent)}: the number of attention heads, the routed top-k "
            "and the image size cannot be read from tensor shapes"
        )
    shared = derived["vision_config"]["n_shared_experts"]
    vision = dict(
        image_size=vision_cfg["image_size"],
        pooling_num_attention_heads=vision_cfg["attn_pooler_heads"],
        num_experts_per_tok=_routed_top_k(vision_cfg["k"], vision_cfg["split"], shared),
        rope_theta=float(vision_cfg.get("rope_theta", 10000.0)),
    )
    return {"vision_config": vision, "text_config": {"num_attention_heads": text_cfg["heads"]}}


# What a released configuration must agree on with the shapes, and what it supplies.
_COMPARED_FIELDS = {
    "vision_config": ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "intermediate_size",
                      "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "moe_layers",
                      "pooling_intermediate_size"),
    "text_config": ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings"),
}
_SUPPLIED_FIELDS = {
    "vision_config": ("image_size", "pooling_num_attention_heads", "num_experts_per_tok", "rope_theta"),
    "text_config": ("num_attention_heads",),
}


def _matching_official_config(derived: dict) -> str:
    vision = derived["vision_config"]
    for name, fields in OFFICIAL_MOE_VIE_CONFIGS.items():
        official = MoeVieConfig(**fields)
        if (official.vision_config.hidden_size, official.vision_config.num_hidden_layers,
                official.vision_config.patch_size) != (vision["hidden_size"], vision["num_hidden_layers"],
                                                       vision["patch_size"]):
            continue
        differences = [
            f"{section}.{field}: {getattr(getattr(official, section), field)!r} in {name}, "
            f"{derived[section][field]!r} in the checkpoint"
            for section, names in _COMPARED_FIELDS.items()
            for field in names
            if _normalised(getattr(getattr(official, section), field)) != _normalised(derived[section][field])
        ]
        if official.projection_dim != derived["projection_dim"]:
            differences.append(f"projection_dim: {official.projection_dim} in {name}, {derived['projection_dim']} "
                               "in the checkpoint")
        if differences:
            raise ValueError(
                f"the vision tower has the shape of {name} but other tensors differ ({'; '.join(differences)}); "
                f"pass its official model config ({option_name('open_clip_config')})"
            )
        return name
    raise ValueError(
        f"the tensor shapes (vision width {vision['hidden_size']}, {vision['num_hidden_layers']} blocks, patch "
        f"{vision['patch_size']}) match none of the released MoE-ViE configurations "
        f"({', '.join(OFFICIAL_MOE_VIE_CONFIGS)}); pass the official model config "
        f"({option_name('open_clip_config')}) for the heads, "
        "the routed top-k and the image size"
    )


def _fields_from_official_config(name: str) -> dict:
    official = MoeVieConfig(**OFFICIAL_MOE_VIE_CONFIGS[name])
    return {
        section: {field: getattr(getattr(official, section), field) for field in names}
        for section, names in _SUPPLIED_FIELDS.items()
    }


# --- the key map (spec §6.1) --------------------------------------------------------------------------------------


def _key_map(config: MoeVieConfig) -> list[tuple[str, tuple[int, ...], Transform]]:
    """(official key, expected shape, transform to HF tensors) for every tensor of the official model."""
    vision, text = config.vision_config, config.text_config
    width, text_width = vision.hidden_size, text.hidden_size
    rows = [
        ("logit_scale", (), _rename("logit_scale")),
        ("token_embedding.weight", (text.vocab_size, text_width),
         _rename("text_model.embeddings.token_embedding.weight")),
        ("positional_embedding", (text.max_position_embeddings, text_width),
         _rename("text_model.embeddings.position_embedding.weight")),
        ("text_projection", (text_width, config.projection_dim), _transpose("text_projection.weight")),
        ("visual.conv1.weight", (width, vision.num_channels, vision.patch_size, vision.patch_size),
         _conv_to_linear("vision_model.embeddings.patch_embedding.weight")),
        ("visual.proj", (width, config.projection_dim), _transpose("visual_projection.weight")),
    ]
    if vision.use_pre_layernorm:
        rows += _layer_norm("visual.ln_pre", "vision_model.pre_layernorm", width)
    for i in range(text.num_hidden_layers):
        source, target = f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}"
        rows += _attention_block(source, target, text_width)
        rows += _swiglu(f"{source}.mlp.mlp", f"{target}.mlp", text_width, text.intermediate_size, text.mlp_bias)
    moe_layers = set(vision.moe_layers)
    for i in range(vision.num_hidden_layers):
        source, target = f"visual.transformer.resblocks.{i}", f"vision_model.encoder.layers.{i}"
        rows += _attention_block(source, target, width)
        rows.append((f"{source}.attn.attn.rope.freqs", (vision.head_dim // 4,), _check_rope_frequencies(vision)))
        if i in moe_layers:
            rows += _moe(f"{source}.mlp.moe", f"{target}.mlp", vision)
        else:
            rows += _swiglu(f"{source}.mlp.mlp", f"{target}.mlp", width, vision.intermediate_size, vision.mlp_bias)
    pool, head = "visual.attn_pool", "vision_model.head"
    rows += [
        (f"{pool}.probe", (1, 1, width), _rename(f"{head}.probe")),
        (f"{pool}.attn.in_proj_weight", (3 * width, width), _rename(f"{head}.attention.in_proj_weight")),
        (f"{pool}.attn.in_proj_bias", (3 * width,), _rename(f"{head}.attention.in_proj_bias")),
        (f"{pool}.attn.out_proj.weight", (width, width), _rename(f"{head}.attention.out_proj.weight")),
        (f"{pool}.attn.out_proj.bias", (width,), _rename(f"{head}.attention.out_proj.bias")),
    ]
    rows += _layer_norm(f"{pool}.layernorm", f"{head}.layernorm", width)
    rows += _linear(f"{pool}.mlp.c_fc", f"{head}.mlp.fc1", width, vision.pooling_intermediate_size)
    rows += _linear(f"{pool}.mlp.c_proj", f"{head}.mlp.fc2", vision.pooling_intermediate_size, width)
    return rows


def _attention_block(source: str, target: str, width: int) -> list:
    """Pre-attention LN, the fused `in_proj` split into q/k/v, `out_proj`, and the pre-MLP LN."""
    return [
        *_layer_norm(f"{source}.attn.ln", f"{target}.layer_norm1", width),
        (f"{source}.attn.attn.in_proj_weight", (3 * width, width), _split_qkv(f"{target}.self_attn", "weight")),
        (f"{source}.attn.attn.in_proj_bias", (3 * width,), _split_qkv(f"{target}.self_attn", "bias")),
        *_linear(f"{source}.attn.attn.out_proj", f"{target}.self_attn.out_proj", width, width),
        *_layer_norm(f"{source}.mlp.ln", f"{target}.layer_norm2", width),
    ]


def _moe(source: str, target: str, vision) -> list:
    routed, width, expert_width = vision.n_routed_experts, vision.hidden_size, vision.moe_intermediate_size
    shared_width = vision.n_shared_experts * expert_width
    rows = [
        (f"{source}.w1", (routed, 2 * expert_width, width), _rename(f"{target}.experts.gate_up_proj")),
        (f"{source}.w2", (routed, width, expert_width), _rename(f"{target}.experts.down_proj")),
        (f"{source}._gate_module.weight", (routed, width), _rename(f"{target}.gate.weight")),
        (f"{source}.expert_bias", (routed,), _rename(f"{target}.gate.e_score_correction_bias", torch.float32)),
    ]
    if shared_width:
        rows += _swiglu(f"{source}._shared_module", f"{target}.shared_expert", width, shared_width, bias=False)
    return rows


def _swiglu(source: str, target: str, width: int, hidden: int, bias: bool) -> list:
    return [
        *_linear(f"{source}.gate_proj", f"{target}.gate_proj", width, hidden, bias),
        *_linear(f"{source}.up_proj", f"{target}.up_proj", width, hidden, bias),
        *_linear(f"{source}.down_proj", f"{target}.down_proj", hidden, width, bias),
    ]


def _linear(source: str, target: str, in_features: int, out_features: int, bias: bool = True) -> list:
    rows = [(f"{source}.weight", (out_features, in_features), _rename(f"{target}.weight"))]
    if bias:
        rows.append((f"{source}.bias", (out_features,), _rename(f"{target}.bias")))
    return rows


def _layer_norm(source: str, target: str, width: int) -> list:
    return [(f"{source}.weight", (width,), _rename(f"{target}.weight")),
            (f"{source}.bias", (width,), _rename(f"{target}.bias"))]


def _rename(target: str, dtype: torch.dtype | None = None) -> Transform:
    return lambda tensor: {target: tensor if dtype is None else tensor.to(dtype)}


def _transpose(target: str) -> Transform:
    """OpenCLIP projections are `x @ proj` with proj (in, out); nn.Linear stores (out, in)."""
    return lambda tensor: {target: tensor.t().contiguous()}


def _conv_to_linear(target: str) -> Transform:
    """Conv2d (H, C, p, p) -> Linear (H, p*p*C) over patches flattened in (py, px, c) order (exact)."""
    return lambda tensor: {target: tensor.permute(0, 2, 3, 1).reshape(tensor.shape[0], -1)}


def _split_qkv(target: str, kind: str) -> Transform:
    def split(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        query, key, value = tensor.chunk(3, dim=0)
        return {f"{target}.q_proj.{kind}": query, f"{target}.k_proj.{kind}": key, f"{target}.v_proj.{kind}": value}

    return split


def _check_rope_frequencies(vision) -> Transform:
    """`rope.freqs` is not a weight: it must equal the frequencies the config implies, then it is dropped."""

    def check(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        expected = rope_2d_inverse_frequencies(vision.head_dim, vision.rope_theta)
        if not torch.allclose(tensor.float(), expected, rtol=1e-5, atol=0):
            raise ValueError(
                f"rope.freqs {tensor.float().tolist()} differ from 1 / theta^(2j / (head_dim / 2)) with "
                f"head_dim={vision.head_dim}, theta={vision.rope_theta} ({expected.tolist()}): the checkpoint uses "
                "another RoPE than MoE-ViE's"
            )
        return {}

    return check


def _listing(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# --- `moezoo convert --to moe_vie --from <official .pt>` ------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--open-clip-config", help="the official model-config JSON (e.g. MoEViE-B16-224.json)")
    parser.add_argument("--tokenizer", default=None,
                        help=f"a CLIP tokenizer folder or Hub id (default: {CLIP_TOKENIZER_REPO})")
    add_dtype_argument(parser)
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest output shard, which the conversion holds in memory before writing it")


def convert(source: Path, open_clip_config: str | None = None, tokenizer: str | None = None,
            dtype: str | None = None, max_shard_size: str = "5GB") -> ConversionResult:
    """The converter behind the command: the model, streamed into a temporary folder (the result's `StreamedModel`,
    which `moezoo convert` moves into its output), the official preprocessing and CLIP's tokenizer."""
    # Found before the conversion, which takes minutes at paper scale: a tokenizer that cannot be had fails at once.
    tokenizer_folder = locate(tokenizer or CLIP_TOKENIZER_REPO, "CLIP's tokenizer",
                              how="pass --tokenizer with a local CLIP tokenizer folder", allow_patterns=TOKENIZER_FILES)
    model = StreamedModel(MoeVieModel, "moe-vie-conversion-")
    report = write_official_checkpoint(source, model.folder, open_clip_config=open_clip_config, dtype=dtype,
                                       max_shard_size=max_shard_size)
    text_config = model.config.text_config
    processor = make_moe_vie_processor(
        model.config,
        tokenizer=load_clip_tokenizer(tokenizer_folder, text_config.max_position_embeddings),
        size=report["image_size"],
    )
    return ConversionResult(model, processor, report)
