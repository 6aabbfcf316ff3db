"""SMoES configuration (spec smoes.md §4): the `smoes_*` fields, reusable by any MoE host, and the Qwen3.5-MoE and
Qwen3-VL-MoE hosts.

`SmoesConfigMixin` declares and validates the fields; a host's (text) config inherits it before its base config and
calls `validate_smoes_fields` with what only the host knows (its expert-count field, its softmax-attention layers,
its router). Each host keeps every field of its transformers config as it is, so a Qwen3.5-MoE or Qwen3-VL-MoE
`config.json` plus `smoes_*` fields is an SMoES config.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeConfig, Qwen3VLMoeTextConfig

from ..modeling.moe.smoes.bins import BINNING_TYPES
from ..modeling.moe.smoes.losses import BALANCE_MODES
from ..modeling.moe.smoes.scores import SCORE_TYPES
from .validation import (
    is_int,
    is_non_negative_int,
    require_choice,
    require_divides,
    require_non_negative,
    require_non_negative_ints,
    require_positive,
    require_positive_ints,
    require_probability,
)


LINEAR_ATTENTION_MIXING = ("carry",)
LAYER_REDUCTIONS = ("sum", "mean")


@dataclass(kw_only=True, repr=False)
class SmoesConfigMixin:
    r"""The SMoES fields (spec §4), with the paper's values as defaults (N_bins 8, beta 0.99, tau 0.5 D, alpha_bal
    1e-3, alpha_MI 1e-4).

    Args:
        smoes_enabled: False runs the base model and its own auxiliary loss unchanged.
        smoes_score_type: the soft modality score: `"gaussian"` (per-modality diagonal Gaussians on the router
            input; any host), `"attention"` (accumulated through softmax-attention layers; needs at least one) or
            `"hard"` (the one-hot label, an ablation).
        smoes_linear_attn_mixing: how the attention score crosses linear-attention layers, which have no attention
            matrix: `"carry"` keeps it unchanged.
        smoes_num_bins: experts per layer are cut into this many bins (must divide the expert count).
        smoes_binning: `"adaptive"` re-sorts the experts into bins by their text preference; `"fixed"` keeps
            contiguous index ranges (an ablation).
        smoes_ema_beta: momentum of the Gaussian statistics and of the expert dispatch counts.
        smoes_gauss_tau_scale: the Gaussian scores' temperature is this times the hidden size.
        smoes_gauss_var_eps: variance floor of the Gaussian scores.
        smoes_bal_coef: alpha_bal, weight of the bin-level balance loss (replaces the base `router_aux_loss_coef`).
        smoes_mi_coef: alpha_MI, weight of the negative inter-bin mutual information.
        smoes_bal_mode: `"global"` (the paper's formula: balance across all experts, hence across bins) or
            `"intra_bin"` (balance inside each bin only, an ablation).
        smoes_layer_reduction: `"sum"` (the paper's formula) or `"mean"` of the per-layer losses.
        smoes_mi_min_modality_mass: a modality with less score mass (in tokens) in a sample is dropped from that
            sample's mutual information.
        smoes_rebin_interval: adaptive bins are reassigned every this many training forwards.
        smoes_freeze_bins_after: no reassignment after this many training forwards (None: never frozen).
        smoes_mi_warmup_steps: alpha_MI ramps up linearly over this many training forwards (0: constant, the paper).
        smoes_vision_token_types: the `mm_token_type_ids` values of vision tokens (Qwen: 1 image, 2 video); every
            other token is text.
        smoes_ep_devices: expert-parallel devices the bins are placed on (export and dispatch metrics); must divide
            `smoes_num_bins`.
    """

    smoes_enabled: bool = True
    smoes_score_type: str = "gaussian"
    smoes_linear_attn_mixing: str = "carry"
    smoes_num_bins: int = 8
    smoes_binning: str = "adaptive"
    smoes_ema_beta: float = 0.99
    smoes_gauss_tau_scale: float = 0.5
    smoes_gauss_var_eps: float = 1e-5
    smoes_bal_coef: float = 0.001
    smoes_mi_coef: float = 0.0001
    smoes_bal_mode: str = "global"
    smoes_layer_reduction: str = "sum"
    smoes_mi_min_modality_mass: float = 1.0
    smoes_rebin_interval: int = 1
    smoes_freeze_bins_after: int | None = None
    smoes_mi_warmup_steps: int = 0
    smoes_vision_token_types: list[int] | tuple[int, ...] = (1, 2)
    smoes_ep_devices: int = 8

    def validate_smoes_fields(
        self,
        num_experts_field: str,
        softmax_attention_layers: int,
        expert_groups: int = 1,
        routers_trainable: bool | None = None,
    ) -> None:
        """Raise a `ValueError` naming the field for an invalid value or one this host cannot run.

        Args:
            num_experts_field: the host config's field holding the routed experts per layer (`"num_experts"`).
            softmax_attention_layers: how many of the host's layers have a softmax attention matrix.
            expert_groups: the router's expert groups (DeepSeek's `n_group`); group-limited routing selects within
                contiguous index ranges, so it is not invariant to the expert permutation binning implies.
            routers_trainable: whether training updates the routers, where the config records it (None: unknown
                here; the model checks the router weights in its first training forward).
        """
        if not isinstance(self.smoes_enabled, bool):
            raise ValueError(f"{type(self).__name__}.smoes_enabled must be True or False, got {self.smoes_enabled!r}")
        require_choice(self, "smoes_score_type", SCORE_TYPES)
        require_choice(self, "smoes_linear_attn_mixing", LINEAR_ATTENTION_MIXING)
        require_choice(self, "smoes_binning", BINNING_TYPES)
        require_choice(self, "smoes_bal_mode", BALANCE_MODES)
        require_choice(self, "smoes_layer_reduction", LAYER_REDUCTIONS)
        require_positive_ints(self, "smoes_num_bins", "smoes_rebin_interval", "smoes_ep_devices")
        require_non_negative_ints(self, "smoes_mi_warmup_steps")
        require_probability(self, "smoes_ema_beta")
        require_positive(self, "smoes_gauss_tau_scale", "smoes_gauss_var_eps")
        require_non_negative(self, "smoes_bal_coef", "smoes_mi_coef", "smoes_mi_min_modality_mass")
        if self.smoes_freeze_bins_after is not None and not is_non_negative_int(self.smoes_freeze_bins_after):
            raise ValueError(
                f"{type(self).__name__}.smoes_freeze_bins_after must be None or an integer >= 0, got "
                f"{self.smoes_freeze_bins_after!r}"
            )
        types = self.smoes_vision_token_types
        if not isinstance(types, (list, tuple)) or not types or not all(is_non_negative_int(t) for t in types):
            raise ValueError(
                f"{type(self).__name__}.smoes_vision_token_types must be a non-empty list of mm_token_type_ids values "
                f"(integers >= 0), got {types!r}"
            )
        require_divides(self, "smoes_num_bins", num_experts_field)
        require_divides(self, "smoes_ep_devices", "smoes_num_bins")
        if self.smoes_score_type == "attention" and softmax_attention_layers == 0:
            raise ValueError(
                f"{type(self).__name__}.smoes_score_type='attention' needs a softmax-attention layer, and this model "
                "has none (linear-attention layers have no attention matrix); use 'gaussian'"
            )
        if not is_int(expert_groups) or expert_groups != 1:
            raise ValueError(
                f"{type(self).__name__}: SMoES needs a router that is invariant to permuting the experts, and this "
                f"router limits its choice to {expert_groups!r} contiguous expert groups (group-limited routing); "
                "set the router's group count to 1"
            )
        if self.smoes_enabled and routers_trainable is False and (self.smoes_bal_coef or self.smoes_mi_coef):
            raise ValueError(
                f"{type(self).__name__}.smoes_mi_coef={self.smoes_mi_coef} and smoes_bal_coef={self.smoes_bal_coef} "
                "train the routers, which this config freezes; make them trainable or set both coefficients to 0"
            )


class SmoesQwen3_5MoeTextConfig(SmoesConfigMixin, Qwen3_5MoeTextConfig):
    r"""transformers' `Qwen3_5MoeTextConfig` plus the `smoes_*` fields of `SmoesConfigMixin`. Softmax attention is on
    the `"full_attention"` layers of `layer_types` (one in four by default); the others are Gated DeltaNet layers."""

    model_type = "smoes_qwen3_5_moe_text"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_smoes_fields(
            num_experts_field="num_experts", softmax_attention_layers=self.layer_types.count("full_attention")
        )


class SmoesHostConfigMixin:
    """The top-level config of a vision-language host whose `text_config` is the SMoES text config: the text config of
    the base model's `config.json` (its own `model_type`, plus `smoes_*` fields) is read and saved as the SMoES one.
    Placed before the transformers config class, whose `sub_configs_defaults["text_config"]` the host replaces."""

    def __post_init__(self, **kwargs):
        # The text config classes of the host and of its transformers config (the class after this mixin).
        smoes_text_config = self.sub_configs_defaults["text_config"].config_class
        base_text_config = super(SmoesHostConfigMixin, self).sub_configs_defaults["text_config"].config_class
        if isinstance(self.text_config, dict) and self.text_config.get("model_type") == base_text_config.model_type:
            self.text_config = {**self.text_config, "model_type": smoes_text_config.model_type}
        super().__post_init__(**kwargs)


class SmoesQwen3_5MoeConfig(SmoesHostConfigMixin, Qwen3_5MoeConfig):
    r"""transformers' `Qwen3_5MoeConfig` whose `text_config` is a `SmoesQwen3_5MoeTextConfig` (the SMoES fields live
    on the text config, beside the MoE fields they refer to)."""

    model_type = "smoes_qwen3_5_moe"
    sub_configs_defaults = {**Qwen3_5MoeConfig.sub_configs_defaults, "text_config": SmoesQwen3_5MoeTextConfig}


class SmoesQwen3VLMoeTextConfig(SmoesConfigMixin, Qwen3VLMoeTextConfig):
    r"""transformers' `Qwen3VLMoeTextConfig` plus the `smoes_*` fields of `SmoesConfigMixin`. Every layer is softmax
    attention, so the paper's attention-accumulated score applies exactly and is the default (spec §1.3); the layers of
    `mlp_only_layers` (or off `decoder_sparse_step`) have a dense MLP and no SMoES state, but advance the scores."""

    model_type = "smoes_qwen3_vl_moe_text"
    smoes_score_type: str = "attention"
    # Qwen3-VL-30B-A3B's expert count: transformers' default (60) is not divided by the paper's 8 bins, and saving a
    # config builds the default one to write only what differs from it.
    num_experts: int = 128

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_smoes_fields(num_experts_field="num_experts", softmax_attention_layers=self.num_hidden_layers)


class SmoesQwen3VLMoeConfig(SmoesHostConfigMixin, Qwen3VLMoeConfig):
    r"""transformers' `Qwen3VLMoeConfig` whose `text_config` is a `SmoesQwen3VLMoeTextConfig`."""

    model_type = "smoes_qwen3_vl_moe"
    sub_configs_defaults = {**Qwen3VLMoeConfig.sub_configs_defaults, "text_config": SmoesQwen3VLMoeTextConfig}
