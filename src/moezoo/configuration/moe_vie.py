"""MoE-ViE configurations: a CLIP-style dual encoder whose vision tower is a fine-grained sparse MoE.

Defaults are the official MoE-ViE-B/16 (spec moe_vie.md §2.5, §5.1): 2D RoPE, SwiGLU, pre-LN, no post-LN, attention
pooling and a 1024-d projection in the vision tower; a causal text tower pooled at the first EOS, without final LN;
the softmax (InfoNCE) loss. The SigLIP-family profile that upcycled SigLIP/SigLIP2 checkpoints use (learned
positions, GELU, post-LN, bidirectional text pooled at the last token, sigmoid loss) is the same classes with other
field values (spec §5.1, "Profile for SigLIP2-upcycled models").

Every invalid value fails at construction with a `ValueError` that names the field.
"""

import math

from transformers import PreTrainedConfig
from ..modeling.moe.spec import MoeLayerSpec
from .validation import (
    is_non_negative_int,
    is_positive_int,
    require_activation,
    require_bools,
    require_choice,
    require_divides,
    require_finite,
    require_non_negative,
    require_non_negative_ints,
    require_positive,
    require_positive_ints,
    require_probability,
)


class MoeVieVisionConfig(PreTrainedConfig):
    r"""The vision tower. MoE fields follow DeepSeek-V3's names; `num_experts_per_tok` is the *routed* top-k: the
    paper's "k activated experts" is `num_experts_per_tok + n_shared_experts` (spec §11, item 1).

    Args:
        image_size: the processor's default square resolution; RoPE itself has no fixed grid.
        mlp_type: `"swiglu"` (`gate/up/down_proj`) or `"gelu"` (`fc1/fc2`, the SigLIP MLP); MoE experts use the same
            type, with biases only for `"gelu"`.
        intermediate_size: width of the dense MLPs (the blocks not in `moe_layers`).
        moe_intermediate_size: width `I_e` of one expert; shared experts are fused into one MLP of width
            `n_shared_experts * moe_intermediate_size`.
        moe_layers: indices of the blocks whose MLP is a sparse MoE (default: every block but the first).
        scoring_func: the router's activation; MoE-ViE routes with sigmoid affinities only.
        routed_scaling_factor: multiplies the routed gate weights (1 in MoE-ViE; `num_experts_per_tok` in upcycled
            models, spec §6.2).
        shared_expert_scale: lambda in `y = sum_e g_e E_e(x) + lambda * E_shared(x)`.
        expert_bias_update_rule / expert_bias_update_rate: the aux-loss-free balancing step (`"zscore"`, the paper's,
            or `"sign"`) and its rate alpha, applied once per optimizer step by
            `moezoo.modeling.moe.update_routing_biases`.
        router_aux_loss_type / router_aux_loss_coef: an optional auxiliary router loss added to the contrastive loss
            (`"none"` in MoE-ViE; `"load_balancing"` or `"z_loss"` for ablations).
        output_router_logits: return the router logits of the valid patches by default.
        position_embedding_type: `"rope_2d"` (MoE-ViE) or `"learned"` (a SigLIP grid of `num_patches` positions,
            resized to each image like Siglip2).
        rope_interleaved: rotate pairs `(2j, 2j+1)` (the official layout) rather than the two halves of a head.
        rope_position_offset: added to the 0-based patch row and column (1 in the official model).
        pooling_num_attention_heads / pooling_intermediate_size / pooling_hidden_act: the attention-pooling (MAP) head.
    """

    model_type = "moe_vie_vision_model"
    base_config_key = "vision_config"

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    patch_size: int = 16
    image_size: int = 224
    mlp_type: str = "swiglu"
    hidden_act: str = "silu"
    intermediate_size: int = 2048
    mlp_bias: bool = True
    moe_intermediate_size: int = 512
    n_routed_experts: int = 31
    n_shared_experts: int = 1
    num_experts_per_tok: int = 3
    moe_layers: list[int] | None = None
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_expert_scale: float = 1.0
    expert_bias_update_rule: str = "zscore"
    expert_bias_update_rate: float = 1e-3
    router_aux_loss_type: str = "none"
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    position_embedding_type: str = "rope_2d"
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    rope_position_offset: int = 1
    num_patches: int | None = None
    use_pre_layernorm: bool = True
    use_post_layernorm: bool = False
    patch_embedding_bias: bool = False
    attention_bias: bool = True
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    pooling_num_attention_heads: int = 8
    pooling_intermediate_size: int = 3072
    pooling_hidden_act: str = "gelu"
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.moe_layers is None:
            self.moe_layers = list(range(1, self.num_hidden_layers))
        self.validate_fields()
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_granularity(self) -> int:
        """How many experts one dense MLP is cut into (`c`, 4 in MoE-ViE); used by conversions only."""
        return round(self.intermediate_size / self.moe_intermediate_size)

    def moe_layer_spec(self) -> MoeLayerSpec:
        """The sparse-MoE layer of the blocks in `moe_layers`: sigmoid router with a selection-only balancing bias,
        renormalised gates over the routed top-k, and the shared experts fused into one MLP (spec §2.1)."""
        return MoeLayerSpec(
            hidden_size=self.hidden_size,
            num_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            expert_intermediate_size=self.moe_intermediate_size,
            expert_type=self.mlp_type,
            hidden_act=self.hidden_act,
            router_type=self.scoring_func,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            shared_expert_intermediate_size=self.n_shared_experts * self.moe_intermediate_size,
            shared_expert_scale=self.shared_expert_scale,
            routing_bias=True,
            bias_update_rate=self.expert_bias_update_rate,
            bias_update_rule=self.expert_bias_update_rule,
        )

    def validate_fields(self) -> None:
        require_bools(self)
        require_positive_ints(
            self, "hidden_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size",
            "image_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
            "pooling_num_attention_heads", "pooling_intermediate_size",
        )
        require_non_negative_ints(self, "n_shared_experts", "rope_position_offset")
        require_non_negative(self, "expert_bias_update_rate", "router_aux_loss_coef", "shared_expert_scale",
                              "initializer_range")
        require_positive(self, "layer_norm_eps", "rope_theta", "routed_scaling_factor")
        require_probability(self, "attention_dropout")
        require_choice(self, "mlp_type", ("swiglu", "gelu"))
        require_activation(self, "hidden_act")
        require_activation(self, "pooling_hidden_act")
        require_choice(self, "scoring_func", ("sigmoid",), why="MoE-ViE routes with sigmoid affinities (spec §2.1)")
        require_choice(self, "expert_bias_update_rule", ("zscore", "sign"))
        require_choice(self, "router_aux_loss_type", ("none", "load_balancing", "z_loss"))
        require_choice(self, "position_embedding_type", ("rope_2d", "learned"))
        require_divides(self, "num_attention_heads", "hidden_size")
        require_divides(self, "pooling_num_attention_heads", "hidden_size")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"{type(self).__name__}.num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"n_routed_experts={self.n_routed_experts}: a token cannot be routed to more experts than exist"
            )
        if not isinstance(self.moe_layers, (list, tuple)) or any(
            not is_non_negative_int(i) or i >= self.num_hidden_layers for i in self.moe_layers
        ):
            raise ValueError(
                f"{type(self).__name__}.moe_layers must list block indices in [0, num_hidden_layers="
                f"{self.num_hidden_layers}), got {self.moe_layers!r}"
            )
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"{type(self).__name__}.moe_layers lists a block twice: {self.moe_layers!r}")
        if self.position_embedding_type == "rope_2d" and self.head_dim % 4:
            raise ValueError(
                f"{type(self).__name__}: head_dim = hidden_size / num_attention_heads = {self.head_dim} must be a "
                "multiple of 4 with position_embedding_type='rope_2d' (half of each head rotates by the column, half "
                "by the row, in pairs)"
            )
        if self.position_embedding_type == "learned":
            grid = math.isqrt(self.num_patches) if is_positive_int(self.num_patches) else 0
            if grid * grid != self.num_patches:
                raise ValueError(
                    f"{type(self).__name__}.num_patches must be a positive square number (the learned grid of "
                    f"position embeddings) with position_embedding_type='learned', got {self.num_patches!r}"
                )


class MoeVieTextConfig(PreTrainedConfig):
    r"""The text tower: dense, with learned absolute positions.

    Args:
        is_causal: causal self-attention (MoE-ViE) or bidirectional (SigLIP).
        pooling_type: `"eos"` pools the first `eos_token_id` of each sequence (CLIP's EOT), `"last"` the last position
            (SigLIP, which pads to a fixed length).
        use_final_layer_norm: a LayerNorm after the last block (SigLIP); MoE-ViE has none.
    """

    model_type = "moe_vie_text_model"
    base_config_key = "text_config"

    vocab_size: int = 49408
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 2730
    mlp_type: str = "swiglu"
    hidden_act: str = "silu"
    mlp_bias: bool = True
    max_position_embeddings: int = 144
    is_causal: bool = True
    pooling_type: str = "eos"
    use_final_layer_norm: bool = False
    attention_bias: bool = True
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407
    pad_token_id: int | None = 0
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        self.validate_fields()
        super().__post_init__(**kwargs)

    def validate_fields(self) -> None:
        require_bools(self)
        require_positive_ints(
            self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings",
        )
        require_positive(self, "layer_norm_eps")
        require_non_negative(self, "initializer_range")
        require_probability(self, "attention_dropout")
        require_choice(self, "mlp_type", ("swiglu", "gelu"))
        require_activation(self, "hidden_act")
        require_choice(self, "pooling_type", ("eos", "last"))
        require_divides(self, "num_attention_heads", "hidden_size")
        if self.pooling_type == "eos" and not is_non_negative_int(self.eos_token_id):
            raise ValueError(
                f"{type(self).__name__}.eos_token_id must be a token id with pooling_type='eos' (the text is pooled "
                f"at its first EOS), got {self.eos_token_id!r}"
            )
        # A special token id outside the vocabulary is only warned about, as transformers' own configs do: configs on
        # the Hub store such ids, and the forward names an EOS missing from the texts.
        self.validate_token_ids()


class MoeVieConfig(PreTrainedConfig):
    r"""The dual encoder.

    Args:
        projection_dim: the shared image-text embedding size. `None` means SigLIP style: image embeddings are the
            pooled vision features (no visual projection) and the text projection maps to the vision width.
        loss_type: `"softmax"` (symmetric InfoNCE, MoE-ViE) or `"sigmoid"` (SigLIP, with a learned `logit_bias`).
        logit_scale_init_value: initial log inverse temperature (ln(1/0.07) in CLIP and MoE-ViE).
        logit_bias_init_value: initial logit bias of the sigmoid loss.
        max_logit_scale: the log-scale is clamped to at most this value in the forward (ln 100, OpenCLIP's clamp);
            `None` for no clamp (SigLIP).
        text_projection_bias: whether the text projection has a bias (SigLIP's text `head` does).
    """

    model_type = "moe_vie"
    sub_configs_defaults = {"text_config": MoeVieTextConfig, "vision_config": MoeVieVisionConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    projection_dim: int | None = 1024
    loss_type: str = "softmax"
    logit_scale_init_value: float = math.log(1 / 0.07)
    logit_bias_init_value: float = -10.0
    max_logit_scale: float | None = math.log(100)
    text_projection_bias: bool = False
    initializer_range: float = 0.02
    initializer_factor: float = 1.0

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)  # builds the sub-configs from dicts / defaults
        self.validate_fields()

    @property
    def embedding_dim(self) -> int:
        """Size of the image and text embeddings that are compared."""
        return self.projection_dim if self.projection_dim is not None else self.vision_config.hidden_size

    def validate_fields(self) -> None:
        require_bools(self)
        if self.projection_dim is not None:
            require_positive_ints(self, "projection_dim")
        require_choice(self, "loss_type", ("softmax", "sigmoid"))
        require_finite(self, "logit_scale_init_value", "logit_bias_init_value")
        if self.max_logit_scale is not None:
            require_positive(self, "max_logit_scale")
        require_non_negative(self, "initializer_range", "initializer_factor")


# --- named configurations ------------------------------------------------------------------------------------------

# The tiny configuration of spec §5.2, for tests: 8 experts (1 shared + 7 routed, top-3) like B and L in proportion,
# intermediate_size / moe_intermediate_size = 4 so that exact upcycling applies, and a projection size different from
# both widths so that shape bugs surface.
TINY_MOE_VIE = dict(
    projection_dim=24,
    loss_type="softmax",
    logit_scale_init_value=2.6592,
    vision_config=dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_channels=3, patch_size=4, image_size=16,
        mlp_type="swiglu", hidden_act="silu", intermediate_size=64, mlp_bias=True, moe_intermediate_size=16,
        n_routed_experts=7, n_shared_experts=1, num_experts_per_tok=3, moe_layers=[1, 2], scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=1.0, shared_expert_scale=1.0, expert_bias_update_rule="zscore",
        expert_bias_update_rate=1e-2, position_embedding_type="rope_2d", rope_theta=10000.0, rope_interleaved=True,
        rope_position_offset=1, use_pre_layernorm=True, use_post_layernorm=False, patch_embedding_bias=False,
        layer_norm_eps=1e-5, pooling_num_attention_heads=2, pooling_intermediate_size=128, pooling_hidden_act="gelu",
    ),
    text_config=dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        mlp_type="swiglu", hidden_act="silu", mlp_bias=True, max_position_embeddings=16, is_causal=True,
        pooling_type="eos", use_final_layer_norm=False, layer_norm_eps=1e-5, bos_token_id=97, eos_token_id=98,
        pad_token_id=0,
    ),
)


def _official(vision: dict, text: dict) -> dict:
    return dict(projection_dim=1024, loss_type="softmax", vision_config=vision, text_config=text)


# The three official checkpoints (spec §2.5; `facebook/<name>` on the Hub). Only the fields that differ from the
# defaults (= B/16) are listed. Expert widths are stored, never derived: L's dense width is GPU-aligned 2730 -> 2736,
# and H's 4 * 854 != 3413 (spec §11, item 23).
OFFICIAL_MOE_VIE_CONFIGS = {
    "MoEViE-B16-224": _official(vision=dict(), text=dict()),
    "MoEViE-L16-384": _official(
        vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, image_size=384,
                    intermediate_size=2736, moe_intermediate_size=684, pooling_intermediate_size=4096),
        text=dict(intermediate_size=2736),
    ),
    "MoEViE-H14-448": _official(
        vision=dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, patch_size=14, image_size=448,
                    intermediate_size=3413, moe_intermediate_size=854, num_experts_per_tok=7,
                    pooling_num_attention_heads=16, pooling_intermediate_size=5120),
        text=dict(hidden_size=1408, num_hidden_layers=34, intermediate_size=3754),
    ),
}
