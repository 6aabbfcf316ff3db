"""Qwen3.5 checkpoints -> MoEMB, streamed tensor by tensor (spec moemb.md §5).

Three designs of the paper (§3.1), one converter:

- `variant="native"` (§5.1): a Qwen3.5-MoE checkpoint (`model_type: qwen3_5_moe`, e.g. Qwen3.5-35B-A3B). Every
  tensor keeps its name; experts stored per expert (`mlp.experts.{j}.{gate,up,down}_proj.weight`) are fused into
  transformers' 3D layout (`experts.gate_up_proj`, `experts.down_proj`), fused ones are copied.
- `variant="upcycled"` (§5.4): a dense Qwen3.5 checkpoint (`qwen3_5`, e.g. Qwen3.5-2B). Each FFN is cut into
  `granularity` (G) slices of its intermediate dimension; expert `e` holds slice `e mod G`; a new router (with a
  logit bias) is initialised `random`, `tiled` or `zero_bias`, and the routed sum is scaled by G. The model equals the
  dense one at initialisation for G = 1 (any router init), and for `zero_bias` with `top_k = G`.
- `variant="modality"` (§5.5): a dense Qwen3.5 checkpoint; each FFN is copied into one expert per modality of
  `modality_map` (token modality 0 text, 1 image, 2 video -> expert), routed by `mm_token_type_ids`; equal to the
  dense model at initialisation.

Everything else (vision tower, embeddings, norms, Gated DeltaNet and attention layers) is copied. `lm_head.*` and
`mtp.*` (the multi-token-prediction layer) are dropped and reported. The `<emb>` token is added to the tokenizer when
the source has one, and its embedding row is set to the mean of the real vocabulary's rows (§5.3).

Memory: the source is read shard by shard with `safetensors.safe_open` and written shard by shard; only the tensors
of one output group (one layer's experts at most) and one output shard are held at a time. Before any data is read,
the whole plan is checked on the `meta` device from the shard headers: source type, missing or unknown tensors,
shapes. The converted folder is never loaded whole: the verification runs the source and the conversion layer by layer
(`streaming.load_layer_by_layer`), so its memory does not grow with the depth either; nor does expert pruning's
(`--prune-experts`), whose calibration runs the conversion layer by layer too.

A converted folder holds `config.json`, the weights, and (when the source has a tokenizer) the tokenizer with
`<emb>` plus the source's `preprocessor_config.json`, `video_preprocessor_config.json` and chat template, which
is what `MoEmbProcessor` is built from.
"""

import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3_5Model, Qwen3_5MoeModel
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.moemb import TOKEN_MODALITIES, UPCYCLE_ROUTER_INITS, MoEmbConfig
from ..modeling.moemb import MoEmbForEmbedding
from ..processors.build_moemb import make_moemb_processor
from ..terminal import quiet_libraries
from .common import ConversionResult, option_name
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, output_dtype
from .moemb_expert_pruning import ExpertPruning, add_pruning_arguments, pruned_config
from .streaming import (
    Build,
    ShardWriter,
    SourceCheckpoint,
    StreamedModel,
    TensorGroup,
    check_plan,
    load_layer_by_layer,
    stream_groups,
)


VARIANTS = ("native", "upcycled", "modality")
SOURCE_MODEL_TYPE = {"native": "qwen3_5_moe", "upcycled": "qwen3_5", "modality": "qwen3_5"}
LICENSE = "apache-2.0"  # the Qwen3.5 releases
# The processor's inputs besides the tokenizer, copied as they are.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja",
                   "chat_template.json")
EMBED_TOKENS = "model.language_model.embed_tokens.weight"
# Upcycled routers: the bias that makes every token pick expert e < G (one replica of each slice) at initialisation.
ZERO_BIAS_LOGIT = 5.0
ROUTER_INIT_STD = 0.02
_DROPPED = {
    "lm_head": (re.compile(r"lm_head\..+"), "the language-model head: an embedder has no next-token logits"),
    "mtp": (re.compile(r"mtp\..+"), "the multi-token-prediction layer, used only for speculative decoding"),
}
_PER_EXPERT = re.compile(
    r"(model\.language_model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_DENSE_MLP = re.compile(r"(model\.language_model\.layers\.(\d+)\.mlp)\.(gate_proj|up_proj|down_proj)\.weight")

def convert_qwen3_5_checkpoint(
    source: str | Path,
    output: str | Path,
    variant: str = "native",
    *,
    emb_token: str = "<emb>",
    emb_token_id: int | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    num_experts: int | None = None,
    granularity: int | None = None,
    top_k: int | None = None,
    router_init: str | None = None,
    modality_map: dict[int, int] | str | None = None,
    seed: int = 0,
) -> dict:
    """Convert a Qwen3.5(-MoE) folder (`config.json` + safetensors) into a MoEMB folder at `output`.

    Args:
        variant: `"native"` (from `qwen3_5_moe`), `"upcycled"` or `"modality"` (from the dense `qwen3_5`).
        emb_token / emb_token_id: the pooling token; its id comes from the source tokenizer (where it is added) unless
            given; a source without a tokenizer needs `emb_token_id`.
        dtype: `"float32"`, `"bfloat16"` or `"float16"` for every output tensor (default: the source's).
        max_shard_size: the largest output shard (bytes or a string like `"5GB"`).
        num_experts / granularity / top_k / router_init: upcycling (default 4 / 1 / 2 / "tiled", the best row of the
            paper's Table 10).
        modality_map: modality variant: `{token modality: expert}` or `"0:0,1:1,2:2"` (the default).
        seed: seeds the random router initialisations.

    Returns:
        A report: source, variant, the MoEMB options, key accounting (copied, fused, upcycled, dropped with reasons),
        the `<emb>` id and how its row was initialised.

    Raises:
        ValueError: a source of another model type, a variant that does not fit it, missing or unexpected tensors
            (with the tensors named), or options that break exactness at initialisation.
        FileNotFoundError: no config.json or no safetensors weights.
    """
    source, output = Path(source), Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} is not empty: convert into a new or empty folder")
    checkpoint, tokenizer, config, real_vocab_size, upcycling, expert_map = _source_and_config(
        source, variant, emb_token, emb_token_id, num_experts, granularity, top_k, router_init, modality_map
    )
    dtype = output_dtype(dtype, source)
    text_config, emb_token_id, vocab_size = checkpoint.config["text_config"], config.emb_token_id, (
        config.text_config.vocab_size)

    groups, dropped = _plan(checkpoint, config, variant, upcycling, expert_map, real_vocab_size, seed)
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in MoEmbForEmbedding(config).state_dict().items()}
    check_plan([checkpoint], groups, [key for keys in dropped.values() for key in keys], expected, "MoEMB")

    output.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(output, convert_file_size_to_int(max_shard_size), dtype)
    for key, tensor in stream_groups([checkpoint], groups):
        writer.add(key, tensor)
    writer.finish()
    config.architectures = [MoEmbForEmbedding.__name__]
    config.dtype = dtype
    config.save_pretrained(output)
    copied_processor_files = []
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
        for name in PROCESSOR_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, output / name)
                copied_processor_files.append(name)

    per_expert = sum(1 for key in checkpoint.shapes if _PER_EXPERT.fullmatch(key))
    dense_mlp = sum(1 for key in checkpoint.shapes if _DENSE_MLP.fullmatch(key)) if variant != "native" else 0
    return {
        "source": str(source),
        "source_model_type": checkpoint.model_type,
        "variant": variant,
        "dtype": str(dtype).removeprefix("torch."),
        "license": LICENSE,
        "emb_token": emb_token,
        "emb_token_id": emb_token_id,
        "emb_row_init": f"mean of embedding rows 0..{real_vocab_size - 1} (except <emb>)",
        "vocab_size": {"source": text_config["vocab_size"], "converted": vocab_size},
        "upcycling": None if upcycling is None else upcycling.report(seed),
        "modality_expert_map": expert_map,
        "key_accounting": {
            "source_tensors": len(checkpoint.shapes),
            "copied": len(checkpoint.shapes) - sum(len(keys) for keys in dropped.values()) - per_expert - dense_mlp,
            "fused_from_per_expert": per_expert,
            "expanded_from_dense_ffn": dense_mlp,
            "dropped": {name: {"tensors": len(keys), "reason": _DROPPED[name][1]} for name, keys in dropped.items()},
            "written": writer.num_tensors,
        },
        "processor_files": ["tokenizer"] + copied_processor_files if tokenizer is not None else [],
    }


def _source_and_config(source: Path, variant, emb_token, emb_token_id, num_experts, granularity, top_k, router_init,
                       modality_map):  # fmt: skip
    """The source's headers, its tokenizer with `<emb>`, the MoEMB config they convert into, how many embedding rows
    are real tokens, and the variant's plan: what the conversion knows before reading a weight."""
    if variant not in VARIANTS:
        raise ValueError(f"{option_name('variant', variant)} is not one of {', '.join(map(repr, VARIANTS))}")
    _check_variant_options(variant, num_experts, granularity, top_k, router_init, modality_map)
    checkpoint = SourceCheckpoint(source, "the source")
    _check_source_type(checkpoint.model_type, variant)
    tokenizer, emb_token_id, real_vocab_size = _prepare_tokenizer(source, emb_token, emb_token_id)
    text_config = checkpoint.config["text_config"]
    vocab_size = text_config["vocab_size"]
    if real_vocab_size is None:  # no tokenizer: every row of the source matrix counts as a real token
        real_vocab_size = vocab_size
    if emb_token_id >= vocab_size:
        # Spec §5.3: grow the embedding matrix to a multiple of 64 that holds the new id.
        vocab_size = math.ceil((emb_token_id + 1) / 64) * 64
    upcycling = _UpcyclingPlan.from_options(text_config, num_experts, granularity, top_k, router_init) if (
        variant == "upcycled") else None
    expert_map = _parse_modality_map(modality_map) if variant == "modality" else None
    config = _moemb_config(checkpoint.config, variant, emb_token, emb_token_id, vocab_size, upcycling, expert_map)
    return checkpoint, tokenizer, config, real_vocab_size, upcycling, expert_map


def plan_output(source: Path, variant: str = "native", emb_token: str = "<emb>", emb_token_id: int | None = None,
                num_experts: int | None = None, granularity: int | None = None, top_k: int | None = None,
                router_init: str | None = None, modality_map=None, **options) -> PlannedOutput:
    """What `convert` writes, from the source's config, tokenizer and safetensors headers alone (`moezoo convert
    --dry-run`, and the disk-space check before a conversion); with `prune_experts`, the pruned model."""
    _, _, config, _, _, _ = _source_and_config(
        Path(source), variant, emb_token, emb_token_id, num_experts, granularity, top_k, router_init, modality_map
    )
    pruning = ExpertPruning.pop_from(options)
    return PlannedOutput(config if pruning is None else pruned_config(config, pruning.keep), (Path(source),))


# --- the source -----------------------------------------------------------------------------------------------------


def _check_source_type(model_type: str | None, variant: str) -> None:
    expected = SOURCE_MODEL_TYPE[variant]
    if model_type == expected:
        return
    if model_type in SOURCE_MODEL_TYPE.values():
        fitting = [name for name, source_type in SOURCE_MODEL_TYPE.items() if source_type == model_type]
        raise ValueError(
            f"{option_name('variant', variant)} converts a {expected!r} checkpoint, but the source is "
            f"{model_type!r}: use {' or '.join(option_name('variant', name) for name in fitting)} for it"
        )
    raise ValueError(
        f"the source is a {model_type!r} checkpoint; MoEMB converts Qwen3.5-MoE ('qwen3_5_moe', variant 'native') "
        "and dense Qwen3.5 ('qwen3_5', variants 'upcycled' and 'modality') multimodal checkpoints, e.g. "
        "Qwen/Qwen3.5-35B-A3B or Qwen/Qwen3.5-2B"
    )


def _prepare_tokenizer(source: Path, emb_token: str, emb_token_id: int | None):
    """The source tokenizer with `<emb>` added (None without one), the `<emb>` id, and how many embedding rows belong
    to real tokens (the rows the `<emb>` row is the mean of)."""
    has_tokenizer = (source / "tokenizer.json").is_file() or (source / "tokenizer_config.json").is_file()
    if not has_tokenizer:
        if emb_token_id is None:
            raise ValueError(
                f"{source} has no tokenizer to add {emb_token} to: pass {option_name('emb_token_id')} (the id "
                f"{emb_token} has in the tokenizer you will use)"
            )
        return None, emb_token_id, None
    tokenizer = AutoTokenizer.from_pretrained(source)
    real_vocab_size = len(tokenizer)
    if emb_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [emb_token]})
    tokenizer_id = tokenizer.convert_tokens_to_ids(emb_token)
    if emb_token_id is not None and emb_token_id != tokenizer_id:
        raise ValueError(
            f"{option_name('emb_token_id', emb_token_id)} disagrees with the source tokenizer, where {emb_token} is "
            f"id {tokenizer_id}; leave it unset"
        )
    return tokenizer, tokenizer_id, real_vocab_size


# --- configuration --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UpcyclingPlan:
    num_experts: int
    granularity: int
    top_k: int
    router_init: str
    dense_width: int

    @classmethod
    def from_options(cls, text_config: dict, num_experts, granularity, top_k, router_init) -> "_UpcyclingPlan":
        plan = cls(
            num_experts=4 if num_experts is None else num_experts,
            granularity=1 if granularity is None else granularity,
            top_k=2 if top_k is None else top_k,
            router_init="tiled" if router_init is None else router_init,
            dense_width=text_config["intermediate_size"],
        )
        # MoEmbConfig, which the plan becomes, checks the rest (router_init, the expert counts, top_k = granularity);
        # cutting the dense FFN needs this first.
        granularity = plan.granularity
        if not (isinstance(granularity, int) and granularity > 0 and plan.dense_width % granularity == 0):
            raise ValueError(
                f"{option_name('granularity', granularity)} must be a positive integer that divides the dense FFN "
                f"width {plan.dense_width}: the slices would not be equal otherwise"
            )
        return plan

    @property
    def expert_width(self) -> int:
        return self.dense_width // self.granularity

    def slice_of(self, expert: int) -> slice:
        group = expert % self.granularity
        return slice(group * self.expert_width, (group + 1) * self.expert_width)

    def router(self, hidden_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`gate.weight (E, H)` and `gate.bias (E,)` in fp32 (spec §2.5, A-10)."""
        bias = torch.zeros(self.num_experts)
        if self.router_init == "random":
            weight = torch.randn(self.num_experts, hidden_size, generator=generator) * ROUTER_INIT_STD
        elif self.router_init == "tiled":
            weight = (torch.randn(1, hidden_size, generator=generator) * ROUTER_INIT_STD).repeat(self.num_experts, 1)
        else:  # zero_bias: experts 0..G-1 hold the G slices once each; the bias selects them for every token
            weight = torch.zeros(self.num_experts, hidden_size)
            bias[: self.granularity] = ZERO_BIAS_LOGIT
        return weight, bias

    def report(self, seed: int) -> dict:
        return {"num_experts": self.num_experts, "granularity": self.granularity, "top_k": self.top_k,
                "router_init": self.router_init, "expert_width": self.expert_width, "seed": seed}


def _check_variant_options(variant, num_experts, granularity, top_k, router_init, modality_map) -> None:
    upcycling = {"num_experts": num_experts, "granularity": granularity, "top_k": top_k, "router_init": router_init}
    if variant != "upcycled" and any(value is not None for value in upcycling.values()):
        given = [option_name(name) for name, value in upcycling.items() if value is not None]
        raise ValueError(f"{', '.join(given)} only apply to --variant upcycled, not {variant!r}")
    if variant != "modality" and modality_map is not None:
        raise ValueError(f"{option_name('modality_map')} only applies to --variant modality, not {variant!r}")


def _parse_modality_map(modality_map: dict[int, int] | str | None) -> dict[int, int]:
    """`{0: 0, 1: 1, 2: 2}` by default; a string reads `"0:0,1:1,2:1"` (token modality: expert)."""
    if modality_map is None:
        return {modality: modality for modality in TOKEN_MODALITIES}
    if isinstance(modality_map, dict):
        return dict(modality_map)
    try:
        pairs = [item.split(":") for item in modality_map.split(",")]
        return {int(modality): int(expert) for modality, expert in pairs}
    except ValueError as error:
        raise ValueError(
            f"{option_name('modality_map', modality_map)} must read 'modality:expert,...' with modalities 0 (text), "
            "1 (image), 2 (video), e.g. '0:0,1:1,2:2' or '0:0,1:1,2:1'"
        ) from error


def _moemb_config(source_config, variant, emb_token, emb_token_id, vocab_size, upcycling, expert_map) -> MoEmbConfig:
    """The source's sub-configs (every value read from the checkpoint), with the MoE fields of the variant."""
    text = {key: value for key, value in source_config["text_config"].items() if key != "model_type"}
    text["vocab_size"] = vocab_size
    if variant != "native":
        dense_width = text.pop("intermediate_size")
        if upcycling is not None:
            moe = dict(num_experts=upcycling.num_experts, num_experts_per_tok=upcycling.top_k,
                       moe_intermediate_size=upcycling.expert_width)
        else:
            moe = dict(num_experts=len(set(expert_map.values())), num_experts_per_tok=1,
                       moe_intermediate_size=dense_width)
        text |= moe | {"shared_expert_intermediate_size": 0}
    token_ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return MoEmbConfig(
        text_config=text,
        vision_config=dict(source_config["vision_config"]),
        **{name: source_config[name] for name in token_ids if name in source_config},
        moe_variant=variant,
        source_model_type=source_config["model_type"],
        emb_token=emb_token,
        emb_token_id=emb_token_id,
        upcycle_granularity=upcycling.granularity if upcycling is not None else None,
        upcycle_router_init=upcycling.router_init if upcycling is not None else None,
        modality_expert_map=expert_map,
    )


# --- the plan: which target tensors each source tensor feeds ---------------------------------------------------------


def _plan(checkpoint, config, variant, upcycling, expert_map, real_vocab_size, seed):
    """Groups covering every kept source tensor, and the dropped tensors by kind (`_DROPPED`)."""
    groups, dropped = [], {name: [] for name in _DROPPED}
    per_expert: dict[str, list[str]] = {}
    dense_mlps: dict[str, list[str]] = {}
    for key in checkpoint.shapes:
        drop = next((name for name, (pattern, _) in _DROPPED.items() if pattern.fullmatch(key)), None)
        if drop is not None:
            dropped[drop].append(key)
        elif key == EMBED_TOKENS:
            groups.append(TensorGroup((key,), _embedding_with_emb_row(config, real_vocab_size)))
        elif (match := _PER_EXPERT.fullmatch(key)) and variant == "native":
            per_expert.setdefault(match[1], []).append(key)
        elif (match := _DENSE_MLP.fullmatch(key)) and variant != "native":
            dense_mlps.setdefault(match[1], []).append(key)
        else:
            groups.append(TensorGroup((key,), lambda tensors, device: tensors))
    num_experts = config.text_config.num_experts
    for prefix, keys in per_expert.items():
        groups.append(TensorGroup(_complete_experts(prefix, keys, num_experts), _fuse_experts(prefix, num_experts)))
    hidden_size = config.text_config.hidden_size
    for prefix, keys in dense_mlps.items():
        sources = tuple(f"{prefix}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj"))
        if set(keys) != set(sources):
            raise ValueError(f"the dense FFN {prefix} lacks {sorted(set(sources) - set(keys))} in the source")
        if upcycling is not None:
            layer = int(_DENSE_MLP.fullmatch(keys[0])[2])
            generator = torch.Generator().manual_seed(seed + layer)
            groups.append(TensorGroup(sources, _upcycled_ffn(prefix, upcycling, hidden_size, generator)))
        else:
            groups.append(TensorGroup(sources, _modality_ffn(prefix, expert_map)))
    return groups, {name: keys for name, keys in dropped.items() if keys}


def _complete_experts(prefix: str, keys: list[str], num_experts: int) -> tuple[str, ...]:
    """All `3 * num_experts` per-expert tensors of one layer, or an error naming the missing experts."""
    sources = tuple(
        f"{prefix}.{expert}.{name}.weight" for expert in range(num_experts)
        for name in ("gate_proj", "up_proj", "down_proj")
    )
    missing = sorted({int(_PER_EXPERT.fullmatch(key)[2]) for key in set(sources) - set(keys)})
    extra = sorted(set(keys) - set(sources))
    if missing or extra:
        raise ValueError(
            f"{prefix} of the source does not hold the {num_experts} experts its config declares (num_experts): "
            + (f"experts {missing} are missing" if missing else "")
            + ("; " if missing and extra else "")
            + (f"it has extra tensors {extra[:4]}" if extra else "")
            + ". A partial download, or a checkpoint whose experts were pruned without updating config.json"
        )
    return sources


def _embedding_with_emb_row(config: MoEmbConfig, real_vocab_size: int) -> Build:
    emb_id, vocab_size = config.emb_token_id, config.text_config.vocab_size

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        weight = tensors[EMBED_TOKENS]
        num_real = min(real_vocab_size, weight.shape[0])
        # fp32 sums without an fp32 copy of the (large) matrix; the <emb> row itself does not count
        total = torch.sum(weight[:num_real], dim=0, dtype=torch.float32)
        if emb_id < num_real:
            total = total - weight[emb_id].float()
            num_real -= 1
        embedding = torch.cat([weight, weight.new_zeros(vocab_size - weight.shape[0], weight.shape[1])])
        embedding[emb_id] = (total / num_real).to(weight.dtype)
        return {EMBED_TOKENS: embedding}

    return build


def _fuse_experts(prefix: str, num_experts: int) -> Build:
    """Per-expert Linear weights -> `gate_up_proj (E, 2I, H)` (gate rows first) and `down_proj (E, H, I)`, as
    transformers' own checkpoint conversion for Qwen MoE models does."""

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        def weights(name):
            return [tensors[f"{prefix}.{expert}.{name}.weight"] for expert in range(num_experts)]

        gate_up = [torch.cat([gate, up]) for gate, up in zip(weights("gate_proj"), weights("up_proj"))]
        return {
            f"{prefix}.gate_up_proj": torch.stack(gate_up),
            f"{prefix}.down_proj": torch.stack(weights("down_proj")),
        }

    return build


def _upcycled_ffn(prefix: str, plan: _UpcyclingPlan, hidden_size: int, generator: torch.Generator) -> Build:
    weight, bias = plan.router(hidden_size, generator)

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        gate, up, down = (tensors[f"{prefix}.{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj"))
        slices = [plan.slice_of(expert) for expert in range(plan.num_experts)]
        return {
            f"{prefix}.experts.gate_up_proj": torch.stack([torch.cat([gate[part], up[part]]) for part in slices]),
            f"{prefix}.experts.down_proj": torch.stack([down[:, part] for part in slices]),
            f"{prefix}.gate.weight": weight.to(device=gate.device, dtype=gate.dtype),
            f"{prefix}.gate.bias": bias.to(device=gate.device, dtype=gate.dtype),
        }

    return build


def _modality_ffn(prefix: str, expert_map: dict[int, int]) -> Build:
    num_experts = len(set(expert_map.values()))

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        gate, up, down = (tensors[f"{prefix}.{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj"))
        return {
            f"{prefix}.experts.gate_up_proj": torch.cat([gate, up])[None].repeat(num_experts, 1, 1),
            f"{prefix}.experts.down_proj": down[None].repeat(num_experts, 1, 1),
        }

    return build


# --- fidelity against the source model ------------------------------------------------------------------------------


@torch.no_grad()
def measure_differences(source: str | Path, converted: str | Path) -> dict[str, float]:
    """The source model and the converted folder in fp32 on a synthetic batch (text, an image, a video, right padding),
    with eager experts on both sides: the largest absolute differences of the last hidden states (real tokens) and,
    for native conversions, of the router logits. Both models run layer by layer (`load_layer_by_layer`), so the
    memory this takes does not grow with the depth."""
    config = MoEmbConfig.from_pretrained(converted)
    native = config.moe_variant == "native"
    with tempfile.TemporaryDirectory(prefix="moemb-verification-") as offload:
        with quiet_libraries():  # the source's lm_head and mtp.* are not part of the base model
            reference = load_layer_by_layer(Qwen3_5MoeModel if native else Qwen3_5Model, source,
                                            Path(offload) / "source", dtype=torch.float32,
                                            experts_implementation="eager")
        model = load_layer_by_layer(MoEmbForEmbedding, converted, Path(offload) / "converted", dtype=torch.float32,
                                    experts_implementation="eager")
        # Text ids the source knows: the conversion may have grown the vocabulary to hold <emb> (spec §5.3).
        batch = synthetic_batch(config, vocab_size=reference.get_input_embeddings().num_embeddings)
        expected = reference(**batch, output_router_logits=native)
        got = model.model(**batch, output_router_logits=native)
    real = batch["attention_mask"].bool()
    differences = {
        "last_hidden_state": float((got.last_hidden_state[real] - expected.last_hidden_state[real]).abs().max())
    }
    if native:
        differences["router_logits"] = max(
            float((ours - theirs.reshape(-1, theirs.shape[-1])[real.flatten()]).abs().max())
            for ours, theirs in zip(got.router_logits, expected.router_logits)
        )
    return differences


def synthetic_batch(config: MoEmbConfig, seed: int = 0, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Two items: text + a 4-token image + a 2-step video (each step wrapped in vision start/end, with a timestamp
    token between them), and a shorter text-only item, right-padded. No `<emb>`: its row is new, so the source model
    cannot agree on it. Text ids lie below `vocab_size` (default: the config's)."""
    vision, vocab = config.vision_config, vocab_size or config.text_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id,
               config.emb_token_id}
    text_ids = [token for token in range(min(vocab, 1000)) if token not in special]

    def words(count):
        return [text_ids[int(i)] for i in torch.randint(0, len(text_ids), (count,), generator=generator)]

    side = 2 * vision.spatial_merge_size  # a 4 x 4-patch grid: 4 merged tokens per temporal step
    tokens_per_step = (side // vision.spatial_merge_size) ** 2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    video_step = [start] + [config.video_token_id] * tokens_per_step + [end]  # the processor wraps each step
    first = (words(3) + [start] + [config.image_token_id] * tokens_per_step + [end] + words(2) + video_step
             + words(1) + video_step + words(2))
    second = words(6)
    input_ids = torch.zeros(2, len(first), dtype=torch.long)
    input_ids[0] = torch.tensor(first)
    input_ids[1, : len(second)] = torch.tensor(second)
    attention_mask = torch.zeros_like(input_ids)
    attention_mask[0] = 1
    attention_mask[1, : len(second)] = 1
    mm_token_type_ids = (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()
    patch_size = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": torch.randn(side * side, patch_size, generator=generator),
        "image_grid_thw": torch.tensor([[1, side, side]]),
        "pixel_values_videos": torch.randn(2 * side * side, patch_size, generator=generator),
        "video_grid_thw": torch.tensor([[2, side, side]]),
    }


# --- `moezoo convert --to moemb --from <Qwen3.5 folder or Hub id> [--variant native|upcycled|modality]` ---------------


def add_arguments(parser) -> None:
    parser.add_argument("--emb-token", default="<emb>", help="the pooling token added to the tokenizer")
    parser.add_argument("--emb-token-id", type=int, default=None,
                        help="the <emb> id, for a source without a tokenizer")
    add_dtype_argument(parser)
    parser.add_argument("--max-shard-size", default="5GB")
    upcycling = parser.add_argument_group("--variant upcycled (defaults: the best row of the paper's Table 10)")
    upcycling.add_argument("--num-experts", type=int, default=None, help="experts per layer (default 4)")
    upcycling.add_argument("--granularity", type=int, default=None,
                           help="slices per dense FFN; needs --top-k equal to it when > 1 (default 1)")
    upcycling.add_argument("--top-k", type=int, default=None, help="experts per token (default 2)")
    upcycling.add_argument("--router-init", choices=UPCYCLE_ROUTER_INITS, default=None, help="default: tiled")
    upcycling.add_argument("--seed", type=int, default=0, help="seeds the random router initialisations")
    parser.add_argument("--modality-map", default=None,
                        help="--variant modality: token modality -> expert, default '0:0,1:1,2:2' (0 text, 1 image, "
                             "2 video)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip running the source model to measure max |Δ| (it loads the source in fp32)")
    add_pruning_arguments(parser)


def convert(source: Path, variant: str = "native", verify: bool = True, **options) -> ConversionResult:
    """The converter behind the command: stream the conversion into a temporary folder (the result's `StreamedModel`,
    which `moezoo convert` moves into its output) and measure it against the source model, both run layer by layer.
    The processor is a `MoEmbProcessor` around the converted tokenizer (with `<emb>`). With `prune_experts` (and
    `keep`, `calibration`), the conversion's experts are pruned into a second folder, the model again run layer by
    layer (`moezoo.conversion.moemb_expert_pruning`), and max |Δ| is that of the calibration embeddings against the
    unpruned conversion where it is larger."""
    pruning = ExpertPruning.pop_from(options)
    model = StreamedModel(MoEmbForEmbedding, "moemb-conversion-")
    report = convert_qwen3_5_checkpoint(source, model.folder, variant, **options)
    tokenizer = AutoTokenizer.from_pretrained(model.folder) if report["processor_files"] else None
    differences = measure_differences(source, model.folder) if verify else None
    report |= {
        "base_model": str(source),
        "max_abs_diff": None if differences is None else max(differences.values()),
        "max_abs_diff_by_output": differences,
        "notes": [
            "max_abs_diff compares the last hidden states (and router logits) with the source model in fp32 on a "
            "synthetic text + image + video batch, eager experts on both sides.",
        ],
    }
    processor = None if tokenizer is None else make_moemb_processor(model.config, tokenizer=tokenizer)
    if pruning is not None:
        pruned = StreamedModel(MoEmbForEmbedding, "moemb-expert-pruning-")
        report["expert_pruning"] = pruning.write(model.folder, pruned.folder, processor, getattr(torch, report["dtype"]),
                                                 options.get("max_shard_size", "5GB"))
        model = pruned
        pruning_difference = report["expert_pruning"]["max_abs_diff"]
        differences = (differences or {}) | {"embeddings_after_expert_pruning": pruning_difference}
        report |= {"max_abs_diff": max(differences.values()), "max_abs_diff_by_output": differences}
        report["notes"].append(
            "embeddings_after_expert_pruning compares the embeddings of the calibration inputs before and after "
            "expert pruning."
        )
    return ConversionResult(model=model, processor=processor, provenance=report)
