"""The sparse-MoE block: router, routed experts and an optional (gated) shared expert.

    y = sum_{e in topk(x)} g_e(x) * E_e(x)  +  lambda * [sigmoid(w . x)] * E_shared(x)

Padding-aware: with an `attention_mask`, only valid tokens are routed; padding positions get a zero output (the
residual stream passes them through unchanged), never occupy an expert and never enter the balancing counts or
the routing statistics. Because routing has no capacity limit, a valid token's output never depends on the
other tokens of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import EXPERTS_CLASSES, MLP_CLASSES
from .router import TopKRouter, is_recomputing
from .spec import MoeLayerSpec


class SparseMoeBlock(nn.Module):
    """Args:
        config: the model (sub-)config whose `_experts_implementation` selects the experts' forward; transformers'
            `set_experts_implementation` changes it on that object.
        spec: the layer's sizes and routing rules.
        layer_name: how errors and routing statistics name this layer (default `"layer {layer_idx}"`).
    """

    def __init__(self, config, spec: MoeLayerSpec, layer_idx: int | None = None, layer_name: str | None = None):
        super().__init__()
        self.spec = spec
        self.hidden_size = spec.hidden_size
        self.num_experts = spec.num_experts
        self.layer_idx = layer_idx
        self.layer_name = layer_name or f"layer {layer_idx}"
        self.gate = TopKRouter(spec) if spec.router_type != "given" else None
        self.experts = EXPERTS_CLASSES[spec.expert_type](config, spec)
        self.shared_expert = None
        self.shared_expert_gate = None
        if spec.has_shared_expert:
            self.shared_expert = MLP_CLASSES[spec.expert_type](
                spec.hidden_size, spec.shared_expert_intermediate_size, spec.hidden_act
            )
            if spec.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        # Set by `moezoo.modeling.moe.record_routing` while statistics are recorded.
        self.routing_recorder = None

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, H) or packed (T, H)
        attention_mask: torch.Tensor | None = None,  # (B, S) or (T,), 1/True = valid token
        routes: torch.LongTensor | None = None,  # "given" routers: (B,) one expert per example, or (B, S) / (T,)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the block output (same shape as the input) and the router logits of the valid tokens
        `(T_valid, E)` in fp32 (None for given routes)."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE {self.layer_name}: hidden states have size {hidden_states.shape[-1]} in their last dimension, "
                f"but this block was built for hidden_size={self.hidden_size}"
            )
        input_shape = hidden_states.shape
        flat_states = hidden_states.reshape(-1, self.hidden_size)
        valid = self._valid_token_mask(attention_mask, input_shape)
        tokens = flat_states if valid is None else flat_states[valid]

        router_logits = None
        if self.gate is None:
            top_k_index = self._given_routes(routes, input_shape, valid)
            top_k_weights = torch.ones(top_k_index.shape, dtype=tokens.dtype, device=tokens.device)
        else:
            if routes is not None:
                raise ValueError(f"MoE {self.layer_name}: `routes` are only accepted by router_type='given' blocks")
            router_logits, top_k_weights, top_k_index = self.gate(tokens)
            if not torch.isfinite(router_logits).all():
                raise FloatingPointError(
                    f"MoE {self.layer_name}: router logits contain NaN or inf; check the inputs of this layer and the "
                    "router weights (a diverged training run or a corrupt checkpoint)"
                )

        output = self.experts(tokens, top_k_index, top_k_weights)
        if self.shared_expert is not None:
            shared_output = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared_output = torch.sigmoid(self.shared_expert_gate(tokens)) * shared_output
            if self.spec.shared_expert_scale != 1.0:
                shared_output = self.spec.shared_expert_scale * shared_output
            output = output + shared_output

        if self.routing_recorder is not None and not is_recomputing():
            self.routing_recorder.record(self, top_k_index, valid)

        if valid is not None:
            output = flat_states.new_zeros(flat_states.shape).masked_scatter(valid.unsqueeze(-1), output)
        return output.reshape(input_shape), router_logits

    def _valid_token_mask(self, attention_mask: torch.Tensor | None, input_shape: torch.Size) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.shape != input_shape[:-1]:
            raise ValueError(
                f"MoE {self.layer_name}: attention_mask has shape {tuple(attention_mask.shape)}, expected "
                f"{tuple(input_shape[:-1])} (one entry per token of the hidden states)"
            )
        valid = attention_mask.reshape(-1).bool()
        return None if bool(valid.all()) else valid

    def _given_routes(self, routes, input_shape, valid) -> torch.Tensor:
        if routes is None:
            raise ValueError(
                f"MoE {self.layer_name}: router_type='given' needs `routes` (one expert id per example or per token)"
            )
        if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
            raise ValueError(f"MoE {self.layer_name}: routes must be integer expert ids, got dtype {routes.dtype}")
        routes = routes.long()  # what every experts implementation indexes with
        if len(input_shape) == 3 and routes.shape == input_shape[:1]:
            routes = routes[:, None].expand(input_shape[:2])
        if routes.shape != input_shape[:-1]:
            raise ValueError(
                f"MoE {self.layer_name}: routes have shape {tuple(routes.shape)}; expected one id per example "
                f"{tuple(input_shape[:1])} or per token {tuple(input_shape[:-1])}"
            )
        routes = routes.reshape(-1)
        if valid is not None:
            routes = routes[valid]
        if routes.numel() and (routes.min() < 0 or routes.max() >= self.num_experts):
            raise ValueError(
                f"MoE {self.layer_name}: route ids must lie in [0, {self.num_experts}), got ids from "
                f"{int(routes.min())} to {int(routes.max())}"
            )
        return routes.unsqueeze(-1)
