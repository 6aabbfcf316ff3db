"""Token routers: softmax top-k (Qwen-style) and sigmoid top-k with a selection-only balancing bias.

Router math runs in fp32 whatever the model dtype. The balancing bias `e_score_correction_bias` (DeepSeek-V3's
name) only changes *which* experts are selected; the gate weights always come from the unbiased scores
(MoE-ViE spec §2.1). The bias is not trained by gradient: `update_bias()` applies the z-score or sign rule once
per optimizer step from the assignments counted in `tokens_per_expert` (spec §2.2).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .precision import autocast_off
from .spec import MoeLayerSpec


def is_recomputing() -> bool:
    """True while autograd re-runs a forward (gradient checkpointing): such a pass must not count tokens twice."""
    return torch._C._current_graph_task_id() != -1


class TopKRouter(nn.Module):
    def __init__(self, spec: MoeLayerSpec):
        super().__init__()
        self.router_type = spec.router_type
        self.top_k = spec.num_experts_per_tok
        self.num_experts = spec.num_experts
        self.hidden_dim = spec.hidden_size
        self.norm_topk_prob = spec.norm_topk_prob
        self.straight_through_weights = spec.straight_through_weights
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.bias_update_rate = spec.bias_update_rate
        self.bias_update_rule = spec.bias_update_rule
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
        self.bias = nn.Parameter(torch.zeros(self.num_experts)) if spec.router_logit_bias else None
        if spec.routing_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # (token, slot) assignments per expert since the last bias update, summed over micro-batches: each process's
        # own, so a plain attribute and not a buffer, which DistributedDataParallel would overwrite with rank 0's
        # before every forward. None until the first counted forward.
        self._counts: torch.Tensor | None = None

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """The assignments per expert (E,) counted since the last bias update; None for routers without the bias."""
        if self.e_score_correction_bias is None:
            return None
        if self._counts is None:
            self._counts = torch.zeros(self.num_experts, dtype=torch.int64, device=self.weight.device)
        elif self._counts.device != self.weight.device:  # the model moved since the last update
            self._counts = self._counts.to(self.weight.device)
        return self._counts

    def reset_counts(self) -> None:
        self._counts = None

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` / `.half()` would round the balancing bias, whose ~1e-3 updates bf16 cannot hold
        # (from_pretrained keeps it fp32 through `_keep_in_fp32_modules_strict`): it follows the model to another
        # device but stays fp32, cast from its fp32 values rather than back from rounded ones.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None and self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device, torch.float32)
        return self

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, H) -> router_logits (T, E) fp32, top_k_weights (T, k) in the input dtype, top_k_index (T, k)."""
        with autocast_off(hidden_states):
            return self._route(hidden_states)

    def _route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(
            hidden_states.float(), self.weight.float(), None if self.bias is None else self.bias.float()
        )
        if self.router_type == "softmax":
            scores = torch.softmax(router_logits, dim=-1)
        else:
            scores = torch.sigmoid(router_logits)
        selection_scores = scores
        if self.e_score_correction_bias is not None:
            selection_scores = scores + self.e_score_correction_bias.float()
        top_k_index = torch.topk(selection_scores, self.top_k, dim=-1).indices
        top_k_weights = scores.gather(1, top_k_index)
        if self.straight_through_weights:
            top_k_weights = top_k_weights / top_k_weights.detach()  # 1.0, with the gradient of log p (top-1 only)
        elif self.norm_topk_prob:
            # The epsilon (DeepSeek-V3's) keeps sigmoid scores that all underflow to 0 from giving 0/0; it is below
            # fp32 resolution for any sum that does not.
            top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            top_k_weights = top_k_weights * self.routed_scaling_factor
        if self.e_score_correction_bias is not None and self.training and not is_recomputing():
            with torch.no_grad():
                flat = top_k_index.reshape(-1)
                self.tokens_per_expert.index_add_(0, flat, torch.ones_like(flat))
        return router_logits, top_k_weights.to(hidden_states.dtype), top_k_index

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        """Apply one balancing step from `tokens_per_expert` (default: this router's own counts) and reset them.

        z-score rule: b_e <- b_e - alpha * (t_e - mean(t)) / std(t)   (population std; skipped when std == 0)
        sign rule:    b_e <- b_e - alpha * sign(t_e - mean(t))
        Returns the applied step, or None when nothing was updated.
        """
        if self.e_score_correction_bias is None:
            return None
        counts = (self.tokens_per_expert if tokens_per_expert is None else tokens_per_expert).double()
        self.reset_counts()
        if counts.sum() == 0:
            return None
        deviation = counts - counts.mean()
        if self.bias_update_rule == "zscore":
            std = counts.std(unbiased=False)
            if std == 0:
                return None
            step = self.bias_update_rate * deviation / std
        else:
            step = self.bias_update_rate * torch.sign(deviation)
        self.e_score_correction_bias.sub_(step.to(self.e_score_correction_bias.dtype))
        return step
