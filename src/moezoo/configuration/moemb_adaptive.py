"""MoEMB's inference-time adaptive computation settings (spec moemb.md §3.3, §3.5-3.9, §3.12): which tokens leave the
forward, which skip their routed experts, and which routed slots are dropped. Stored as the `adaptive` dict of
`MoEmbConfig` (so an exported folder carries them) and accepted by `model(..., adaptive=...)` as an override.

Three independent families, which compose (MoDES + GDN-β is the paper's inference combination, §3.12):

    token_pruning  "gdn_beta"           after Gated DeltaNet block K, keep ⌈ρ·N_vis⌉ visual tokens per sample by β
                   "learned"            the trained one-shot pruner (`gates.token_pruner`, spec §3.1): its hard keep
                                        decision, or (`pruner_decision="budget"`) the ⌈ρ·N_vis⌉ highest keep scores
    expert_skip    "beta_rank"          the lowest fraction q of each sample's tokens by β skip the routed experts
                   "beta_threshold"     tokens with β < θ skip the routed experts
                   "otsu_beta"          per layer and sample, an Otsu split of β (CV gate, cap on the skipped share)
                   "otsu_router_logit"  the same on each token's largest router logit
                   "learned"            the trained skip gate (`gates.efficiency_head`, §3.4): skip iff p_skip > θ_skip
    top_k          "uniform"            keep the k' highest of the k routed slots
                   "modes"              keep slot j iff s_ℓ^m · α_j ≥ τ_m (MoDES, m = text or visual)
                   "threshold"          keep slot j iff α_j ≥ τ, at least `min_experts_per_token` slots
                   "null_experts"       AdaMoE (`gates.null_experts`, §3.7): keep the slots that stay in the joint
                                        top-k with the null experts, renormalised over the physical ones
    layer_skip     "learned"            the trained layer-skip gates (`gates.layer_skip`, §3.10): a sample bypasses
                                        block l iff q_l > 0.5
    efficiency_policy "greedy"          the efficiency heads' most likely action (ROUTE, SKIP or DROP) per token and
                                        layer (a GRPO-trained policy, §3.13)

The trained methods need their modules in the model (`MoEmbConfig.gates`, `moezoo.configuration.moemb_gates`).

Every budget is taken per sample (per packed segment), so an item's embedding never depends on its batch neighbours.
The pooled token (the embedding is its hidden state) is never dropped and never skips its routed experts; the top_k
methods apply to every token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


TOKEN_PRUNING_METHODS = ("gdn_beta", "learned")
EXPERT_SKIP_METHODS = ("beta_rank", "beta_threshold", "otsu_beta", "otsu_router_logit", "learned")
TOP_K_METHODS = ("uniform", "modes", "threshold", "null_experts")
LAYER_SKIP_METHODS = ("learned",)
EFFICIENCY_POLICIES = ("greedy",)
PRUNER_DECISIONS = ("hard", "budget")
EXECUTION_MODES = ("masked", "packed")
MODES_MODALITIES = ("text", "visual")  # MoDES's dual thresholds: text, and image ∪ video


@dataclass
class AdaptiveSettings:
    r"""
    token_pruning: None, "gdn_beta" (spec §3.3) or "learned" (§3.1).
    prune_after_layer: K, the zero-based Gated DeltaNet block whose β ranks the visual tokens (the paper's 4).
    keep_ratio: ρ in (0, 1], the share of each sample's visual tokens kept (rounded up).
    pruner_decision: "learned": "hard" (keep iff the keep logit wins) or "budget" (exactly ⌈ρ·N_vis⌉ kept).
    expert_skip: None or one of `EXPERT_SKIP_METHODS` (spec §3.5, §3.6).
    skip_fraction: q in [0, 1), "beta_rank": the share of each sample's tokens (rounded down) that skip.
    beta_threshold: θ in [0, 1), "beta_threshold": tokens whose head-mean β is below it skip.
    otsu_min_cv: c_min, "otsu_*": a layer whose scores have a coefficient of variation σ/μ at most this skips nothing.
    otsu_max_skip: in [0, 1), "otsu_*": at most this share of a sample's tokens skip (the highest scorers are kept).
    otsu_bins: the histogram bins of the Otsu threshold.
    skip_threshold: θ_skip in [0, 1), "learned": a token skips its routed experts iff p_skip > θ_skip (0.5).
    top_k: None or one of `TOP_K_METHODS` (spec §3.7-3.9).
    experts_per_token: k', "uniform": routed slots kept per token, 1 <= k' <= k.
    modes_thresholds: "modes": `{"text": τ_text, "visual": τ_visual}`, from `calibrate_modes`.
    modes_layer_scales: "modes": per layer `[s_text, s_visual]`, from `calibrate_modes` (mean 1 over the layers).
    score_threshold: "threshold": τ_fixed on the routing weight α.
    min_experts_per_token: "threshold": slots kept whatever their weight (the highest ones).
    renormalize: rescale the kept routing weights of a token to the sum of its k weights (off: MoDES zeroes them).
    execution: one of `EXECUTION_MODES` (spec §3.14): "packed" runs the real tokens of every item back to back in
        one row, removes dropped tokens from it and runs the routed experts on the kept slots only, so the savings
        become wall-clock time; "masked" keeps the `(B, S)` rows and zeroes the routing weight of skipped slots (the
        reference: the same embeddings, no time saved on the experts).
    layer_skip: None or "learned" (spec §3.10).
    efficiency_policy: None or "greedy" (spec §3.13).
    """

    token_pruning: str | None = None
    prune_after_layer: int = 4
    keep_ratio: float = 0.5
    expert_skip: str | None = None
    skip_fraction: float = 0.3
    beta_threshold: float = 0.5
    otsu_min_cv: float = 0.1
    otsu_max_skip: float = 0.7
    otsu_bins: int = 256
    pruner_decision: str = "hard"
    skip_threshold: float = 0.5
    top_k: str | None = None
    experts_per_token: int | None = None
    modes_thresholds: dict[str, float] | None = None
    modes_layer_scales: list[list[float]] | None = None
    score_threshold: float = 0.0
    min_experts_per_token: int = 0
    renormalize: bool = False
    execution: str = "packed"
    layer_skip: str | None = None
    efficiency_policy: str | None = None
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, refused by `validate`

    @classmethod
    def from_dict(cls, settings: dict | AdaptiveSettings | None) -> AdaptiveSettings | None:
        if settings is None or isinstance(settings, cls):
            return settings
        if not isinstance(settings, dict):
            raise ValueError(f"adaptive settings must be a dict or AdaptiveSettings, got {type(settings).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(
            **{key: value for key, value in settings.items() if key in known},
            extra={key: value for key, value in settings.items() if key not in known},
        )

    def to_dict(self) -> dict:
        """The non-default settings, what `MoEmbConfig.adaptive` stores."""
        defaults = AdaptiveSettings()
        return {
            key: value
            for key, value in asdict(self).items()
            if key != "extra" and value != getattr(defaults, key)
        }

    @property
    def is_active(self) -> bool:
        methods = (self.token_pruning, self.expert_skip, self.top_k, self.layer_skip, self.efficiency_policy)
        return any(method is not None for method in methods)

    def validate(self, text_config) -> None:
        """Raises a ValueError naming the option for settings that cannot apply to a text model of `text_config`."""
        if self.extra:
            known = sorted(f.name for f in fields(self) if f.name != "extra")
            raise ValueError(f"unknown adaptive options {sorted(self.extra)}; the options are {known}")
        for name, choices in (
            ("token_pruning", TOKEN_PRUNING_METHODS),
            ("expert_skip", EXPERT_SKIP_METHODS),
            ("top_k", TOP_K_METHODS),
            ("layer_skip", LAYER_SKIP_METHODS),
            ("efficiency_policy", EFFICIENCY_POLICIES),
            ("pruner_decision", PRUNER_DECISIONS),
        ):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"adaptive.{name}={value!r} is not one of {choices} (or None)")
        if self.execution not in EXECUTION_MODES:
            raise ValueError(f"adaptive.execution={self.execution!r} is not one of {EXECUTION_MODES}")
        layer_types = text_config.layer_types
        num_layers, top_k = text_config.num_hidden_layers, text_config.num_experts_per_tok
        uses_beta = self.token_pruning == "gdn_beta" or self.expert_skip in ("beta_rank", "beta_threshold", "otsu_beta")
        if uses_beta and "linear_attention" not in layer_types:
            raise ValueError(
                f"adaptive token_pruning={self.token_pruning!r} / expert_skip={self.expert_skip!r} rank tokens by the "
                "β of Gated DeltaNet layers, and this model has none (text_config.layer_types holds no "
                "'linear_attention'): use expert_skip='otsu_router_logit' or a top_k method"
            )
        if self.token_pruning == "gdn_beta":
            layer = self.prune_after_layer
            if not (isinstance(layer, int) and 0 <= layer < num_layers and layer_types[layer] == "linear_attention"):
                gated_delta_net_layers = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
                raise ValueError(
                    f"adaptive.prune_after_layer={layer!r} must be a Gated DeltaNet layer (its β ranks the tokens): "
                    f"one of {gated_delta_net_layers}"
                )
            if not 0 < self.keep_ratio <= 1:
                raise ValueError(
                    f"adaptive.keep_ratio={self.keep_ratio!r} must lie in (0, 1]: the share of visual tokens kept"
                )
        if self.token_pruning == "learned" and self.pruner_decision == "budget" and not 0 < self.keep_ratio <= 1:
            raise ValueError(
                f"adaptive.keep_ratio={self.keep_ratio!r} must lie in (0, 1]: the share of visual tokens kept"
            )
        if self.efficiency_policy is not None and self.expert_skip == "learned":
            raise ValueError(
                "adaptive.efficiency_policy and expert_skip='learned' both read the efficiency heads: choose one"
            )
        for name in ("skip_fraction", "beta_threshold", "otsu_max_skip", "skip_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"adaptive.{name}={value!r} must lie in [0, 1)")
        if not (isinstance(self.otsu_min_cv, (int, float)) and self.otsu_min_cv >= 0):
            raise ValueError(f"adaptive.otsu_min_cv={self.otsu_min_cv!r} must be >= 0")
        if not (isinstance(self.otsu_bins, int) and self.otsu_bins >= 2):
            raise ValueError(f"adaptive.otsu_bins={self.otsu_bins!r} must be an integer >= 2")
        if self.top_k == "uniform":
            k_prime = self.experts_per_token
            if not (isinstance(k_prime, int) and 1 <= k_prime <= top_k):
                raise ValueError(
                    f"adaptive.experts_per_token={k_prime!r} (k') must be an integer from 1 to the model's top-k "
                    f"text_config.num_experts_per_tok={top_k}"
                )
        if self.top_k == "modes":
            self._validate_modes(num_layers)
        if self.top_k == "threshold":
            if not (isinstance(self.score_threshold, (int, float)) and math.isfinite(self.score_threshold)):
                raise ValueError(f"adaptive.score_threshold={self.score_threshold!r} must be a finite number")
        if not (isinstance(self.min_experts_per_token, int) and 0 <= self.min_experts_per_token <= top_k):
            raise ValueError(
                f"adaptive.min_experts_per_token={self.min_experts_per_token!r} must be an integer from 0 to "
                f"text_config.num_experts_per_tok={top_k}"
            )

    def _validate_modes(self, num_layers: int) -> None:
        thresholds, scales = self.modes_thresholds, self.modes_layer_scales
        if not (isinstance(thresholds, dict) and set(thresholds) == set(MODES_MODALITIES)):
            raise ValueError(
                f"adaptive.modes_thresholds={thresholds!r} must map {MODES_MODALITIES} to thresholds: run "
                "moezoo.modeling.moemb_adaptive.calibrate_modes and store what it returns"
            )
        if not all(isinstance(value, (int, float)) and value >= 0 for value in thresholds.values()):
            raise ValueError(f"adaptive.modes_thresholds={thresholds!r} must be non-negative numbers")
        if not (
            isinstance(scales, list)
            and len(scales) == num_layers
            and all(isinstance(row, list) and len(row) == len(MODES_MODALITIES) for row in scales)
            and all(isinstance(value, (int, float)) and value >= 0 for row in scales for value in row)
        ):
            raise ValueError(
                f"adaptive.modes_layer_scales must hold one [s_text, s_visual] pair of non-negative numbers per "
                f"layer ({num_layers} layers): run moezoo.modeling.moemb_adaptive.calibrate_modes"
            )


# The module of `MoEmbConfig.gates` each trained method needs: (setting, its value, the GateModules field).
TRAINED_METHOD_MODULES = (
    ("token_pruning", "learned", "token_pruner"),
    ("expert_skip", "learned", "efficiency_head"),
    ("efficiency_policy", "greedy", "efficiency_head"),
    ("top_k", "null_experts", "null_experts"),
    ("layer_skip", "learned", "layer_skip"),
)


def check_adaptive_settings(
    settings: AdaptiveSettings | None, text_config, moe_variant: str, owner: str = "MoEmbConfig.", gates=None
) -> None:
    """`settings.validate`, plus what the model variant and its trained modules (`gates`, a `GateModules`) rule out;
    errors name the option, prefixed by `owner` (where the settings came from: the config, or a forward's
    `adaptive=` keyword)."""
    if settings is None:
        return
    try:
        settings.validate(text_config)
    except ValueError as error:
        raise ValueError(f"{owner}{error}") from None
    for name, method, module in TRAINED_METHOD_MODULES:
        if getattr(settings, name) == method and not (gates is not None and getattr(gates, module)):
            raise ValueError(
                f"{owner}adaptive.{name}={method!r} needs the trained module gates.{module}, which this model does "
                f"not have: train it with `moezoo train moemb --adaptive-recipe` (or set MoEmbConfig.gates)"
            )
    if moe_variant == "modality" and (settings.expert_skip is not None or settings.top_k is not None):
        raise ValueError(
            f"{owner}adaptive: moe_variant='modality' routes every token to one fixed expert, so expert_skip and "
            "top_k do not apply; use token_pruning"
        )
