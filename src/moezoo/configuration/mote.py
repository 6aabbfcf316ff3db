"""MoTE configurations: decoders whose FFNs are named task experts plus a shared expert (spec mote.md §4).

A MoTE model is a transformers model with one change: the FFN of each converted decoder layer is replaced by routed
task experts and an always-active shared expert, and every example is routed to one expert by an integer task id.
The configs are therefore transformers' own configs plus the `mote_*` fields of spec §4.1, which live on the
*text* (decoder) config:

    GlmOcrMoteConfig     = GlmOcrConfig    with text_config = GlmOcrMoteTextConfig (GlmOcrTextConfig + mote_*)
    LlamaMoteConfig      = LlamaConfig     + mote_*                                 (text-only, and VideoLLM's decoder)
    VideoLlmMoteConfig   = SigLIP vision config + LlamaMoteConfig + the video fields of spec §4.2

The expert registry is `mote_expert_names` (route id -> expert name, 0-based) and `mote_expert_descriptions`
(expert name -> natural-language description, read by the prompt route selector). Every change to the experts goes
through `add_mote_expert` / `remove_mote_expert`, which keep both in sync; a saved model therefore reloads with its
experts. Every invalid value raises a `ValueError` naming the field.
"""

import copy
import re
from dataclasses import dataclass

from torch import nn
from transformers import (
    GlmOcrConfig,
    GlmOcrTextConfig,
    GlmOcrVisionConfig,
    LlamaConfig,
    PreTrainedConfig,
    SiglipVisionConfig,
)

from .validation import (
    is_int,
    require_activation,
    require_choice,
    require_non_negative,
    require_positive,
    require_positive_ints,
    require_token_id,
)


ROUTING_MODES = ("task", "dense", "token_top1", "sample_top1")
# The ablation modes whose routes come from a learned router instead of `task_ids` (spec §2.5).
LEARNED_ROUTING_MODES = ("token_top1", "sample_top1")
EXPERT_CONSTRUCTIONS = ("copy", "split")
SHARED_EXPERT_INITS = ("zero_down", "copy_half", "copy", "split")
STREAM_SILENCE_TOKENS = ("eos", "interval")
EXPERT_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
# Expert names become attribute names of an nn.ModuleDict (`mlp.experts.<name>`); these would shadow its methods.
RESERVED_EXPERT_NAMES = frozenset(name for name in dir(nn.ModuleDict) if not name.startswith("_"))

# Spec §6.4 (the paper's Table 11 is missing from the text): the default description of each known route.
DEFAULT_EXPERT_DESCRIPTIONS = {
    "step": "recognize the current action step in the video",
    "next": "predict the next step",
    "task": "identify the overall procedure",
    "proc": "forecast the sequence of upcoming steps",
    "proc_plus": "forecast upcoming steps given the task goal",
    "ego4d_narration": "narrate the video in real time",
    "ocr": "recognize and transcribe the text in the document",
    "kie": "extract key fields from a receipt as JSON",
}


def check_expert_name(name, existing=()) -> None:
    """Raise a `ValueError` saying what to change if `name` cannot name a new expert."""
    if not isinstance(name, str) or not EXPERT_NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"expert name {name!r} is not valid: use lowercase letters, digits and underscores, starting with a "
            "letter (e.g. 'proc_plus'); the name becomes a module attribute (mlp.experts.<name>)"
        )
    if name in RESERVED_EXPERT_NAMES:
        raise ValueError(
            f"expert name {name!r} clashes with an attribute of nn.ModuleDict, which holds the experts; choose "
            f"another name (e.g. '{name}_expert')"
        )
    if name in existing:
        raise ValueError(f"an expert named {name!r} already exists (experts: {list(existing)}); choose another name")


@dataclass(kw_only=True, repr=False)
class MoteTextConfigMixin:
    r"""The MoTE fields of a decoder config (spec §4.1), placed before the transformers config in the bases.

    Args:
        mote_expert_names: route id -> expert name. `None` or `[]` is the dense model (no expert, plain FFNs).
        mote_expert_descriptions: expert name -> description for the prompt route selector; a subset of the names.
        mote_num_shared_experts: 1 for an always-active shared expert, 0 for none.
        mote_routed_expert_scale / mote_shared_expert_scale: lambda_task and lambda_sh of
            `out = lambda_sh F_sh(x) + lambda_task F_r(x)` (fixed floats, not parameters; spec A25).
        mote_layers: indices of the decoder layers whose FFN becomes experts; `None` means every layer.
        mote_routing_mode: `"task"` (MoTE: one expert per example from `task_ids`), or the ablations of §2.5:
            `"dense"` (the mean of all experts), `"token_top1"` (a learned top-1 router per layer and token),
            `"sample_top1"` (one learned route per example from its mean prompt embedding).
        mote_router_aux_loss_coef: weight of the load-balancing loss of the learned-router ablations.
        mote_default_route: the expert used when `task_ids` is not given; `None` makes `task_ids` required.
        mote_expert_intermediate_size: width of one expert's FFN; `None` is the dense width (`intermediate_size`).
            The `split` construction sets it to the dense width over the number of experts (shared included),
            rounded up.
        mote_init: provenance of the conversion, `{"experts": "copy", "shared": "zero_down" | "copy_half" |
            "copy"}` or `{"experts": "split", "shared": "split"}` (spec §5.3).
        mote_base_model: the dense checkpoint the model was converted from (path or Hub id), for adding experts
            initialised from the dense FFN.
    """

    mote_expert_names: list[str] | None = None
    mote_expert_descriptions: dict[str, str] | None = None
    mote_num_shared_experts: int = 1
    mote_routed_expert_scale: float = 1.0
    mote_shared_expert_scale: float = 1.0
    mote_layers: list[int] | None = None
    mote_routing_mode: str = "task"
    mote_router_aux_loss_coef: float = 0.01
    mote_default_route: str | None = None
    mote_expert_intermediate_size: int | None = None
    mote_init: dict | None = None
    mote_base_model: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.mote_expert_names is None:
            self.mote_expert_names = []
        if self.mote_expert_descriptions is None:
            self.mote_expert_descriptions = {}
        self.validate_mote_fields()

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The dense plan, with each FFN rule repeated for the shared expert and every named expert (the plans
        match module names literally, apart from layer numbers). The dense FFN rules stay only while some layer
        keeps its dense FFN: transformers reads a rule that matches no parameter as a typo in the plan."""
        has_dense_layers = not all(self.is_mote_layer(index) for index in range(self.num_hidden_layers))
        plan = {}
        for pattern, style in super().base_model_tp_plan.items():
            if ".mlp." not in pattern:
                plan[pattern] = style
                continue
            if has_dense_layers:
                plan[pattern] = style
            if self.mote_expert_names:
                prefix, projection = pattern.split(".mlp.")
                if self.mote_num_shared_experts:
                    plan[f"{prefix}.mlp.shared_expert.{projection}"] = style
                for name in self.mote_expert_names:
                    plan[f"{prefix}.mlp.experts.{name}.{projection}"] = style
        return plan

    def is_mote_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has task experts (otherwise it keeps its dense FFN)."""
        return bool(self.mote_expert_names) and (self.mote_layers is None or layer_idx in self.mote_layers)

    def mote_expert_config(self):
        """The config one expert FFN is built from: this config, with the expert width if it differs."""
        width = self.mote_expert_intermediate_size
        if width is None or width == self.intermediate_size:
            return self
        expert_config = copy.copy(self)
        expert_config.intermediate_size = width
        return expert_config

    def mote_route_id(self, name: str) -> int:
        """The route id (`task_ids` value) of expert `name`. Ids shift when an earlier expert is removed, so
        address routes by name."""
        if name not in self.mote_expert_names:
            raise ValueError(f"no expert named {name!r}; the experts are {self.mote_expert_names}")
        return self.mote_expert_names.index(name)

    def add_mote_expert(self, name: str, description: str | None = None) -> None:
        """Append `name` to the registry (it gets the next route id), with its description if given."""
        check_expert_name(name, self.mote_expert_names)
        if description is not None and not isinstance(description, str):
            raise ValueError(f"the description of expert {name!r} must be a string, got {description!r}")
        self.mote_expert_names = [*self.mote_expert_names, name]
        if description is not None:
            self.mote_expert_descriptions = {**self.mote_expert_descriptions, name: description}

    def remove_mote_expert(self, name: str, force: bool = False) -> None:
        """Remove `name` and its description. The experts after it move down one route id. Removing the default
        route needs `force=True` (the default route becomes `None`); the last expert cannot be removed."""
        self.mote_route_id(name)
        if len(self.mote_expert_names) == 1:
            raise ValueError(
                f"cannot remove {name!r}, the only expert: a MoTE layer needs at least one routed expert. Add its "
                "replacement first (add_expert), then remove it"
            )
        if name == self.mote_default_route:
            if not force:
                raise ValueError(
                    f"{name!r} is the default route (mote_default_route), used when no task_ids are given; pass "
                    "force=True to remove it anyway (the model then requires task_ids)"
                )
            self.mote_default_route = None
        self.mote_expert_names = [expert for expert in self.mote_expert_names if expert != name]
        self.mote_expert_descriptions = {
            expert: text for expert, text in self.mote_expert_descriptions.items() if expert != name
        }

    def validate_mote_fields(self) -> None:
        owner = type(self).__name__
        names = self.mote_expert_names
        if not isinstance(names, list):
            raise ValueError(f"{owner}.mote_expert_names must be a list of expert names, got {names!r}")
        for index, name in enumerate(names):
            try:
                check_expert_name(name, names[:index])
            except ValueError as error:
                raise ValueError(f"{owner}.mote_expert_names: {error}") from None
        descriptions = self.mote_expert_descriptions
        if not isinstance(descriptions, dict):
            raise ValueError(
                f"{owner}.mote_expert_descriptions must map expert names to descriptions, got {descriptions!r}"
            )
        unknown = [name for name in descriptions if name not in names]
        if unknown:
            raise ValueError(
                f"{owner}.mote_expert_descriptions describes {unknown}, which are not in mote_expert_names={names}; "
                "descriptions are keyed by expert name"
            )
        not_text = {name: text for name, text in descriptions.items() if not isinstance(text, str)}
        if not_text:
            raise ValueError(f"{owner}.mote_expert_descriptions values must be strings, got {not_text!r}")
        if self.mote_num_shared_experts not in (0, 1) or isinstance(self.mote_num_shared_experts, bool):
            raise ValueError(
                f"{owner}.mote_num_shared_experts must be 0 or 1 (MoTE has at most one shared expert), got "
                f"{self.mote_num_shared_experts!r}"
            )
        require_non_negative(self, "mote_routed_expert_scale", "mote_shared_expert_scale", "mote_router_aux_loss_coef")
        require_choice(self, "mote_routing_mode", ROUTING_MODES)
        if self.mote_default_route is not None and self.mote_default_route not in names:
            raise ValueError(
                f"{owner}.mote_default_route={self.mote_default_route!r} is not an expert; choose one of {names} "
                "or None"
            )
        layers = self.mote_layers
        if layers is not None and (
            not isinstance(layers, list)
            or any(not is_int(i) or not 0 <= i < self.num_hidden_layers for i in layers)
            or layers != sorted(set(layers))
        ):
            raise ValueError(
                f"{owner}.mote_layers must be None (every layer) or a sorted list of distinct layer indices in "
                f"[0, num_hidden_layers={self.num_hidden_layers}), got {layers!r}"
            )
        width = self.mote_expert_intermediate_size
        if width is not None and (not is_int(width) or width <= 0):
            raise ValueError(f"{owner}.mote_expert_intermediate_size must be None or a positive integer, got {width!r}")
        if self.mote_init is not None:
            if not isinstance(self.mote_init, dict) or set(self.mote_init) != {"experts", "shared"}:
                raise ValueError(
                    f"{owner}.mote_init must be None or {{'experts': ..., 'shared': ...}}, got {self.mote_init!r}"
                )
            if self.mote_init["experts"] not in EXPERT_CONSTRUCTIONS:
                raise ValueError(
                    f"{owner}.mote_init['experts']={self.mote_init['experts']!r} is not one of {EXPERT_CONSTRUCTIONS}"
                )
            if self.mote_init["shared"] not in SHARED_EXPERT_INITS:
                raise ValueError(
                    f"{owner}.mote_init['shared']={self.mote_init['shared']!r} is not one of {SHARED_EXPERT_INITS}"
                )
            if (self.mote_init["experts"] == "split") != (self.mote_init["shared"] == "split"):
                raise ValueError(
                    f"{owner}.mote_init={self.mote_init!r}: the split construction splits the shared expert too "
                    "({'experts': 'split', 'shared': 'split'}); copies go with zero_down, copy_half or copy"
                )
            if self.mote_init["shared"] == "copy_half" and not self.mote_num_shared_experts:
                raise ValueError(
                    f"{owner}.mote_init['shared']='copy_half' needs a shared expert, but {owner}."
                    "mote_num_shared_experts=0: copy_half scales each routed expert by 0.5 and leaves the other half "
                    "of the dense FFN to the shared expert; without one every route computes 0.5 * FFN(x)"
                )
        if self.mote_base_model is not None and not isinstance(self.mote_base_model, str):
            raise ValueError(f"{owner}.mote_base_model must be a path or Hub id, got {self.mote_base_model!r}")


class LlamaMoteConfig(MoteTextConfigMixin, LlamaConfig):
    r"""Llama with task experts: the text-only `LlamaMoteForCausalLM` and the decoder of VideoLLM-MoTE. The fields
    are `LlamaConfig`'s plus the `mote_*` fields of `MoteTextConfigMixin`."""

    model_type = "llama_mote"
    base_config_key = "text_config"


class GlmOcrMoteTextConfig(MoteTextConfigMixin, GlmOcrTextConfig):
    r"""The GLM-OCR decoder with task experts: `GlmOcrTextConfig`'s fields plus the `mote_*` fields."""

    model_type = "glm_ocr_mote_text"
    base_config_key = "text_config"


class GlmOcrMoteConfig(GlmOcrConfig):
    r"""GLM-OCR-MoTE: GLM-OCR's vision tower and merger, unchanged, and a decoder with task experts (spec §4.3). The
    token ids are GLM-OCR's."""

    model_type = "glm_ocr_mote"
    sub_configs_defaults = {"vision_config": GlmOcrVisionConfig, "text_config": GlmOcrMoteTextConfig}

    def __post_init__(self, **kwargs):
        default_vision = self.vision_config is None
        super().__post_init__(**kwargs)
        if default_vision:
            # GlmOcrConfig's default towers disagree (its merger writes 1536-wide features into a 1024-wide decoder);
            # a default vision tower writes features as wide as the decoder it feeds.
            self.vision_config.out_hidden_size = self.text_config.hidden_size
        if self.vision_config.out_hidden_size != self.text_config.hidden_size:
            raise ValueError(
                f"GlmOcrMoteConfig.vision_config.out_hidden_size={self.vision_config.out_hidden_size} must equal "
                f"text_config.hidden_size={self.text_config.hidden_size}: the merger writes image features into the "
                "decoder's embeddings"
            )


class VideoLlmMoteConfig(PreTrainedConfig):
    r"""VideoLLM-MoTE: a frozen SigLIP vision tower, a two-layer MLP projector and a Llama decoder with task experts
    (spec §2.7, §4.2). Each frame becomes `frame_num_tokens` tokens: SigLIP's attention-pooled output (the "CLS") and
    an average-pooled `frame_token_pooled` grid of its patch tokens, in row-major order.

    Args:
        video_token: the placeholder `<v>` of each frame token; a reserved Llama-3 special token, so that the
            embedding table keeps its size (spec A17).
        video_token_id: its id.
        frame_token_interval_id: id of the `,` between frames.
        frame_token_cls: whether a frame's tokens start with the attention-pooled output.
        frame_token_pooled: rows and columns of the pooled grid of patch tokens.
        frame_num_tokens: tokens per frame, `frame_token_cls + rows * cols`.
        frame_fps / max_num_frames / frame_resolution: the processor's sampling rate, frame cap and letterbox size
            (the vision tower's `image_size`).
        projector_hidden_act / multimodal_projector_bias: the projector `linear_1 -> act -> linear_2`.
        stream_loss_weight: `w`, the weight of the streaming-silence terms of the loss (positions whose input is
            `<v>`), spec §3.1.
        stream_silence_token: what a silent frame predicts, `"eos"` (the paper) or `"interval"` (VideoLLM-online).
    """

    model_type = "videollm_mote"
    sub_configs_defaults = {"text_config": LlamaMoteConfig, "vision_config": SiglipVisionConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    video_token: str = "<|reserved_special_token_0|>"
    video_token_id: int = 128002
    frame_token_interval_id: int = 11
    frame_token_cls: bool = True
    frame_token_pooled: list[int] | None = None
    frame_num_tokens: int = 10
    frame_fps: float = 2.0
    max_num_frames: int = 1200
    frame_resolution: int = 384
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    stream_loss_weight: float = 1.0
    stream_silence_token: str = "eos"
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.frame_token_pooled is None:
            self.frame_token_pooled = [3, 3]
        # The default towers are the paper's (Llama-3.2-1B-Instruct, SigLIP 2 ViT-L/16-384), which the default token
        # ids and frame resolution belong to; the sub-config classes' own defaults describe other models.
        if self.text_config is None:
            self.text_config = dict(LLAMA_3_2_1B_INSTRUCT)
        if self.vision_config is None:
            self.vision_config = dict(SIGLIP2_LARGE_PATCH16_384_VISION)
        super().__post_init__(**kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        vocab_size = self.text_config.vocab_size
        for field in ("video_token_id", "frame_token_interval_id"):
            require_token_id(self, field, vocab_size)
        if self.video_token_id == self.frame_token_interval_id:
            raise ValueError(
                f"VideoLlmMoteConfig.video_token_id and VideoLlmMoteConfig.frame_token_interval_id are both "
                f"{self.video_token_id}: the frame placeholder and the separator between frames must be different "
                "tokens"
            )
        pooled = self.frame_token_pooled
        if not isinstance(pooled, list) or len(pooled) != 2 or any(not is_int(n) or n <= 0 for n in pooled):
            raise ValueError(f"VideoLlmMoteConfig.frame_token_pooled must be [rows, cols] > 0, got {pooled!r}")
        expected = int(bool(self.frame_token_cls)) + pooled[0] * pooled[1]
        if self.frame_num_tokens != expected:
            raise ValueError(
                f"VideoLlmMoteConfig.frame_num_tokens={self.frame_num_tokens!r} must equal frame_token_cls + "
                f"rows * cols of frame_token_pooled = {expected}"
            )
        if self.frame_resolution != self.vision_config.image_size:
            raise ValueError(
                f"VideoLlmMoteConfig.frame_resolution={self.frame_resolution!r} must equal vision_config.image_size="
                f"{self.vision_config.image_size}: SigLIP's learned positions fix the frame size"
            )
        require_positive(self, "frame_fps")
        require_positive_ints(self, "max_num_frames")
        require_activation(self, "projector_hidden_act")
        require_non_negative(self, "stream_loss_weight")
        require_choice(self, "stream_silence_token", STREAM_SILENCE_TOKENS)
        if not self.vision_config.vision_use_head and self.frame_token_cls:
            raise ValueError(
                "VideoLlmMoteConfig.frame_token_cls=True needs vision_config.vision_use_head=True: the frame's first "
                "token is SigLIP's attention-pooled output"
            )


# --- named configurations ------------------------------------------------------------------------------------------

COIN_EXPERTS = ["step", "next", "proc", "task", "proc_plus"]


def _descriptions(names: list[str]) -> dict[str, str]:
    return {name: DEFAULT_EXPERT_DESCRIPTIONS[name] for name in names}


def _mote_fields(names: list[str], default_route: str | None = None, base_model: str | None = None) -> dict:
    return dict(
        mote_expert_names=list(names), mote_expert_descriptions=_descriptions(names), mote_num_shared_experts=1,
        mote_routed_expert_scale=1.0, mote_shared_expert_scale=1.0, mote_routing_mode="task",
        mote_default_route=default_route, mote_init={"experts": "copy", "shared": "zero_down"},
        mote_base_model=base_model,
    )


# Spec §4.4: the tiny decoders, vision towers and token ids the tests use (fp32, 2 layers).
TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TINY_SIGLIP_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
    vision_use_head=True,
)
TINY_GLM_OCR = dict(
    text_config=dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=0,
        eos_token_id=[1, 2],
        # mrope_section sums to head_dim / 2
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                         "partial_rotary_factor": 1.0},
    ),
    vision_config=dict(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, image_size=16, rms_norm_eps=1e-5,
    ),
    image_token_id=100, video_token_id=101, image_start_token_id=102, image_end_token_id=103,
    video_start_token_id=104, video_end_token_id=105, tie_word_embeddings=False,
)

TINY_LLAMA_MOTE = TINY_LLAMA | _mote_fields(COIN_EXPERTS)
TINY_GLM_OCR_MOTE = TINY_GLM_OCR | dict(text_config=TINY_GLM_OCR["text_config"] | _mote_fields(["ocr", "kie"], "ocr"))
TINY_VIDEOLLM_MOTE = dict(
    text_config=TINY_LLAMA_MOTE, vision_config=TINY_SIGLIP_VISION, video_token="<v>", video_token_id=120,
    frame_token_interval_id=11, frame_token_cls=True, frame_token_pooled=[3, 3], frame_num_tokens=10, frame_fps=2.0,
    max_num_frames=16, frame_resolution=32, projector_hidden_act="gelu", multimodal_projector_bias=True,
    stream_loss_weight=1.0, stream_silence_token="eos", tie_word_embeddings=True,
)

# Spec §4.3: the real checkpoints' configurations (from their Hub config.json).
LLAMA_3_2_1B_INSTRUCT = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# SigLIP 2 ViT-L/16-384 (FixRes: model_type siglip), spec §2.7.
SIGLIP2_LARGE_PATCH16_384_VISION = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=384,
    patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True,
)
GLM_OCR = dict(
    text_config=dict(
        vocab_size=59392, hidden_size=1536, intermediate_size=4608, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, pad_token_id=59246, eos_token_id=[59246, 59253],
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 10000.0,
                         "partial_rotary_factor": 1.0},
    ),
    vision_config=dict(
        depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=1536, attention_bias=True, image_size=336,
    ),
    image_token_id=59280, video_token_id=59281, image_start_token_id=59256, image_end_token_id=59257,
    video_start_token_id=59258, video_end_token_id=59259, tie_word_embeddings=False,
)


def _videollm(names: list[str]) -> dict:
    return dict(
        text_config=LLAMA_3_2_1B_INSTRUCT | _mote_fields(names, base_model="meta-llama/Llama-3.2-1B-Instruct"),
        vision_config=SIGLIP2_LARGE_PATCH16_384_VISION, video_token="<|reserved_special_token_0|>",
        video_token_id=128002, frame_token_interval_id=11, frame_fps=2.0, max_num_frames=1200, frame_resolution=384,
    )


# The paper's models (spec §1): keyword arguments of VideoLlmMoteConfig / GlmOcrMoteConfig.
VIDEOLLM_MOTE_CONFIGS = {
    "VideoLLM-MoTE-1B+5E": _videollm(COIN_EXPERTS),
    "VideoLLM-MoTE-1B+6E": _videollm(["ego4d_narration", *COIN_EXPERTS]),
}
GLM_OCR_MOTE_CONFIGS = {
    "GLM-OCR-MoTE-0.9B+2E": GLM_OCR | dict(
        text_config=GLM_OCR["text_config"] | _mote_fields(["ocr", "kie"], "ocr", base_model="zai-org/GLM-OCR")
    ),
}
