"""The two SMoES losses of one MoE layer (spec §2.3-§2.4), from the layer's full softmax gates.

`gates` are the router's full softmax over all experts in fp32, recomputed from the router logits: they carry the
gradient into the router (and, through its input, into earlier layers). The soft modality scores are detached and
padding is excluded through `valid`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..balancing import number_of_processes, sum_over_processes


BALANCE_MODES = ("global", "intra_bin")


def inter_bin_mutual_information(
    gates: torch.Tensor,  # (B, T, E) full softmax gates
    scores: torch.Tensor,  # (B, T, 2) soft modality scores, no gradient
    bins: torch.LongTensor,  # (E,) bin of each expert
    num_bins: int,
    valid: torch.Tensor,  # (B, T) bool
    min_modality_mass: float = 1.0,
    eps: float = 1e-12,
) -> torch.Tensor:
    """I_i(M; B) per sample (B,), in nats, in [0, ln 2].

    S[i, m, k] = sum_{e in bin k} sum_j M[i, j, m] g[i, j, e] / (N_B sum_j M[i, j, m]) is the mean gate of bin k
    over the sample's modality-m tokens; normalised over (m, k) it is the joint P_i(m, k). Its modality marginal is
    uniform (sum_k S[i, m, k] = 1 / N_B for every m), so I_i is the Jensen-Shannon divergence between the bin
    distributions of text and vision, whatever the token counts of the two modalities.

    A modality whose score mass in the sample is below `min_modality_mass` tokens is dropped; a sample left with
    fewer than two modalities has I_i = 0 (and no gradient), but still counts in the batch mean.
    """
    experts_per_bin = gates.shape[-1] // num_bins
    weights = torch.where(valid[..., None], scores.to(gates.dtype), 0.0)  # (B, T, 2)
    modality_mass = weights.sum(dim=1)  # (B, 2)
    gate_mass = torch.einsum("btm,bte->bme", weights, gates)  # (B, 2, E)
    bin_gate_mass = gate_mass @ F.one_hot(bins, num_bins).to(gates.dtype)  # (B, 2, K)
    mean_bin_gate = bin_gate_mass / (experts_per_bin * modality_mass.clamp_min(eps)[..., None])
    present = modality_mass >= min_modality_mass  # (B, 2)
    mean_bin_gate = mean_bin_gate * present[..., None]
    joint = mean_bin_gate / mean_bin_gate.sum(dim=(1, 2), keepdim=True).clamp_min(eps)
    modality_marginal = joint.sum(dim=2, keepdim=True)
    bin_marginal = joint.sum(dim=1, keepdim=True)
    information = (joint * (torch.log(joint + eps) - torch.log(modality_marginal * bin_marginal + eps))).sum((1, 2))
    return torch.where(present.sum(dim=1) >= 2, information, 0.0)


def bin_balance_loss(
    gates: torch.Tensor,  # (..., E) full softmax gates
    top_k_index: torch.LongTensor,  # (..., k) the router's selection
    bins: torch.LongTensor,  # (E,)
    num_bins: int,
    valid: torch.Tensor,  # (...) bool
    mode: str = "global",
    eps: float = 1e-12,
) -> torch.Tensor:
    """The bin-level balance loss of one layer: N_B sum_k sum_{e in bin k} f_e P_e, with f_e the fraction of valid
    tokens whose top-k holds e (sum_e f_e = k, transformers' convention) and P_e the mean gate of e.

    Both are the global batch's under data parallelism: f_e (no gradient) counts the tokens of every process
    (`sum_over_processes`), and each process's P_e sums the gates of its own tokens over the valid tokens of all the
    processes, times their number. The mean of the processes' losses, and of their gradients (as DDP and FSDP2 average
    them), is then what one process computes on the global batch, whatever number of valid tokens each process holds
    (padding differs between processes). `"intra_bin"` renormalises each process's P_e inside each bin: a ratio of
    this process's gates, it stays a per-process term.

    `"global"` is the paper's formula read literally: it sums over all experts, so it is the Switch loss scaled by
    1 / num_bins (minimum k / num_bins at perfect balance) and keeps the load balanced across bins, hence across
    devices. `"intra_bin"` (an ablation) renormalises f and P inside each bin, balancing within a bin only
    (minimum num_bins).
    """
    num_experts = gates.shape[-1]
    experts_per_bin = num_experts // num_bins
    token_weights = valid.reshape(-1).to(gates.dtype)
    top_k = top_k_index.shape[-1]
    # (E + 1,) dispatches per expert and the token count, over all processes
    dispatches = torch.zeros(num_experts + 1, dtype=gates.dtype, device=gates.device).index_add_(
        0, top_k_index.reshape(-1), token_weights.repeat_interleave(top_k)
    )
    dispatches[-1] = token_weights.sum()
    dispatches = sum_over_processes(dispatches)
    num_tokens = dispatches[-1].clamp_min(1)
    dispatch_fraction = dispatches[:-1] / num_tokens
    gate_mass = (gates.reshape(-1, num_experts) * token_weights[:, None]).sum(dim=0)
    mean_gate = gate_mass * (number_of_processes() / num_tokens)
    if mode == "intra_bin":
        bin_one_hot = F.one_hot(bins, num_bins).to(gates.dtype)  # (E, K)
        dispatch_fraction = dispatch_fraction / (dispatch_fraction @ bin_one_hot)[bins].clamp_min(eps)
        mean_gate = mean_gate / (mean_gate @ bin_one_hot)[bins].clamp_min(eps)
    elif mode != "global":
        raise ValueError(f"bin_balance_loss mode={mode!r} is not one of {', '.join(map(repr, BALANCE_MODES))}")
    return experts_per_bin * (dispatch_fraction * mean_gate).sum()
