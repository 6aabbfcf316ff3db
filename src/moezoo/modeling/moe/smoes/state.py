"""What SMoES keeps: the per-MoE-layer buffers (`SmoesLayerState`, saved with the model) and the per-forward runtime
that a host's layers share during one training forward (`SmoesRuntime`, never saved).

Buffers of one MoE layer (spec §5), all persistent so that a checkpoint resumes training exactly:

    gauss_mean        (2, D) fp32   per-modality mean of the router inputs (EMA)
    gauss_var         (2, D) fp32   per-modality variance (EMA)
    gauss_initialized (2,)   bool   until both are set, Gaussian scores fall back to the hard labels
    expert_counts_ema (2, E) fp32   EMA of the soft-score-weighted top-k dispatches per modality
    bins              (E,)   int64  the bin of each expert, contiguous ranges at initialisation
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from ..balancing import sum_over_processes
from ..router import is_recomputing
from .bins import adaptive_bins, contiguous_bins
from .scores import NUM_MODALITIES, attention_mixed_scores, gaussian_scores, one_hot_scores, residual_score_update


@dataclass
class ModalityMoments:
    """Sufficient statistics of one forward's router inputs per hard modality, in float64 so that
    `sum_sq / count - mean^2` does not cancel catastrophically for large activations."""

    count: torch.Tensor  # (2,)
    total: torch.Tensor  # (2, D) sum of x
    total_sq: torch.Tensor  # (2, D) sum of x^2

    @classmethod
    @torch.no_grad()
    def of(cls, features: torch.Tensor, modality: torch.LongTensor) -> ModalityMoments:
        """features (N, D) of valid tokens, modality (N,) their hard labels."""
        membership = F.one_hot(modality, NUM_MODALITIES).double()  # (N, 2)
        features = features.double()
        return cls(membership.sum(dim=0), membership.T @ features, membership.T @ features.square())

    def summed_over_processes(self) -> ModalityMoments:
        flat = sum_over_processes(torch.cat([self.count[:, None], self.total, self.total_sq], dim=1))
        hidden_size = self.total.shape[1]
        return ModalityMoments(flat[:, 0], flat[:, 1 : 1 + hidden_size], flat[:, 1 + hidden_size :])


class SmoesLayerState(nn.Module):
    """The SMoES buffers of one MoE layer (no parameters). A host's MoE block holds one as its `smoes` child."""

    def __init__(self, hidden_size: int, num_experts: int, num_bins: int):
        super().__init__()
        self.num_bins = num_bins
        # fp32 explicitly: `from_pretrained(dtype=torch.bfloat16)` builds the model under that default dtype, and loads
        # each buffer in the dtype it was built in.
        self.register_buffer("gauss_mean", torch.zeros(NUM_MODALITIES, hidden_size, dtype=torch.float32))
        self.register_buffer("gauss_var", torch.ones(NUM_MODALITIES, hidden_size, dtype=torch.float32))
        self.register_buffer("gauss_initialized", torch.zeros(NUM_MODALITIES, dtype=torch.bool))
        self.register_buffer("expert_counts_ema", torch.zeros(NUM_MODALITIES, num_experts, dtype=torch.float32))
        self.register_buffer("bins", contiguous_bins(num_experts, num_bins))

    def init_buffers(self) -> None:
        """The initial values, for a host's `_init_weights` (the `transformers.initialization` functions leave
        buffers loaded from a checkpoint as they are)."""
        init.zeros_(self.gauss_mean)
        init.ones_(self.gauss_var)
        init.zeros_(self.gauss_initialized)
        init.zeros_(self.expert_counts_ema)
        init.copy_(self.bins, contiguous_bins(self.bins.numel(), self.num_bins, device=self.bins.device))

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would round the statistics, whose (1 - beta) ~ 1e-2 EMA steps bf16 cannot hold:
        # they follow the model to another device but stay fp32.
        statistics = {name: buffer for name, buffer in self._buffers.items() if buffer.is_floating_point()}
        super()._apply(fn, recurse)
        for name, buffer in statistics.items():
            if self._buffers[name].dtype != torch.float32:
                self._buffers[name] = buffer.to(self._buffers[name].device, torch.float32)
        return self

    @torch.no_grad()
    def gaussian_scores(
        self, features: torch.Tensor, modality: torch.LongTensor, tau: float, var_eps: float
    ) -> torch.Tensor:
        """(N, 2) Gaussian scores of router inputs (N, D); the hard one-hot until both modalities have statistics."""
        if not bool(self.gauss_initialized.all()):
            return one_hot_scores(modality)
        return gaussian_scores(features, self.gauss_mean, self.gauss_var, tau, var_eps)

    @torch.no_grad()
    def update_gaussian(self, moments: ModalityMoments, beta: float) -> None:
        """EMA-Welford: the new (mean, var) are those of the mixture {old statistics: beta, this batch: 1 - beta},

            delta = mean_b - mean;  var <- beta var + (1 - beta) var_b + beta (1 - beta) delta^2;  mean += (1 - beta) delta

        The first update copies the batch statistics; a modality with fewer than 2 tokens in the batch is skipped."""
        for m in range(NUM_MODALITIES):
            count = moments.count[m]
            if count < 2:
                continue
            batch_mean = moments.total[m] / count
            batch_var = (moments.total_sq[m] / count - batch_mean.square()).clamp_min(0)
            if not self.gauss_initialized[m]:
                self.gauss_mean[m] = batch_mean
                self.gauss_var[m] = batch_var
                self.gauss_initialized[m] = True
                continue
            delta = batch_mean - self.gauss_mean[m].double()
            self.gauss_var[m] = beta * self.gauss_var[m] + (1 - beta) * batch_var + beta * (1 - beta) * delta.square()
            self.gauss_mean[m] += (1 - beta) * delta

    @torch.no_grad()
    def update_expert_counts(self, counts: torch.Tensor, beta: float) -> None:
        """C_ema <- beta C_ema + (1 - beta) C, from this forward's (2, E) soft dispatch counts."""
        self.expert_counts_ema.mul_(beta).add_(counts.to(self.expert_counts_ema.dtype), alpha=1 - beta)

    @torch.no_grad()
    def reassign_bins(self) -> None:
        """Adaptive binning: sort the experts by text preference and cut them into equal bins."""
        self.bins.copy_(adaptive_bins(self.expert_counts_ema, self.num_bins))


class SmoesRuntime:
    """What the layers of a host model share during one training forward: the tokens' hard modality and validity,
    the attention-estimator recursion, and, per MoE layer, the scores its router saw and (for the Gaussian
    estimator) the moments of its inputs. Inactive outside `start()`/`stop()`, so eval and generation do nothing;
    nothing is recorded while gradient checkpointing re-runs a layer, so each forward counts once.

    Args:
        score_type: `"attention"`, `"gaussian"` or `"hard"` (spec §2.1).
        gauss_tau: the Gaussian estimator's temperature (tau = smoes_gauss_tau_scale * hidden_size).
        gauss_var_eps: the variance floor of the Gaussian estimator.
    """

    def __init__(self, score_type: str, gauss_tau: float, gauss_var_eps: float):
        self.score_type = score_type
        self.gauss_tau = gauss_tau
        self.gauss_var_eps = gauss_var_eps
        self.stop()

    def start(self, modality: torch.LongTensor, valid: torch.Tensor) -> None:
        """Begin a training forward of (B, T) tokens with hard labels `modality` and padding mask `valid`."""
        self.modality = modality
        self.valid = valid.bool()
        self.layer_scores: dict[SmoesLayerState, torch.Tensor] = {}  # per MoE layer: the (B, T, 2) scores its router saw
        self.layer_moments: dict[SmoesLayerState, ModalityMoments] = {}
        # The attention estimator's M^(l), advanced by every decoder layer; M^(0) is the hard label.
        self.attention_scores = one_hot_scores(modality) if self.score_type == "attention" else None
        self._layer_input = self._mixed_scores = None

    def stop(self) -> None:
        """End the forward: forget its tokens and what its layers recorded; inactive until the next `start()`."""
        self.modality = self.valid = self.attention_scores = self._layer_input = self._mixed_scores = None
        self.layer_scores, self.layer_moments = {}, {}

    @property
    def recording(self) -> bool:
        """Whether the layers record now: inside a training forward, and not in gradient checkpointing's re-run."""
        return self.modality is not None and not is_recomputing()

    @property
    def tracks_attention(self) -> bool:
        """Whether the decoder and attention layers advance the attention estimator now."""
        return self.recording and self.score_type == "attention"

    def enter_layer(self, hidden_states: torch.Tensor) -> None:
        """Called by every decoder layer with its input x^(l) (B, T, D), whose norm weighs the residual branch."""
        self._layer_input = hidden_states

    @torch.no_grad()
    def mix_attention_scores(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> None:
        """Called by a softmax-attention layer with its post-RoPE queries and keys and its mask: M~ = mean_h Attn_h M.
        A mask that is not 4D (flash attention's 2D padding mask) is replaced by a causal mask over valid keys."""
        if attention_mask is not None and attention_mask.dim() != 4:
            length = self.valid.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
            attention_mask = causal[None, None] & self.valid[:, None, None, :]
        self._mixed_scores = attention_mixed_scores(query, key, self.attention_scores, attention_mask)

    @torch.no_grad()
    def advance_attention_scores(self, mixer_output: torch.Tensor) -> None:
        """Called by a softmax-attention layer with its output x_attn^(l) (B, T, D), after `mix_attention_scores`:
        M^(l+1) from M^(l), M~ and the norms of the two branches. Layers that never call it (linear attention, which
        has no attention matrix) carry M unchanged."""
        updated = residual_score_update(self.attention_scores, self._mixed_scores, mixer_output, self._layer_input)
        # Padding queries may attend to nothing (a NaN row): they keep their scores, which nothing reads.
        self.attention_scores = torch.where(self.valid[..., None], updated, self.attention_scores)
        self._layer_input = self._mixed_scores = None

    @torch.no_grad()
    def record_router_input(self, state: SmoesLayerState, hidden_states: torch.Tensor) -> None:
        """Called by a MoE block, with its state, on its router input (B, T, D): stores the scores of its tokens."""
        if self.score_type == "attention":
            scores = self.attention_scores
        elif self.score_type == "hard":
            scores = one_hot_scores(self.modality)
        else:
            features = hidden_states.reshape(-1, hidden_states.shape[-1])
            modality = self.modality.reshape(-1)
            scores = state.gaussian_scores(features, modality, self.gauss_tau, self.gauss_var_eps)
            scores = scores.view(*self.modality.shape, -1)
            valid = self.valid.reshape(-1)
            self.layer_moments[state] = ModalityMoments.of(features[valid], modality[valid])
        self.layer_scores[state] = scores
