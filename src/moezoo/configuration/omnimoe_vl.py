"""OmniMoE-VL configuration: a SigLIP vision tower and a Qwen3 language model, both upcycled to sparse MoE, joined by
the coupled visual-depth routed projector (spec omnimoe_vl.md §4).

    OmniMoeVlConfig                  projector, routing, exploration and loss fields (spec §4.2, top level)
    ├─ vision_config: OmniMoeVlVisionConfig   every `SiglipVisionConfig` field + the vision experts
    └─ text_config: OmniMoeVlTextConfig       every `Qwen3MoeConfig` field (+ `head_dim`, as Qwen3 has it)

The defaults are the paper's model (SigLIP2-g/16-384 truncated to 37 blocks, Qwen3-8B, 10 streams, top-4 of 10
depths), so `OmniMoeVlConfig()` describes it; `TINY_OMNIMOE_VL` is the spec's tiny test configuration (Appendix S.6).
Every invalid value fails at construction with a `ValueError` that names the field.
"""

from transformers import PreTrainedConfig
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.siglip.configuration_siglip import SiglipVisionConfig

from ..modeling.moe.spec import MoeLayerSpec
from .smoes_settings import SmoesSettings
from .validation import (
    require_choice,
    require_finite,
    require_index_list,
    require_non_negative,
    require_non_negative_ints,
    require_positive,
    require_positive_ints,
    require_token_id,
)


QUERY_GATES = ("participation", "softmax", "none")  # Eq. 3; the "-Q" ablation is "none" (uniform p), spec D12
DEPTH_ROUTERS = ("content", "dense")  # top-k of r/T (Eq. 6-7); the "-R" ablation is "dense" (softmax over all S)
INJECTION_TYPES = ("dynamic", "none")  # Eq. 10-11, or no injection (the LLaVA-style composition)
ROUTE_COUPLINGS = ("shared", "independent")  # one route w for fusion and injection, or one each (Table 3b)
ROUTER_UTILITIES = ("none", "grad")  # L_util off, or the first-order utility of Eq. 13 (spec §3.1, D12)


class OmniMoeVlVisionConfig(SiglipVisionConfig):
    r"""A SigLIP vision tower whose blocks in `moe_layers` hold `num_experts` GELU experts upcycled from the dense MLP.

    Args:
        moe_layers: 0-based blocks with experts (default: the even blocks, the paper's "even-indexed", spec D1).
        num_experts / num_experts_per_tok: experts per MoE block and experts per patch token (top-1 in the paper).
        top1_straight_through: top-1 gate weight `p / p.detach()` (exactly 1, gradient through log p; spec D4).
        router_aux_loss_coef: weight of the load-balancing loss of the vision routers (spec D28).
        initializer_range: std of the routers' initialisation.
    """

    model_type = "omnimoe_vl_vision"
    base_config_key = "vision_config"

    hidden_size: int = 1536
    intermediate_size: int = 6144
    num_hidden_layers: int = 37
    num_attention_heads: int = 16
    image_size: int | list[int] | tuple[int, int] = 384
    patch_size: int | list[int] | tuple[int, int] = 16
    vision_use_head: bool = False
    moe_layers: list[int] | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 1
    top1_straight_through: bool = True
    router_aux_loss_coef: float = 0.01
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.moe_layers is None:
            self.moe_layers = list(range(0, self.num_hidden_layers, 2))
        self.validate_fields()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def moe_layer_spec(self) -> MoeLayerSpec:
        return MoeLayerSpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            expert_intermediate_size=self.intermediate_size,
            expert_type="gelu",
            hidden_act=self.hidden_act,
            straight_through_weights=self.top1_straight_through,
        )

    def validate_fields(self) -> None:
        name = "OmniMoeVlVisionConfig"
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                      "patch_size", "num_experts", "num_experts_per_tok"):
            require_positive_ints(self, field)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{name}.image_size={self.image_size} must be a multiple of patch_size={self.patch_size}: the tower "
                "reads a fixed grid of whole patches"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{name}.num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            )
        require_index_list(self, "moe_layers", self.num_hidden_layers, "num_hidden_layers")
        if self.vision_use_head:
            raise ValueError(
                f"{name}.vision_use_head must be False: OmniMoE-VL reads intermediate streams, not a pooled output"
            )
        if self.top1_straight_through and self.num_experts_per_tok != 1:
            raise ValueError(
                f"{name}.top1_straight_through=True needs num_experts_per_tok=1, got {self.num_experts_per_tok}"
            )
        require_non_negative(self, "router_aux_loss_coef")
        self.moe_layer_spec()  # the core names any remaining bad value


class OmniMoeVlTextConfig(Qwen3MoeConfig):
    r"""A Qwen3 language model upcycled to Qwen3-MoE: the MLP of every layer not in `mlp_only_layers` becomes
    `num_experts` SwiGLU experts (top-`num_experts_per_tok`, renormalised), keys identical to `Qwen3MoeModel`'s.

    Args (beyond `Qwen3MoeConfig`'s):
        head_dim: attention head width (Qwen3 sets it apart from hidden_size / heads).
        mlp_only_layers: default the odd layers, so that the even layers are MoE (spec D1, D27: transformers'
            `decoder_sparse_step=2` would pick the odd ones).
        moe_intermediate_size: the experts' width; upcycled experts are copies of the dense MLP, so it equals
            `intermediate_size` (the conversion sets both).
    """

    model_type = "omnimoe_vl_text"
    base_config_key = "text_config"

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 40960
    moe_intermediate_size: int = 12288
    num_experts_per_tok: int = 2
    num_experts: int = 8
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01

    def __post_init__(self, **kwargs):
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if self.mlp_only_layers is None:
            self.mlp_only_layers = list(range(1, self.num_hidden_layers, 2))
        super().__post_init__(**kwargs)
        self.validate_fields()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' Qwen3-MoE rule, so that a Qwen3-MoE checkpoint has its experts in the same layers."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def moe_layer_spec(self) -> MoeLayerSpec:
        return MoeLayerSpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            expert_intermediate_size=self.moe_intermediate_size,
            hidden_act=self.hidden_act,
            norm_topk_prob=self.norm_topk_prob,
        )

    def validate_fields(self) -> None:
        name = "OmniMoeVlTextConfig"
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "decoder_sparse_step"):
            require_positive_ints(self, field)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}.num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (grouped-query attention)"
            )
        require_index_list(self, "mlp_only_layers", self.num_hidden_layers, "num_hidden_layers")
        require_non_negative(self, "router_aux_loss_coef")
        self.moe_layer_spec()


class OmniMoeVlConfig(PreTrainedConfig):
    r"""OmniMoE-VL (spec §4.2). Field groups, each with the paper's value as default:

    Tokens and taps:
        image_token_id / vision_start_token_id / vision_end_token_id: `<|image_pad|>`, `<|vision_start|>`,
            `<|vision_end|>` of the Qwen3 tokenizer.
        vision_feature_layers: the stream taps, indices into the vision tower's `hidden_states` (1-based block
            outputs, before any final norm): stream s is `hidden_states[vision_feature_layers[s]]`.
        injection_layers: the 0-based language block that stream s is injected before (anchor a(s), spec D1).
    Query synthesis (Eq. 3-5): num_query_prototypes (Q), num_router_queries (R), query_floor (epsilon_q),
        query_mix_temperature (tau_q), query_residual_scale (rho), participation_target_offset / _min / _max
        (n_tgt = clip(ln(1 + L_T) + offset, min, max); `None` max means Q), query_gate.
    Depth routing (Eq. 6-7): depth_top_k (k), depth_temperature (T), route_entropy_coef (lambda_e, which divides the
        exploration logits by lambda_h + lambda_e), depth_router.
    Patch fusion (Eq. 8-9): fusion_group_size, fusion_top_k (k_loc), fusion_temperature (tau_g), fusion_log_floor
        (epsilon_w).
    Injection (Eq. 10-11): injection_rank (r_T), adapter_rank (r_G), injection_gate_init (0: the converted model is
        the injection-free composition), injection_max_relative_norm (rho_max of the per-token norm clamp, `None` off),
        route_coupling, injection_type.
    Projector internals: projector_attn_dim / projector_attn_heads (cross-attention width and heads, spec D6),
        depth_score_hidden (hidden width of the per-depth score MLP f_s, spec D7).
    Exploration (Eq. 7, training only, for the first `exploration_steps` routing steps): usage_ema_decay,
        prior_dirichlet_alpha (alpha), prior_kernel_width (gamma), prior_coef (lambda_h), underuse_bonus_coef
        (lambda_b), underuse_eps, exploration_noise_std (sigma).
    Auxiliary losses (spec §3.1): *_coef weights, *_min_scale / *_anneal_steps of the linear schedules,
        query_entropy_sign (+1 maximises the participation entropy), router_utility, adapter_factor_reg_coef.
    SMoES: smoes, the routing regulariser of the language experts (`moezoo.modeling.smoes.enable_smoes`) as the dict
        of a `SmoesSettings` (`moezoo.configuration.smoes_settings`), None for none: each language MoE layer then
        holds SMoES buffers, and in training the SMoES losses replace the language experts' load balancing.
    """

    model_type = "omnimoe_vl"
    sub_configs_defaults = {"vision_config": OmniMoeVlVisionConfig, "text_config": OmniMoeVlTextConfig}

    vision_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    vision_feature_layers: list[int] | None = None
    injection_layers: list[int] | None = None
    # query synthesis
    num_query_prototypes: int = 16
    num_router_queries: int = 8
    query_floor: float = 1e-4
    query_mix_temperature: float = 0.9
    query_residual_scale: float = 1.0
    participation_target_offset: float = 4.0
    participation_target_min: float = 2.0
    participation_target_max: float | None = None
    query_gate: str = "participation"
    # depth routing
    depth_top_k: int = 4
    depth_temperature: float = 1.0
    route_entropy_coef: float = 0.0
    depth_router: str = "content"
    # patch fusion
    fusion_group_size: int = 32
    fusion_top_k: int = 4
    fusion_temperature: float = 0.7
    fusion_log_floor: float = 1e-12
    # injection
    injection_rank: int = 32
    adapter_rank: int = 32
    injection_gate_init: float = 0.0
    injection_max_relative_norm: float | None = 1.0
    route_coupling: str = "shared"
    injection_type: str = "dynamic"
    # projector internals
    projector_attn_dim: int = 1024
    projector_attn_heads: int = 8
    depth_score_hidden: int = 1024
    # exploration
    exploration_steps: int = 12000
    usage_ema_decay: float = 0.99
    prior_dirichlet_alpha: float = 1.0
    prior_kernel_width: float = 1.0
    prior_coef: float = 1.0
    underuse_bonus_coef: float = 1.0
    underuse_eps: float = 1e-3
    exploration_noise_std: float = 1.0
    # auxiliary losses
    query_budget_coef: float = 0.35
    query_budget_min_scale: float = 0.05
    query_budget_anneal_steps: int = 12000
    query_entropy_coef: float = 0.35
    query_entropy_min_scale: float = 0.10
    query_entropy_anneal_steps: int = 12000
    query_entropy_sign: int = 1
    query_diversity_coef: float = 1.0
    router_query_diversity_coef: float = 0.05
    router_utility_coef: float = 0.35
    router_utility: str = "none"  # the paper's "grad" costs one more backward through the LM: opt-in (spec D12)
    depth_balance_coef: float = 0.01
    depth_balance_min_scale: float = 0.25
    depth_balance_anneal_steps: int = 18000
    adapter_factor_reg_coef: float = 0.0
    initializer_range: float = 0.02
    smoes: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.vision_feature_layers is None:
            self.vision_feature_layers = list(range(1, 38, 4))  # blocks 1, 5, ..., 37 (spec §2.1)
        if self.injection_layers is None:
            self.injection_layers = list(range(len(self.vision_feature_layers)))  # a(s) = s, 1-based (spec D1)
        super().__post_init__(**kwargs)  # builds the sub-configs from dicts / defaults
        if self.participation_target_max is None:
            self.participation_target_max = float(self.num_query_prototypes)
        self.validate_fields()

    @property
    def num_streams(self) -> int:
        return len(self.vision_feature_layers)

    @property
    def num_image_tokens(self) -> int:
        """Placeholders per image: one fused token per patch (576 at 384 px, patch 16)."""
        return self.vision_config.num_patches

    def validate_fields(self) -> None:
        name = "OmniMoeVlConfig"
        vision, text = self.vision_config, self.text_config
        if vision.model_type != OmniMoeVlVisionConfig.model_type:
            raise ValueError(f"{name}.vision_config must be an OmniMoeVlVisionConfig, got {vision.model_type!r}")
        if text.model_type != OmniMoeVlTextConfig.model_type:
            raise ValueError(f"{name}.text_config must be an OmniMoeVlTextConfig, got {text.model_type!r}")
        tokens = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
        for field in tokens:
            require_token_id(self, field, text.vocab_size)
        if len({getattr(self, field) for field in tokens}) != len(tokens):
            raise ValueError(f"{name}.{', '.join(tokens)} must be three different tokens")
        taps = self.vision_feature_layers
        require_index_list(self, "vision_feature_layers", vision.num_hidden_layers + 1,
                           "vision_config.num_hidden_layers + 1")
        if not taps or taps != sorted(taps) or 0 in taps:
            raise ValueError(
                f"{name}.vision_feature_layers={taps} must be increasing block outputs >= 1 (hidden_states[0] is the "
                "patch embedding, no block's output)"
            )
        require_index_list(self, "injection_layers", text.num_hidden_layers, "text_config.num_hidden_layers")
        if len(self.injection_layers) != len(taps):
            raise ValueError(
                f"{name}.injection_layers has {len(self.injection_layers)} entries but vision_feature_layers has "
                f"{len(taps)}: each stream needs its anchor layer"
            )
        for field in ("num_query_prototypes", "num_router_queries", "depth_top_k", "fusion_group_size",
                      "fusion_top_k", "injection_rank", "adapter_rank", "projector_attn_dim", "projector_attn_heads",
                      "depth_score_hidden"):
            require_positive_ints(self, field)
        for field in ("depth_top_k", "fusion_top_k"):
            if getattr(self, field) > self.num_streams:
                raise ValueError(
                    f"{name}.{field}={getattr(self, field)} exceeds the number of streams {self.num_streams} "
                    "(len(vision_feature_layers))"
                )
        if self.projector_attn_dim % self.projector_attn_heads:
            raise ValueError(
                f"{name}.projector_attn_heads={self.projector_attn_heads} must divide projector_attn_dim="
                f"{self.projector_attn_dim}"
            )
        if not 0 <= self.query_floor * self.num_query_prototypes < 1:
            raise ValueError(
                f"{name}.query_floor={self.query_floor} must lie in [0, 1 / num_query_prototypes): p = (1 - Q eps) "
                "softmax(u) + eps must stay a distribution"
            )
        for field in ("query_mix_temperature", "depth_temperature", "fusion_temperature", "prior_kernel_width",
                      "underuse_eps", "initializer_range"):
            require_positive(self, field)
        if not 0 < self.fusion_log_floor < 1:
            raise ValueError(f"{name}.fusion_log_floor must lie in (0, 1), got {self.fusion_log_floor!r}")
        if not 0 <= self.usage_ema_decay < 1:
            raise ValueError(f"{name}.usage_ema_decay must lie in [0, 1), got {self.usage_ema_decay!r}")
        for field in ("query_residual_scale", "route_entropy_coef", "prior_dirichlet_alpha", "prior_coef",
                      "underuse_bonus_coef", "exploration_noise_std", "query_budget_coef", "query_entropy_coef",
                      "query_diversity_coef", "router_query_diversity_coef", "router_utility_coef",
                      "depth_balance_coef", "adapter_factor_reg_coef", "participation_target_offset"):
            require_non_negative(self, field)
        if self.prior_coef + self.route_entropy_coef <= 0:
            raise ValueError(f"{name}.prior_coef + route_entropy_coef must be > 0: it is the exploration temperature")
        if not 0 < self.participation_target_min <= self.participation_target_max:
            raise ValueError(
                f"{name}.participation_target_min={self.participation_target_min} must be > 0 and <= "
                f"participation_target_max={self.participation_target_max}"
            )
        require_non_negative_ints(self, "exploration_steps", "query_budget_anneal_steps", "query_entropy_anneal_steps",
                                  "depth_balance_anneal_steps")
        for field in ("query_budget_min_scale", "query_entropy_min_scale", "depth_balance_min_scale"):
            if not 0 <= getattr(self, field) <= 1:
                raise ValueError(f"{name}.{field} must lie in [0, 1], got {getattr(self, field)!r}")
        if self.query_entropy_sign not in (1, -1):
            raise ValueError(f"{name}.query_entropy_sign must be 1 or -1, got {self.query_entropy_sign!r}")
        require_finite(self, "injection_gate_init")
        if self.injection_max_relative_norm is not None:
            require_positive(self, "injection_max_relative_norm")
        for field, choices in (("query_gate", QUERY_GATES), ("depth_router", DEPTH_ROUTERS),
                               ("injection_type", INJECTION_TYPES), ("route_coupling", ROUTE_COUPLINGS),
                               ("router_utility", ROUTER_UTILITIES)):
            require_choice(self, field, choices)
        settings = self.smoes_settings()
        if settings is not None:  # every language layer is softmax attention
            settings.check_host(text.num_experts, text.num_hidden_layers)
            self.smoes = settings.to_dict()  # every field, so that a saved config keeps the settings it ran with

    def smoes_settings(self) -> SmoesSettings | None:
        """The SMoES settings of `smoes` (None: no SMoES)."""
        return SmoesSettings.from_dict(self.smoes, "OmniMoeVlConfig.smoes")


# --- named configurations ------------------------------------------------------------------------------------------

# Spec Appendix S.6: 6 vision blocks (MoE at 0, 2, 4), 6 language layers (MoE at 0, 2, 4), 3 streams, top-2 of 3.
TINY_OMNIMOE_VL = dict(
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, image_size=64,
                       patch_size=16, moe_layers=[0, 2, 4], num_experts=8, num_experts_per_tok=1),
    text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                     num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, mlp_only_layers=[1, 3, 5], max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}, pad_token_id=0),
    image_token_id=150, vision_start_token_id=151, vision_end_token_id=152,
    vision_feature_layers=[1, 3, 5], injection_layers=[0, 1, 2],
    num_query_prototypes=6, num_router_queries=3, depth_top_k=2, fusion_top_k=2, fusion_group_size=4,
    injection_rank=4, adapter_rank=4, projector_attn_dim=64, projector_attn_heads=4, depth_score_hidden=16,
    exploration_steps=50, exploration_noise_std=0.5, router_utility="none", router_utility_coef=0.0,
    injection_max_relative_norm=None, query_budget_anneal_steps=50, query_entropy_anneal_steps=50,
    depth_balance_anneal_steps=75,
)
