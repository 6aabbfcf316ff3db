"""The trained actions inside one adaptive forward (spec moemb.md §3.1, §3.4, §3.7, §3.10, §3.13): what
`AdaptiveForward` asks of the gates at its hook points, at inference (hard decisions) and under a
`GateControl(train=True)` (differentiable forms), and the masked token mixers of pruner training (spec A-18).

Masked training semantics of the one-shot pruner (keep mask m, straight-through, from block n + 1 on): attention
weights A_ij = m_j exp(s_ij) / Σ_k m_k exp(s_ik) (eager math); Gated DeltaNet with β ← m β, g ← m g and the
convolution input multiplied by m (a dropped token neither writes nor decays the state); the MoE output times m.
At inference the pruned tokens are removed physically, as every token-pruning method here does.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

from .gates import (
    DROP,
    SKIP,
    GateControl,
    GateRecord,
    action_log_probs,
    gumbel_keep,
    null_expert_slots,
    sample_actions,
    skip_probability,
    straight_through,
)
from ..moemb_flops import TokenDecisions, logical_flops
from .selection import keep_highest


class TrainedActions:
    """The trained actions of one forward; `forward` is the `AdaptiveForward` whose metadata and records they use."""

    def __init__(self, forward, control: GateControl | None, text_model):
        self.forward = forward
        self.layers = text_model.layers
        self.token_pruner = getattr(text_model, "token_pruner", None)
        self.control = control or GateControl()
        self.train = self.control.train
        settings = forward.settings
        self.policy = self.control.policy or settings.efficiency_policy
        self.skip_gate = settings.expert_skip == "learned"
        self.null_experts = settings.top_k == "null_experts"
        self.layer_skip = settings.layer_skip == "learned"
        self.pruner = settings.token_pruning == "learned"
        self.protect_text = forward.config.gate_modules().protect_text
        self.pruner_layer = forward.config.gate_modules().pruner_layer
        batch, length = forward.metadata.alive.shape
        num_segments = int(forward.metadata.segment_id.max()) + 1
        num_layers = forward.config.text_config.num_hidden_layers
        self.record = self.control.record = GateRecord(
            alive=forward.metadata.alive, token_segments=forward.metadata.segment_id[forward.metadata.alive]
        )
        if self.policy is not None:
            self.record.actions = torch.full((batch, length, num_layers), -1, dtype=torch.long)
            self.record.log_prob_sum = torch.zeros(num_segments, device=forward.metadata.alive.device)
            self.record.decisions = torch.zeros(num_segments, dtype=torch.long)
        self.layer_skipped = torch.zeros((num_segments, num_layers), dtype=torch.float64)
        self.input_segment = forward.metadata.segment_id.cpu()  # (B, S) input layout
        self.router_input = None  # (T, d) the current MoE block's router input, set by a pre-hook
        if self.train and self.pruner and settings.execution != "masked":
            raise ValueError(
                "training the token pruner runs masked (the keep mask acts inside attention and Gated DeltaNet): "
                "set adaptive.execution='masked'"
            )
        self.key_keep = None  # (B, S) straight-through keep mask of pruner training, from block n + 1 on

    @property
    def is_active(self) -> bool:
        return any((self.policy, self.skip_gate, self.null_experts, self.layer_skip, self.pruner))

    def capture_router_input(self, router: torch.nn.Module):
        def hook(module, inputs):
            self.router_input = inputs[0]

        return router.register_forward_pre_hook(hook)

    # --- routed slots (inside the MoE block) ---

    def route(self, layer_idx, routed, logits, index, skip, drop, kept):
        """The decisions of the efficiency head and the null experts at one layer: returns `(skip, drop, kept,
        renormalize, scale)`, `renormalize` None to keep the settings' choice and `scale` `(T,)` the soft fade."""
        meta, record = self.forward.metadata, self.record
        block = self.layers[layer_idx].mlp
        x = self.router_input
        candidates = self.forward.deciding().flatten()[routed]  # not the pooled token, nor a bypassing one
        renormalize, scale = None, None
        if self.null_experts:  # renormalised over the physical experts kept (spec A-23)
            null_logits = block.null_router(x)
            kept = kept & null_expert_slots(logits, index, null_logits)
            renormalize = True
            if self.train:
                record.joint_router_logits.append(torch.cat([logits, null_logits], dim=-1))
            record.physical_experts.append(kept.sum(-1).detach())
        if not (self.skip_gate or self.policy):
            return skip, drop, kept, renormalize, scale
        drop_allowed = candidates
        if self.protect_text:
            drop_allowed = drop_allowed & (meta.modality.flatten()[routed] > 0)
        head_logits = block.efficiency_head(x, drop_allowed)
        if self.skip_gate:
            p_skip = torch.where(candidates, skip_probability(head_logits), 0.0)
            if self.train:  # soft fade h = v + (1 - p_skip) u
                record.skip_probability.append(p_skip)
                record.skip_candidates.append(candidates)
                return skip, drop, kept, renormalize, 1 - p_skip
            return skip | (candidates & (p_skip > self.forward.settings.skip_threshold)), drop, kept, renormalize, scale
        return (*self._policy_actions(layer_idx, routed, head_logits, candidates, skip, drop), kept, renormalize, scale)

    def _policy_actions(self, layer_idx, routed, head_logits, candidates, skip, drop):
        meta, record, control = self.forward.metadata, self.record, self.control
        log_probs = action_log_probs(head_logits, control.temperature)
        rows = torch.arange(meta.alive.shape[0], device=routed.device)[:, None].expand_as(meta.alive).flatten()[routed]
        columns = meta.original_index.flatten()[routed]
        if self.policy == "sample" and control.draws is not None:
            actions = control.draws.actions(log_probs, control.generator, rows, columns, record.actions.shape[1])
        elif self.policy == "sample":
            actions = sample_actions(log_probs, control.generator)
        elif self.policy == "forced":
            actions = control.actions.to(routed.device)[rows, columns, layer_idx]
            if bool((actions[candidates] < 0).any()):
                raise ValueError(
                    f"GateControl.actions has no action (-1) at layer {layer_idx} for a token that reaches it: replay "
                    "the actions recorded by a forward on the same inputs"
                )
        else:  # greedy
            actions = log_probs.argmax(-1)
        actions = torch.where(candidates, actions, 0)  # the pooled token always routes, taking no decision
        record.actions[rows.cpu(), columns.cpu(), layer_idx] = torch.where(candidates, actions, -1).cpu()
        taken = log_probs.gather(1, actions[:, None])[:, 0]
        segment = meta.segment_id.flatten()[routed]
        record.log_prob_sum = record.log_prob_sum.index_add(0, segment[candidates], taken[candidates])
        record.decisions += torch.bincount(segment[candidates].cpu(), minlength=record.decisions.numel())
        new_drop = candidates & (actions == DROP)
        if bool(new_drop.any()):
            pending = torch.zeros(meta.alive.numel(), dtype=torch.bool, device=routed.device)
            pending[routed.nonzero().flatten()] = new_drop
            pending = pending.view_as(meta.alive)
            previous = self.forward.pending_drop
            self.forward.pending_drop = pending if previous is None else previous | pending
        return skip | (candidates & (actions == SKIP)), drop | new_drop

    # --- between layers ---

    def layer_skip_mask(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`(B, S, 1)` 1 where the token's sample skips block `layer_idx` (straight-through in training), from the
        pooled token's hidden state at the block's input; None for a block without a gate."""
        gate = getattr(self.layers[layer_idx], "skip_gate", None)
        if not self.layer_skip or gate is None:
            return None
        meta = self.forward.metadata
        pooled_segments = meta.segment_id[meta.is_pooled]
        q = torch.sigmoid(gate(hidden_states[meta.is_pooled]).float()[:, 0])
        skip = straight_through(q) if self.train else (q > 0.5).float()
        per_segment = torch.zeros(self.layer_skipped.shape[0], device=q.device).index_put((pooled_segments,), skip)
        if self.train:
            self.record.layer_skip_probability[layer_idx] = q
            self.record.layer_skip_mask[layer_idx] = skip
        self.layer_skipped[pooled_segments.cpu(), layer_idx] = skip.detach().double().cpu()
        return per_segment[meta.segment_id][..., None].to(hidden_states.dtype)

    def after_block(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """The one-shot pruner's decision after block n (spec §3.1): at inference the dropped tokens leave the forward
        (`pending_drop`); in training the straight-through keep mask of the later blocks."""
        if not self.pruner or layer_idx != self.pruner_layer:
            return
        forward, meta = self.forward, self.forward.metadata
        logits = self.token_pruner(hidden_states)
        candidates = meta.alive & (meta.modality > 0) & ~meta.is_pooled
        if self.train:
            control = self.control
            gumbel = None if control.draws is None else control.draws.noise(control.generator, logits.shape[1], 2)
            hard, soft = gumbel_keep(logits, control.gumbel_temperature, control.generator, gumbel)
            self.key_keep = torch.where(candidates, hard, 1.0).to(hidden_states.dtype)
            self.record.keep_probability = torch.where(candidates, soft, 1.0)
            self.record.keep_mask = self.key_keep
            self.record.keep_candidates = candidates
            return
        score = (logits[..., 0] - logits[..., 1]).float()
        if forward.settings.pruner_decision == "budget":
            kept = keep_highest(
                score.flatten(), meta.segment_id.flatten(), candidates.flatten(), forward.settings.keep_ratio
            ).view_as(candidates)
        else:
            kept = score > 0
        drop = candidates & ~kept
        if bool(drop.any()):
            rows = torch.arange(drop.shape[0], device=drop.device)[:, None].expand_as(drop)
            # Counted as a DROP at block n (the FLOPs model's nearest action): the routed experts the pruned tokens
            # did run at block n are left out of the FLOPs, a slight overstatement of the saving.
            where = (rows[drop].cpu(), meta.original_index[drop].cpu(), layer_idx)
            forward.dropped[where], forward.skipped[where] = True, False  # drop and skip are exclusive
            forward.pending_drop = drop if forward.pending_drop is None else forward.pending_drop | drop

    def sample_layer_skip(self, real: torch.Tensor) -> torch.Tensor:
        """`(T, L)` layer-skip decisions of the real tokens (row-major), from their samples'."""
        segments = self.input_segment[real]
        return self.layer_skipped[segments]

    def sample_report(self, config, cu_seqlens: torch.Tensor, decisions: TokenDecisions) -> dict:
        """`AdaptiveReport`'s per-sample fields: S(a) of each item's language model (the vision tower runs in full
        whatever the gates decide, so it is left out), and the blocks each item bypassed."""
        bounds = torch.as_tensor(cu_seqlens).long().cpu().tolist()
        savings = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            own = TokenDecisions(**{name: getattr(decisions, name)[start:end] for name in
                                    ("drop", "skip", "experts_per_token", "layer_skip")})  # fmt: skip
            lengths = torch.tensor([0, end - start])
            savings.append(1.0 - logical_flops(config, lengths, own).total / logical_flops(config, lengths).total)
        return {"sample_flops_saving": torch.tensor(savings, dtype=torch.float64), "layer_skipped": self.layer_skipped}


# --- masked token mixers (pruner training) ----------------------------------------------------------------------------


def masked_attention(attention, hidden_states, position_embeddings, padding, keep):
    """`Qwen3_5MoeAttention` (gated attention) with the multiplicative key mask `keep` `(B, S)`:
    A_ij = m_j exp(s_ij) / Σ_k m_k exp(s_ik) over the causal, non-padding keys (eager math)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    query, gate = torch.chunk(attention.q_proj(hidden_states).view(*input_shape, -1, attention.head_dim * 2), 2, -1)
    gate = gate.reshape(*input_shape, -1)
    query = attention.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = attention.k_norm(attention.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = attention.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = qwen.apply_rotary_pos_emb(query, key, *position_embeddings)
    key = qwen.repeat_kv(key, attention.num_key_value_groups)
    value = qwen.repeat_kv(value, attention.num_key_value_groups)
    scores = (query @ key.transpose(2, 3)).float() * attention.scaling
    length = hidden_states.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()[None, None]
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    probs = probs * keep.float()[:, None, None, :]
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
    output = (probs.to(value.dtype) @ value).transpose(1, 2).reshape(*input_shape, -1)
    return attention.o_proj(output * torch.sigmoid(gate))


def masked_gated_delta_net(module, hidden_states, padding, keep):
    """`Qwen3_5MoeGatedDeltaNet.forward` (no cache) with the keep mask `keep` `(B, S)`: the convolution input, β and
    the decay g multiplied by it."""
    if padding is not None:
        hidden_states = hidden_states * padding[:, :, None].to(hidden_states.dtype)
    batch, length, _ = hidden_states.shape
    keep = keep[:, :, None]
    mixed_qkv = (module.in_proj_qkv(hidden_states) * keep.to(hidden_states.dtype)).transpose(1, 2)
    z = module.in_proj_z(hidden_states).reshape(batch, length, -1, module.head_v_dim)
    mixed_qkv = qwen.causal_conv1d_fn(
        mixed_qkv, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation
    ).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    beta = module.in_proj_b(hidden_states).sigmoid() * keep
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias) * keep
    core, _ = qwen.torch_chunk_gated_delta_rule(
        query.reshape(batch, length, -1, module.head_k_dim),
        key.reshape(batch, length, -1, module.head_k_dim),
        value.reshape(batch, length, -1, module.head_v_dim),
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(batch, length, -1))
