"""One SMoES training step for any host (spec §2.8, "per training forward"): the losses of every MoE layer from
its router logits and the scores its layers recorded, then the buffer updates.

A host model (i) builds one `SmoesLayerState` per MoE layer and one `SmoesRuntime`, (ii) in a training forward
calls `runtime.start(...)`, lets its layers record into the runtime, and (iii) hands the router logits to
`apply_smoes`, adding the returned `loss` to its task loss in place of its own auxiliary loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..balancing import sum_over_processes
from ..losses import _routing_probabilities
from ..precision import autocast_off
from .bins import soft_dispatch_counts
from .losses import bin_balance_loss, inter_bin_mutual_information
from .schedules import mi_coefficient, rebins_after
from .state import SmoesLayerState, SmoesRuntime


@dataclass
class SmoesLosses:
    """The SMoES terms of one training forward.

    Args:
        loss: `smoes_bal_coef * balance_loss + alpha_MI * mi_loss`, what replaces the base auxiliary loss.
        balance_loss: the bin-level balance loss, reduced over MoE layers (`smoes_layer_reduction`).
        mi_loss: minus the batch-mean inter-bin mutual information, reduced over MoE layers.
        layer_mi: (L,) the batch-mean MI of each MoE layer in nats, detached, for logging.
        bins: per MoE layer, the (E,) bins the losses used (those at the start of the step).
    """

    loss: torch.Tensor
    balance_loss: torch.Tensor
    mi_loss: torch.Tensor
    layer_mi: torch.Tensor
    bins: tuple[torch.LongTensor, ...]


def apply_smoes(
    config,
    states: Sequence[SmoesLayerState],
    runtime: SmoesRuntime,
    router_logits: Sequence[torch.Tensor],
    step: torch.Tensor,
    top_k_indices: Sequence[torch.LongTensor] | None = None,
    router_type: str = "softmax",
) -> SmoesLosses:
    """The losses of a training forward with the start-of-step bins, then (without gradient) the Gaussian and count
    EMAs, the step counter and the bin reassignment.

    Args:
        config: any config with the `smoes_*` fields (`SmoesConfigMixin`) and `num_experts_per_tok`.
        states: the MoE layers' states, in layer order.
        runtime: the runtime the host's layers recorded into during this forward (still started).
        router_logits: per MoE layer, the logits of all B*T tokens (transformers' blocks) or of the valid ones only
            (the zoo's `SparseMoeBlock`), (N, E).
        step: the host's `smoes_step` buffer (0-d int64), incremented here.
        top_k_indices: per MoE layer, the experts the router selected (N, k); by default the top-k of the gates,
            which is the selection of routers without a selection bias.
        router_type: `"softmax"` (gates = softmax of the logits) or `"sigmoid"` (normalised sigmoid affinities).
    """
    if len(router_logits) != len(states):
        raise ValueError(
            f"apply_smoes: {len(states)} MoE layer states but {len(router_logits)} router logits; pass one of each per "
            "MoE layer, in the same order"
        )
    unrecorded = [position for position, state in enumerate(states) if state not in runtime.layer_scores]
    if unrecorded:
        raise ValueError(
            f"apply_smoes: no scores were recorded for the MoE layers at positions {unrecorded}; start the runtime "
            "before the forward and let every MoE block call runtime.record_router_input"
        )
    valid = runtime.valid
    current_step = int(step)
    mi_coef = mi_coefficient(config.smoes_mi_coef, config.smoes_mi_warmup_steps, current_step)
    balance_terms, mi_terms, selections = [], [], []
    # fp32 gates and fp32 sums: under autocast the einsums of the terms would otherwise run in bf16.
    with autocast_off(valid):
        for position, (state, logits) in enumerate(zip(states, router_logits)):
            gates = _routing_probabilities(per_token_rows(logits, valid).float(), router_type)  # (B, T, E)
            if top_k_indices is None:
                selected = gates.topk(config.num_experts_per_tok, dim=-1).indices
            else:
                selected = per_token_rows(top_k_indices[position], valid)
            selections.append(selected)
            balance_terms.append(
                bin_balance_loss(gates, selected, state.bins, state.num_bins, valid, mode=config.smoes_bal_mode)
            )
            information = inter_bin_mutual_information(
                gates, runtime.layer_scores[state], state.bins, state.num_bins, valid,
                min_modality_mass=config.smoes_mi_min_modality_mass,
            )
            mi_terms.append(information.mean())
    reduce = torch.sum if config.smoes_layer_reduction == "sum" else torch.mean
    balance_loss = reduce(torch.stack(balance_terms))
    mi_loss = -reduce(torch.stack(mi_terms))
    losses = SmoesLosses(
        loss=config.smoes_bal_coef * balance_loss + mi_coef * mi_loss,
        balance_loss=balance_loss,
        mi_loss=mi_loss,
        layer_mi=torch.stack(mi_terms).detach(),
        bins=tuple(state.bins.clone() for state in states),
    )
    _update_buffers(config, states, runtime, selections, current_step)
    step.add_(1)
    return losses


@torch.no_grad()
def _update_buffers(config, states, runtime: SmoesRuntime, selections, current_step: int) -> None:
    beta = config.smoes_ema_beta
    rebin = config.smoes_binning == "adaptive" and rebins_after(
        current_step, config.smoes_rebin_interval, config.smoes_freeze_bins_after
    )
    for state, selected in zip(states, selections):
        if state in runtime.layer_moments:
            state.update_gaussian(runtime.layer_moments[state].summed_over_processes(), beta)
        counts = soft_dispatch_counts(selected, runtime.layer_scores[state], runtime.valid, state.bins.numel())
        state.update_expert_counts(sum_over_processes(counts), beta)
        if rebin:
            state.reassign_bins()


def per_token_rows(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N, X) rows of all B*T tokens or of the valid ones only -> (B, T, X); padding rows are zero-filled."""
    if rows.shape[0] == valid.numel():
        return rows.reshape(*valid.shape, -1)
    if rows.shape[0] != int(valid.sum()):
        raise ValueError(
            f"apply_smoes: router rows for {rows.shape[0]} tokens, but the batch has {valid.numel()} tokens of which "
            f"{int(valid.sum())} are valid"
        )
    return rows.new_zeros(*valid.shape, rows.shape[-1]).masked_scatter(valid[..., None], rows)


def check_routers_trainable(config, router_weights: dict[str, torch.Tensor]) -> None:
    """The SMoES losses act only through the routers: refuse a training forward whose routers are frozen while a
    loss coefficient is non-zero (statistics-only forwards, with both coefficients 0, are fine)."""
    if config.smoes_bal_coef == 0 and config.smoes_mi_coef == 0:
        return
    frozen = [name for name, weight in router_weights.items() if not weight.requires_grad]
    if frozen:
        raise ValueError(
            f"{type(config).__name__}.smoes_mi_coef={config.smoes_mi_coef} and smoes_bal_coef="
            f"{config.smoes_bal_coef} train the routers, but {len(frozen)} router weights are frozen ({frozen[0]}, ...); "
            "make the routers trainable, or set both coefficients to 0 to only update the SMoES statistics"
        )
