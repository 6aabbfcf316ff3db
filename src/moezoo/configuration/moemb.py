"""MoEMB configuration: a universal multimodal embedder on a Qwen3.5(-MoE) backbone (spec moemb.md §4).

The backbone is described by transformers' own Qwen3.5-MoE sub-configs (`text_config`, `vision_config`), so a
Qwen3.5-MoE `config.json` maps onto MoEMB field by field. The three backbone designs of the paper (§3.1) are the same
classes with other field values:

- `moe_variant="native"`: the pretrained Qwen3.5-MoE layers unchanged: softmax top-k router (frozen by default),
  gated shared expert (spec §2.4);
- `"upcycled"`: a dense Qwen3.5 FFN copied into `num_experts` experts of `granularity` slices each, a new router with
  a logit bias, no shared expert, routed weights scaled by the granularity (spec §2.5);
- `"modality"`: one copy of the dense FFN per modality and a fixed route by token modality (spec §2.6).

Both dense-derived designs are expressed as MoE text configs (`num_experts`, `num_experts_per_tok`,
`moe_intermediate_size`), with `shared_expert_intermediate_size` unused. Every invalid value fails at construction
with a `ValueError` that names the field.
"""

from transformers import PreTrainedConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig, Qwen3_5MoeVisionConfig

from ..modeling.moe.spec import MoeLayerSpec
from .moemb_adaptive import AdaptiveSettings, check_adaptive_settings
from .moemb_gates import GateModules
from .smoes_settings import SmoesSettings
from .validation import is_non_negative_int, is_positive_int, require_choice, require_positive, require_token_id


MOE_VARIANTS = ("native", "upcycled", "modality")
POOLING_TYPES = ("emb_token", "last_token")
SOURCE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5")
# mm_token_type_ids values of the Qwen3.5 processor: what a modality expert map is keyed by.
TOKEN_MODALITIES = {0: "text", 1: "image", 2: "video"}
UPCYCLE_ROUTER_INITS = ("random", "tiled", "zero_bias")
# What Qwen3_5MoeTextRotaryEmbedding uses when rope_parameters has no mrope_section.
DEFAULT_MROPE_SECTION = [11, 11, 10]
# Names under which older or dense checkpoints store the sub-configs (Qwen3_5MoeConfig renames the first one too).
_SUB_CONFIG_MODEL_TYPES = {
    "text_config": ("moemb_text", ("qwen3_5_moe_text", "qwen3_5_text")),
    "vision_config": ("qwen3_5_moe_vision", ("qwen3_5_moe", "qwen3_5_vision")),
}


class MoEmbTextConfig(Qwen3_5MoeTextConfig):
    r"""MoEMB's text model: Qwen3.5-MoE's text config (every field and default) and the MoE block of its decoder
    layers, so that `MoEmbTextModel` also runs alone. Inside a [`MoEmbConfig`] the block fields are set from the
    embedder's own (`moe_variant` and what it resolves); alone, they default to Qwen3.5-MoE's block.

    Args:
        use_shared_expert: the gated shared expert of Qwen3.5-MoE (`shared_expert_intermediate_size` wide).
        router_bias: a learned logit bias `z = W x + b` in the router.
        routed_scaling_factor: multiplies the renormalised routed weights.
        modality_expert_map: the expert of each token modality (`mm_token_type_ids` 0 text, 1 image, 2 video) for
            fixed routes without a router (MoEMB's "modality" variant); `None` routes with a learned top-k router.
        gates: the trained efficiency modules of the layers (`MoEmbConfig.gates`).
    """

    model_type = "moemb_text"
    base_config_key = "text_config"

    use_shared_expert: bool = True
    router_bias: bool = False
    routed_scaling_factor: float = 1.0
    modality_expert_map: dict | None = None
    gates: dict | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.modality_expert_map = _with_integer_keys(self.modality_expert_map)

    def moe_layer_spec(self) -> MoeLayerSpec:
        """Every decoder layer's MoE block, for the shared core (`SparseMoeBlock`), which validates it."""
        shared = self.use_shared_expert
        return MoeLayerSpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            expert_intermediate_size=self.moe_intermediate_size,
            hidden_act=self.hidden_act,
            router_type="softmax" if self.modality_expert_map is None else "given",
            norm_topk_prob=True,
            routed_scaling_factor=self.routed_scaling_factor,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size if shared else 0,
            shared_expert_gate=shared,
            router_logit_bias=bool(self.router_bias),
        )


class MoEmbConfig(PreTrainedConfig):
    r"""The embedder: a Qwen3.5-MoE vision tower and text model, `<emb>`-token pooling, L2-normalised embeddings.

    Args:
        text_config / vision_config: `MoEmbTextConfig` (Qwen3.5-MoE's text config, whose dicts it reads) /
            `Qwen3_5MoeVisionConfig` (or their dicts), read from the source checkpoint;
            `vision_config.out_hidden_size` must equal `text_config.hidden_size`. The text config's MoE block fields
            are set from this config's.
        image_token_id / video_token_id / vision_start_token_id / vision_end_token_id: the Qwen3.5 placeholders.
        moe_variant: `"native"`, `"upcycled"` or `"modality"` (see the module docstring).
        source_model_type: the checkpoint the model was converted from (`"qwen3_5_moe"` or the dense `"qwen3_5"`).
        pooling: `"emb_token"` pools the hidden state of the `<emb>` token (the paper's default, Table 5),
            `"last_token"` the last non-padding token.
        emb_token / emb_token_id: the pooling token and its id; the id is assigned by the conversion (it is `None` in
            configs built from scratch, which then pool with an explicit `pooled_index`).
        normalize_embeddings: L2-normalise the pooled vectors.
        logit_scale: the fixed inverse temperature of the contrastive logits (50, i.e. tau = 0.02).
        router_trainable: whether training updates the routers (`mlp.gate.*`): frozen for "native" by default, as in
            the paper (Table 5), trained for "upcycled" (a new router); the "modality" variant has none. Read by the
            training code when it chooses the trainable parameters (`from_pretrained` makes every parameter
            trainable, so the model itself cannot hold the choice).
        use_shared_expert: the gated shared expert of Qwen3.5-MoE (default: only for "native").
        router_bias: a learned logit bias `z = W x + b` in the router (default: only for "upcycled").
        routed_scaling_factor: multiplies the renormalised routed weights (default: `upcycle_granularity` for
            "upcycled", which keeps the upcycled layer equal to the dense FFN at initialisation; 1 otherwise).
        upcycle_granularity: "upcycled" only: how many slices the dense FFN was cut into (G).
        upcycle_router_init: "upcycled" only, provenance: `"random"`, `"tiled"` or `"zero_bias"` (spec §2.5).
        modality_expert_map: "modality" only: expert of each token modality (`mm_token_type_ids` 0 text, 1 image,
            2 video), default `{0: 0, 1: 1, 2: 2}`; `text_config.num_experts` must equal its number of experts.
        kept_expert_ids / pruned_from_num_experts: provenance of static expert pruning (spec §3.11): for every layer
            the ids, in the unpruned model, of the `text_config.num_experts` experts kept (ascending; the same number
            in every layer), and how many experts each layer had before. Both None for an unpruned model.
        adaptive: inference-time adaptive computation (spec §3.3-3.9, §3.12) as the dict of an `AdaptiveSettings`
            (`moezoo.configuration.moemb_adaptive`): token pruning, expert skipping and adaptive top-k; None (or
            no method set) is the full forward. `model(..., adaptive=...)` overrides it for one call.
        gates: the trained efficiency modules the model has (spec §3.0-3.10), as the dict of a `GateModules`
            (`moezoo.configuration.moemb_gates`): per-layer efficiency heads, null experts, layer-skip gates, the
            one-shot token pruner; None for none (every converted checkpoint).
        smoes: the SMoES routing regulariser (`moezoo.modeling.smoes.enable_smoes`) as the dict of a `SmoesSettings`
            (`moezoo.configuration.smoes_settings`): each MoE layer then holds SMoES buffers, and a training forward
            returns the SMoES losses for the trainer to add; None for none. It needs a learned router (not
            "modality") that trains (`router_trainable`) while a loss coefficient is non-zero.
    """

    model_type = "moemb"
    sub_configs_defaults = {"text_config": MoEmbTextConfig, "vision_config": Qwen3_5MoeVisionConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    moe_variant: str = "native"
    source_model_type: str = "qwen3_5_moe"
    pooling: str = "emb_token"
    emb_token: str = "<emb>"
    emb_token_id: int | None = None
    normalize_embeddings: bool = True
    logit_scale: float = 50.0
    router_trainable: bool | None = None
    use_shared_expert: bool | None = None
    router_bias: bool | None = None
    routed_scaling_factor: float | None = None
    upcycle_granularity: int | None = None
    upcycle_router_init: str | None = None
    modality_expert_map: dict | None = None
    kept_expert_ids: list[list[int]] | None = None
    pruned_from_num_experts: int | None = None
    adaptive: dict | None = None
    gates: dict | None = None
    smoes: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        for key, (model_type, legacy_types) in _SUB_CONFIG_MODEL_TYPES.items():
            sub_config = getattr(self, key)
            if isinstance(sub_config, PreTrainedConfig) and sub_config.model_type in legacy_types:
                sub_config = sub_config.to_dict()
            if isinstance(sub_config, dict) and sub_config.get("model_type") in legacy_types:
                setattr(self, key, {**sub_config, "model_type": model_type})
        default_vision = self.vision_config is None
        super().__post_init__(**kwargs)  # builds the sub-configs from dicts / defaults
        if default_vision:
            # Qwen3_5MoeVisionConfig's default width (3584) is not Qwen3_5MoeTextConfig's (2048): the default tower
            # projects into whichever text model it is given.
            self.vision_config.out_hidden_size = self.text_config.hidden_size
        require_choice(self, "moe_variant", MOE_VARIANTS)
        self._resolve_variant_defaults()
        # The text model builds its MoE blocks from its own config, so that it also runs alone.
        for name in ("use_shared_expert", "router_bias", "routed_scaling_factor", "modality_expert_map", "gates"):
            setattr(self.text_config, name, getattr(self, name))
        self.validate_fields()

    def _resolve_variant_defaults(self) -> None:
        """Fill the fields left at None with the paper's setting for `moe_variant` (spec §4.3)."""
        native, upcycled = self.moe_variant == "native", self.moe_variant == "upcycled"
        if self.router_trainable is None:
            self.router_trainable = upcycled
        if self.use_shared_expert is None:
            self.use_shared_expert = native
        if self.router_bias is None:
            self.router_bias = upcycled
        if self.routed_scaling_factor is None:
            granularity = self.upcycle_granularity if upcycled and is_positive_int(self.upcycle_granularity) else 1
            self.routed_scaling_factor = float(granularity)
        if self.moe_variant == "modality":
            if self.modality_expert_map is None:
                self.modality_expert_map = {modality: modality for modality in TOKEN_MODALITIES}
            else:
                self.modality_expert_map = _with_integer_keys(self.modality_expert_map)

    @property
    def hidden_size(self) -> int:
        """The embedding size (the text model's width)."""
        return self.text_config.hidden_size

    @property
    def output_router_logits(self) -> bool:
        """Kept on `text_config`, where transformers' MoE configs (and `get_text_config()` users) hold it."""
        return self.text_config.output_router_logits

    @output_router_logits.setter
    def output_router_logits(self, value: bool):
        self.text_config.output_router_logits = value

    def moe_layer_spec(self) -> MoeLayerSpec:
        """Every decoder layer's MoE block, for the shared core (`SparseMoeBlock`)."""
        return self.text_config.moe_layer_spec()

    def validate_fields(self) -> None:
        text, vision = self.text_config, self.vision_config
        if not isinstance(text, MoEmbTextConfig):
            raise ValueError(
                f"MoEmbConfig.text_config must be a MoEMB or Qwen3.5-MoE text config (model_type 'moemb_text' or "
                f"'qwen3_5_moe_text'), got {text.model_type!r}; dense sources are converted into MoE text configs by "
                "moezoo.conversion"
            )
        if vision.model_type != "qwen3_5_moe_vision":
            raise ValueError(
                f"MoEmbConfig.vision_config must be a Qwen3.5 vision config (model_type 'qwen3_5_moe_vision'), got "
                f"{vision.model_type!r}"
            )
        if vision.out_hidden_size != text.hidden_size:
            raise ValueError(
                f"MoEmbConfig.vision_config.out_hidden_size={vision.out_hidden_size} must equal "
                f"text_config.hidden_size={text.hidden_size}: merged image features replace token embeddings"
            )
        self._validate_vision_patches_and_heads()
        self._validate_mrope_section()
        require_choice(self, "source_model_type", SOURCE_MODEL_TYPES)
        require_choice(self, "pooling", POOLING_TYPES)
        special_tokens = ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"]
        if self.emb_token_id is not None:
            special_tokens.append("emb_token_id")
        for name in special_tokens:
            require_token_id(self, name, text.vocab_size)
        ids = [getattr(self, name) for name in special_tokens]
        shared = [f"{name}={token_id}" for name, token_id in zip(special_tokens, ids) if ids.count(token_id) > 1]
        if shared:
            raise ValueError(
                f"MoEmbConfig.{' and MoEmbConfig.'.join(shared)} share a token id: the image and video placeholders, "
                "the vision start/end markers and <emb> each need a token of their own"
            )
        pad_token_id = text.pad_token_id
        if pad_token_id is not None and (not is_non_negative_int(pad_token_id) or pad_token_id >= text.vocab_size):
            raise ValueError(
                f"MoEmbConfig.text_config.pad_token_id={pad_token_id!r} must be a token id below "
                f"text_config.vocab_size={text.vocab_size}"
            )
        if pad_token_id is not None and pad_token_id == self.emb_token_id:
            raise ValueError(
                f"MoEmbConfig.emb_token_id={self.emb_token_id} equals text_config.pad_token_id: the embedding is read "
                "at the last <emb> token, which padding would then look like"
            )
        if not isinstance(self.emb_token, str) or not self.emb_token:
            raise ValueError(f"MoEmbConfig.emb_token must be a non-empty string, got {self.emb_token!r}")
        for name in ("normalize_embeddings", "router_trainable", "use_shared_expert", "router_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEmbConfig.{name} must be True or False, got {getattr(self, name)!r}")
        require_positive(self, "logit_scale", "routed_scaling_factor")
        if self.use_shared_expert and not is_positive_int(text.shared_expert_intermediate_size):
            raise ValueError(
                "MoEmbConfig.use_shared_expert=True needs text_config.shared_expert_intermediate_size > 0, got "
                f"{text.shared_expert_intermediate_size!r}"
            )
        self._validate_modality_routing()
        self._validate_expert_pruning()  # before the core's check of top-k, to name the pruning
        # The core validates sizes and top-k (each message names its MoeLayerSpec field).
        self.moe_layer_spec()
        self._validate_upcycling()  # after the core's check of the expert counts it compares
        self.gate_modules().validate(text.num_hidden_layers, self.moe_variant)
        self._validate_adaptive()
        self._validate_smoes()

    def gate_modules(self) -> GateModules:
        """The trained efficiency modules of `gates`."""
        return GateModules.from_dict(self.gates)

    def _validate_adaptive(self) -> None:
        if self.adaptive is not None and not isinstance(self.adaptive, dict):
            raise ValueError(f"MoEmbConfig.adaptive must be a dict of AdaptiveSettings fields, got {self.adaptive!r}")
        check_adaptive_settings(
            AdaptiveSettings.from_dict(self.adaptive), self.text_config, self.moe_variant, gates=self.gate_modules()
        )

    def smoes_settings(self) -> SmoesSettings | None:
        """The SMoES settings of `smoes` (None: no SMoES)."""
        return SmoesSettings.from_dict(self.smoes, "MoEmbConfig.smoes")

    def _validate_smoes(self) -> None:
        settings = self.smoes_settings()
        if settings is None:
            return
        if self.moe_variant == "modality":
            raise ValueError(
                "MoEmbConfig.smoes needs a learned top-k router, and moe_variant='modality' routes by token modality "
                "without one; use a 'native' or 'upcycled' model"
            )
        if not self.router_trainable and settings.smoes_enabled and (settings.smoes_bal_coef or settings.smoes_mi_coef):
            raise ValueError(
                f"MoEmbConfig.smoes trains the routers (smoes_mi_coef={settings.smoes_mi_coef}, smoes_bal_coef="
                f"{settings.smoes_bal_coef}), but MoEmbConfig.router_trainable=False freezes them (the 'native' "
                "default); set router_trainable=True, or both coefficients to 0 to only update the SMoES statistics"
            )
        text = self.text_config
        settings.check_host(text.num_experts, text.layer_types.count("full_attention"))
        self.smoes = settings.to_dict()  # every field, so that a saved config keeps the settings it ran with

    def _validate_vision_patches_and_heads(self) -> None:
        vision = self.vision_config
        for name in ("depth", "patch_size", "temporal_patch_size", "spatial_merge_size", "num_heads"):
            if not is_positive_int(getattr(vision, name)):
                raise ValueError(
                    f"MoEmbConfig.vision_config.{name} must be a positive integer, got {getattr(vision, name)!r}"
                )
        if vision.hidden_size % vision.num_heads:
            raise ValueError(
                f"MoEmbConfig.vision_config.num_heads={vision.num_heads} must divide vision_config.hidden_size="
                f"{vision.hidden_size}: every attention head gets hidden_size / num_heads dimensions"
            )

    def _validate_mrope_section(self) -> None:
        """Spec §4.2: the temporal, height and width sections of MRoPE share the rotary dimensions' frequencies
        (rotary_dim / 2 of them); transformers does not check this and runs with wrong positions otherwise."""
        text = self.text_config
        rope = text.rope_parameters
        section = rope.get("mrope_section", DEFAULT_MROPE_SECTION)
        rotary_dim = int(text.head_dim * rope.get("partial_rotary_factor", 1.0))
        if (
            not isinstance(section, (list, tuple))
            or len(section) != 3
            or not all(is_non_negative_int(size) for size in section)
            or sum(section) != rotary_dim // 2
        ):
            raise ValueError(
                f"MoEmbConfig.text_config.rope_parameters.mrope_section={section!r} must be three non-negative integers "
                f"(temporal, height, width) summing to rotary_dim / 2 = {rotary_dim // 2} (head_dim {text.head_dim} * "
                f"partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)} / 2)"
            )

    def _validate_upcycling(self) -> None:
        upcycled = self.moe_variant == "upcycled"
        for name in ("upcycle_granularity", "upcycle_router_init"):
            if not upcycled and getattr(self, name) is not None:
                raise ValueError(f"MoEmbConfig.{name} only applies to moe_variant='upcycled', not {self.moe_variant!r}")
        if not upcycled:
            return
        if not is_positive_int(self.upcycle_granularity):
            raise ValueError(
                f"MoEmbConfig.upcycle_granularity must be a positive integer for moe_variant='upcycled' (how many "
                f"slices the dense FFN was cut into), got {self.upcycle_granularity!r}"
            )
        if self.upcycle_router_init is not None:
            require_choice(self, "upcycle_router_init", UPCYCLE_ROUTER_INITS)
        granularity, text = self.upcycle_granularity, self.text_config
        if text.num_experts < granularity:
            raise ValueError(
                f"MoEmbConfig.upcycle_granularity={granularity} exceeds text_config.num_experts={text.num_experts}: "
                "each slice of the dense FFN needs at least one expert"
            )
        if granularity > 1 and text.num_experts_per_tok != granularity:
            raise ValueError(
                f"MoEmbConfig.text_config.num_experts_per_tok={text.num_experts_per_tok} must equal "
                f"upcycle_granularity={granularity}: fine-grained upcycling needs each token to select one replica of "
                "every slice to compute the dense FFN (routed_scaling_factor = granularity assumes it)"
            )

    def _validate_expert_pruning(self) -> None:
        kept, original = self.kept_expert_ids, self.pruned_from_num_experts
        if (kept is None) != (original is None):
            raise ValueError(
                "MoEmbConfig.kept_expert_ids and MoEmbConfig.pruned_from_num_experts describe one expert pruning: "
                f"set both or neither, got kept_expert_ids={kept!r}, pruned_from_num_experts={original!r}"
            )
        if kept is None:
            return
        text = self.text_config
        if self.moe_variant == "modality":
            raise ValueError(
                "MoEmbConfig.kept_expert_ids does not apply to moe_variant='modality': every modality needs its expert"
            )
        if not is_positive_int(text.num_experts) or not is_positive_int(text.num_experts_per_tok):
            return  # the core names the bad size
        if text.num_experts_per_tok > text.num_experts:
            raise ValueError(
                f"MoEmbConfig.text_config.num_experts_per_tok={text.num_experts_per_tok} exceeds the "
                f"text_config.num_experts={text.num_experts} experts kept by expert pruning (kept_expert_ids): every "
                "token needs its top-k experts, so keep at least that many per layer"
            )
        if not is_positive_int(original) or original < text.num_experts:
            raise ValueError(
                f"MoEmbConfig.pruned_from_num_experts={original!r} must be an integer >= text_config.num_experts="
                f"{text.num_experts}: pruning keeps at most the experts a layer had"
            )
        if not isinstance(kept, list) or len(kept) != text.num_hidden_layers:
            raise ValueError(
                f"MoEmbConfig.kept_expert_ids must hold one list of expert ids per layer "
                f"(text_config.num_hidden_layers={text.num_hidden_layers}), got {kept!r}"
            )
        for layer, ids in enumerate(kept):
            if (
                not isinstance(ids, list)
                or len(ids) != text.num_experts
                or not all(is_non_negative_int(expert) and expert < original for expert in ids)
                or ids != sorted(set(ids))
            ):
                raise ValueError(
                    f"MoEmbConfig.kept_expert_ids[{layer}]={ids!r} must be text_config.num_experts={text.num_experts} "
                    f"distinct ascending expert ids below pruned_from_num_experts={original}"
                )

    def _validate_modality_routing(self) -> None:
        if self.moe_variant != "modality":
            if self.modality_expert_map is not None:
                raise ValueError(
                    f"MoEmbConfig.modality_expert_map only applies to moe_variant='modality', not {self.moe_variant!r}"
                )
            return
        for name in ("router_bias", "use_shared_expert", "router_trainable"):
            if getattr(self, name):
                raise ValueError(
                    f"MoEmbConfig.{name}=True does not apply to moe_variant='modality': tokens are routed by "
                    "modality, with neither a router nor a shared expert"
                )
        expert_map = self.modality_expert_map
        num_experts = self.text_config.num_experts
        if (
            not isinstance(expert_map, dict)
            or set(expert_map) != set(TOKEN_MODALITIES)
            or not all(is_non_negative_int(expert) and expert < num_experts for expert in expert_map.values())
        ):
            raise ValueError(
                "MoEmbConfig.modality_expert_map must map each token modality 0 (text), 1 (image), 2 (video) to an "
                f"expert id in [0, text_config.num_experts={num_experts}), got {expert_map!r}"
            )
        if set(expert_map.values()) != set(range(num_experts)):
            raise ValueError(
                f"MoEmbConfig.modality_expert_map {expert_map} uses experts {sorted(set(expert_map.values()))} but "
                f"text_config.num_experts={num_experts}: every expert must serve a modality"
            )
        if self.text_config.num_experts_per_tok != 1:
            raise ValueError(
                "MoEmbConfig.text_config.num_experts_per_tok must be 1 for moe_variant='modality' (one expert per "
                f"token), got {self.text_config.num_experts_per_tok}"
            )


# --- helpers --------------------------------------------------------------------------------------------------------


def _with_integer_keys(mapping: dict | None) -> dict | None:
    """`mapping` with the integer keys that JSON turned into strings made integers again."""
    if not isinstance(mapping, dict):
        return mapping
    return {int(key) if isinstance(key, str) and key.isdigit() else key: value for key, value in mapping.items()}


# --- named configurations ------------------------------------------------------------------------------------------

# Spec §4.4: 8 layers (6 Gated DeltaNet + 2 attention), 8 experts top-4, a 2-block vision tower; <emb> is id 124 of a
# 128-token vocabulary. ~0.64 M parameters.
TINY_MOEMB = dict(
    text_config=dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=4, max_position_embeddings=512,
        pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True),
    ),
    vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
    ),
    image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123, emb_token_id=124,
)

# Paper-scale RoPE (taken from the checkpoints, not transformers' defaults: spec §2.1).
_QWEN3_5_ROPE = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                     mrope_section=[11, 11, 10], mrope_interleaved=True)
_QWEN3_5_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
)

# Spec §4.2. The <emb> id is assigned when a checkpoint is converted (it depends on the tokenizer). Counts (meta
# device, no lm_head): A3B 34.60 B total, 3.39 B active; A10B 121.80 B total, 9.46 B active (the paper's 3.1 B /
# 10.2 B count other things in or out, see the model card).
MOEMB_CONFIGS = {
    "MoEMB-A3B": dict(
        text_config=dict(
            vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6,
            rope_parameters=_QWEN3_5_ROPE,
        ),
        vision_config=dict(_QWEN3_5_VISION, out_hidden_size=2048),
    ),
    # Reconstructed where the paper gives no value (spec §4.2, A-9); conversions read the checkpoint instead.
    "MoEMB-A10B": dict(
        text_config=dict(
            vocab_size=248320, hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024, num_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6,
            rope_parameters=_QWEN3_5_ROPE,
        ),
        vision_config=dict(_QWEN3_5_VISION, out_hidden_size=3072),
    ),
}
