"""Routed experts as fused 3D parameters in transformers' layout, and the dense MLPs used as shared experts.

The routed expert classes carry `@use_experts_implementation`, so `experts_implementation="eager" | "grouped_mm" |
"batched_mm" | "moezoo"` (ours, `moezoo.kernels.moezoo_experts`) all run on the same parameters, and PEFT's
`LoraConfig(target_parameters=[...])` can wrap them. Their own `forward` below is the eager reference: a loop
over the experts that received tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation

from .spec import MoeLayerSpec


class _ExpertLoop(nn.Module):
    """The eager reference shared by both expert types; subclasses define `expert_forward(expert_idx, x)`,
    one expert's MLP."""

    def forward(
        self,
        hidden_states: torch.Tensor,  # (T, H)
        top_k_index: torch.Tensor,  # (T, k)
        top_k_weights: torch.Tensor,  # (T, k)
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # (E, k, T): which (slot, token) pairs each expert serves; under expert parallelism the slots of other
            # ranks' experts hold the sentinel id num_experts, whose row is dropped
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_mask = expert_mask[: self.num_experts]
            expert_hit = expert_mask.sum(dim=(-1, -2)).nonzero().flatten().tolist()
        for expert_idx in expert_hit:
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            expert_out = self.expert_forward(expert_idx, hidden_states[token_idx])
            expert_out = expert_out * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, expert_out.to(final_hidden_states.dtype))
        return final_hidden_states


@use_experts_implementation
class SwiGLUExperts(_ExpertLoop):
    """E SwiGLU experts: `gate_up_proj (E, 2I, H)` (gate rows first, then up) and `down_proj (E, H, I)`."""

    def __init__(self, config, spec: MoeLayerSpec):
        super().__init__()
        self.num_experts = spec.num_experts
        self.hidden_dim = spec.hidden_size
        self.intermediate_dim = spec.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[spec.hidden_act]

    def expert_forward(self, expert_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(hidden_states, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])


@use_experts_implementation(has_gate=False, has_bias=True)
class GeluExperts(_ExpertLoop):
    """E two-layer experts with biases: `up_proj (E, I, H)`, `up_proj_bias (E, I)`, `down_proj (E, H, I)`,
    `down_proj_bias (E, H)`; the activation is `spec.hidden_act` (a GELU for the SigLIP family)."""

    def __init__(self, config, spec: MoeLayerSpec):
        super().__init__()
        self.num_experts = spec.num_experts
        self.hidden_dim = spec.hidden_size
        self.intermediate_dim = spec.expert_intermediate_size
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, self.intermediate_dim, self.hidden_dim))
        self.up_proj_bias = nn.Parameter(torch.empty(self.num_experts, self.intermediate_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.down_proj_bias = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.act_fn = ACT2FN[spec.hidden_act]

    def expert_forward(self, expert_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.linear(hidden_states, self.up_proj[expert_idx], self.up_proj_bias[expert_idx])
        return nn.functional.linear(self.act_fn(hidden), self.down_proj[expert_idx], self.down_proj_bias[expert_idx])


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP, `down_proj(act(gate_proj(x)) * up_proj(x))`: the parameter names of Qwen3.5-MoE's shared
    expert (no biases) and of MoE-ViE's dense block (with biases)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class GeluMLP(nn.Module):
    """A dense two-layer MLP with biases, named like the GELU experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu_pytorch_tanh"):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


EXPERTS_CLASSES = {"swiglu": SwiGLUExperts, "gelu": GeluExperts}
MLP_CLASSES = {"swiglu": SwiGLUMLP, "gelu": GeluMLP}
