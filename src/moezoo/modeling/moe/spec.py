"""What one sparse-MoE layer is, as validated data.

Every architecture of the zoo describes its MoE layers with a `MoeLayerSpec` built from its own config fields;
the core modules (`router.py`, `experts.py`, `block.py`) are built from the spec alone. Validation happens here,
once, so that a bad value fails when the config is constructed and the message names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from transformers.activations import ACT2FN


ROUTER_TYPES = ("softmax", "sigmoid", "given")
EXPERT_TYPES = ("swiglu", "gelu")
BIAS_UPDATE_RULES = ("zscore", "sign")


@dataclass(frozen=True)
class MoeLayerSpec:
    """Sizes and routing rules of one sparse-MoE layer.

    Routers:
        - `"softmax"`: softmax over the expert logits, top-k, optionally renormalised (`norm_topk_prob`), as in
          Qwen3-MoE / Qwen3.5-MoE.
        - `"sigmoid"`: sigmoid affinities, top-k; with `routing_bias=True` a per-expert bias is added for the
          *selection only* and the gate weights come from the unbiased affinities (aux-loss-free balancing,
          DeepSeek-V3 / MoE-ViE).
        - `"given"`: no learned router; the caller passes one expert id per example or per token (MoTE task
          routes, modality-level experts). Requires `num_experts_per_tok == 1`.

    Experts:
        - `"swiglu"`: `down(act(gate(x)) * up(x))` without biases, stored as `gate_up_proj (E, 2I, H)`.
        - `"gelu"`: `down(act(up(x)))` with biases, stored as `up_proj (E, I, H)` + `up_proj_bias (E, I)`.
    """

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    expert_type: str = "swiglu"
    hidden_act: str = "silu"
    router_type: str = "softmax"
    norm_topk_prob: bool = True
    # Multiplies the routed experts' gate weights (DeepSeek's routed scaling; upcycling uses it to stay exact).
    routed_scaling_factor: float = 1.0
    # A learned bias on the router logits, `z = W x + b` (a new router of upcycled models: MoEMB §2.5). Unlike the
    # selection-only balancing bias it changes the gate weights too, and it is trained by gradient.
    router_logit_bias: bool = False
    # 0 means no shared expert. Several shared experts of width I_e are one shared expert of width n * I_e.
    shared_expert_intermediate_size: int = 0
    # Qwen-style scalar gate sigmoid(w . h) on the shared expert's output.
    shared_expert_gate: bool = False
    # lambda in MoE-ViE's y = sum_e g_e E_e(x) + lambda * E_shared(x); ignored without a shared expert.
    shared_expert_scale: float = 1.0
    routing_bias: bool = False
    # Top-1 gates renormalised to exactly 1 give the router no gradient from the model's loss: with
    # `straight_through_weights` the gate weight is `p / p.detach()`, still exactly 1 in the forward (an upcycled layer
    # stays equal to its dense source) but with the gradient of log p in the backward (OmniMoE-VL spec D4).
    straight_through_weights: bool = False
    bias_update_rate: float = 1e-3
    bias_update_rule: str = "zscore"

    def __post_init__(self):
        for name in ("hidden_size", "num_experts", "num_experts_per_tok", "expert_intermediate_size"):
            _require_positive_int(name, getattr(self, name))
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"MoeLayerSpec.shared_expert_intermediate_size must be a non-negative integer (0 = no shared "
                f"expert), got {self.shared_expert_intermediate_size!r}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MoeLayerSpec.num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"num_experts={self.num_experts}: a token cannot be routed to more experts than exist"
            )
        _require_choice("router_type", self.router_type, ROUTER_TYPES)
        _require_choice("expert_type", self.expert_type, EXPERT_TYPES)
        _require_choice("bias_update_rule", self.bias_update_rule, BIAS_UPDATE_RULES)
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"MoeLayerSpec.hidden_act={self.hidden_act!r} is not a known activation; "
                f"use one of transformers' ACT2FN names, e.g. 'silu', 'gelu', 'gelu_pytorch_tanh'"
            )
        if self.bias_update_rate < 0:
            raise ValueError(f"MoeLayerSpec.bias_update_rate must be >= 0, got {self.bias_update_rate}")
        if self.routing_bias and self.router_type != "sigmoid":
            raise ValueError(
                f"MoeLayerSpec.routing_bias=True needs router_type='sigmoid' (got {self.router_type!r}): the "
                "selection-only bias is defined on sigmoid affinities"
            )
        if self.router_logit_bias and self.router_type == "given":
            raise ValueError("MoeLayerSpec.router_logit_bias=True needs a learned router (router_type 'softmax' or "
                             "'sigmoid'), not 'given' routes")
        if self.router_type == "given" and self.num_experts_per_tok != 1:
            raise ValueError(
                f"MoeLayerSpec.num_experts_per_tok must be 1 with router_type='given' (one expert per example or "
                f"token), got {self.num_experts_per_tok}"
            )
        if self.straight_through_weights and (self.router_type == "given" or self.num_experts_per_tok != 1):
            raise ValueError(
                "MoeLayerSpec.straight_through_weights=True needs a learned top-1 router (num_experts_per_tok=1, "
                f"router_type 'softmax' or 'sigmoid'), got router_type={self.router_type!r}, "
                f"num_experts_per_tok={self.num_experts_per_tok}"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(
                "MoeLayerSpec.shared_expert_gate=True needs a shared expert: set shared_expert_intermediate_size > 0"
            )

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MoeLayerSpec.{name} must be a positive integer, got {value!r}")


def _require_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"MoeLayerSpec.{name}={value!r} is not one of {', '.join(map(repr, choices))}")
