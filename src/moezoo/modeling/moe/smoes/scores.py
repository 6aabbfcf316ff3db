"""Soft modality scores M (SMoES spec §2.1): per token and MoE layer, a distribution over the two modalities.

M[..., TEXT] + M[..., VISION] = 1. Every function here runs without gradient: M is a signal that weights the
regulariser, never a path for gradients. Three estimators:

- `"hard"`: the one-hot hard label at every layer (the paper's ablation);
- `"attention"`: starts from the hard label and, at each softmax-attention layer, mixes the neighbours' scores with
  the head-averaged attention weights, then fuses the mixed and previous scores weighted by the norms of the token
  mixer's output and of the residual stream (`attention_mixed_scores`, `residual_score_update`); linear-attention
  layers, which have no attention matrix, carry M unchanged;
- `"gaussian"`: a diagonal Gaussian per modality fitted on the router inputs (buffers of `SmoesLayerState`), and a
  softmax over the two log-likelihoods at temperature tau (`gaussian_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F


TEXT, VISION = 0, 1  # the modality index m of every (..., 2) score tensor
NUM_MODALITIES = 2
SCORE_TYPES = ("attention", "gaussian", "hard")


@torch.no_grad()
def hard_modality(mm_token_type_ids: torch.Tensor, vision_token_types: Sequence[int]) -> torch.LongTensor:
    """(B, T) VISION for image/video placeholders (`mm_token_type_ids` in `vision_token_types`), TEXT for every other
    token, the vision start/end markers and chat-template tokens included."""
    vision_types = torch.tensor(list(vision_token_types), device=mm_token_type_ids.device)
    return torch.isin(mm_token_type_ids, vision_types).long()


@torch.no_grad()
def one_hot_scores(modality: torch.LongTensor) -> torch.Tensor:
    """(...,) hard labels -> (..., 2) fp32 scores."""
    return F.one_hot(modality, NUM_MODALITIES).float()


@torch.no_grad()
def attention_mixed_scores(
    query: torch.Tensor,  # (B, H, T, d), after q_norm and RoPE
    key: torch.Tensor,  # (B, H_kv, T, d), after k_norm and RoPE
    scores: torch.Tensor,  # (B, T, 2) fp32, the scores entering the layer
    attention_mask: torch.Tensor | None,  # 4D (B, 1, T, T) bool or additive, or None for plain causal attention
) -> torch.Tensor:
    """`mean_h(Attn_h) @ M` (B, T, 2) fp32, without materialising the attention matrix: each softmax row sums to 1,
    so it is one extra attention pass with the scores as values, averaged over heads."""
    batch_size, num_kv_heads, length, _ = key.shape
    values = scores[:, None].expand(batch_size, num_kv_heads, length, NUM_MODALITIES).to(query.dtype)
    mixed = F.scaled_dot_product_attention(
        query,
        key,
        values,
        attn_mask=attention_mask,
        is_causal=attention_mask is None,
        enable_gqa=query.shape[1] != num_kv_heads,
    )
    return mixed.mean(dim=1).float()


@torch.no_grad()
def residual_score_update(
    scores: torch.Tensor,  # (B, T, 2) M^(l)
    mixed_scores: torch.Tensor,  # (B, T, 2) M~^(l)
    mixer_output: torch.Tensor,  # (B, T, D) x_attn^(l), what the token mixer adds to the residual stream
    residual: torch.Tensor,  # (B, T, D) x^(l), the decoder layer's input
    eps: float = 1e-6,
) -> torch.Tensor:
    """M^(l+1) = (|x_attn| M~ + |x| M) / (|x_attn| + |x|): the norms weigh the attention and residual branches the way
    x^(l+1) = x^(l) + x_attn^(l) does."""
    mixer_norm = mixer_output.float().norm(dim=-1, keepdim=True)
    residual_norm = residual.float().norm(dim=-1, keepdim=True)
    return (mixer_norm * mixed_scores + residual_norm * scores) / (mixer_norm + residual_norm).clamp_min(eps)


@torch.no_grad()
def gaussian_scores(
    features: torch.Tensor,  # (N, D) router inputs
    mean: torch.Tensor,  # (2, D)
    var: torch.Tensor,  # (2, D)
    tau: float,
    var_eps: float,
) -> torch.Tensor:
    """softmax_m(LL_m / tau) (N, 2) fp32, with LL_m = -1/2 sum_d (log var_md + (x_d - mean_md)^2 / var_md) the
    diagonal-Gaussian log-likelihood up to a constant shared by both modalities."""
    var = var.float().clamp_min(var_eps)
    centred = features.float()[:, None, :] - mean.float()[None]  # (N, 2, D)
    log_likelihood = -0.5 * (var.log()[None] + centred.square() / var[None]).sum(dim=-1)
    return torch.softmax(log_likelihood / tau, dim=-1)
