"""SMoES on Qwen3.5-MoE (spec smoes.md §1.3 "SMoES hook points"): transformers' `Qwen3_5MoeForConditionalGeneration`
with the SMoES bookkeeping of `moezoo.modeling.moe.smoes` and nothing else changed.

Every class subclasses its transformers counterpart and keeps its forward computation, so logits and generation
are those of the base model on the same weights, in eval and in training. Only a training forward with
`smoes_enabled` does more, without gradient and without touching any output:

- each decoder layer hands its input to the shared runtime; each softmax-attention layer mixes the attention
  estimator's scores with one extra attention pass (`SmoesQwen3_5MoeAttention`); Gated DeltaNet layers carry them;
- each MoE block records the scores of its router input and, for the Gaussian estimator, their moments
  (`SmoesQwen3_5MoeSparseMoeBlock`, whose `smoes` child holds the layer's buffers);
- the top-level forward computes the bin-level balance and inter-bin MI losses from the recorded router logits,
  adds them to the task loss in place of `router_aux_loss_coef * load_balancing_loss`, and updates the buffers.

What the Qwen3-VL-MoE host shares with this one lives in `common.py`; this file holds what is Qwen3.5's: its classes
and its gated attention's forward.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.integrations import use_experts_implementation
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeAttention,
    Qwen3_5MoeCausalLMOutputWithPast,
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeExperts,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeModel,
    Qwen3_5MoePreTrainedModel,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeSparseMoeBlock,
    Qwen3_5MoeTextModel,
    Qwen3_5MoeTextRotaryEmbedding,
    Qwen3_5MoeTopKRouter,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack

from ...configuration.smoes import SmoesQwen3_5MoeConfig, SmoesQwen3_5MoeTextConfig
from ..moe.smoes.state import SmoesRuntime
from .common import (
    Fp32RouterMixin,
    SmoesCausalLMOutputWithPast,
    SmoesDecoderLayerMixin,
    SmoesForConditionalGenerationMixin,
    SmoesModelMixin,
    SmoesPreTrainedModelMixin,
    SmoesSparseMoeBlockMixin,
    SmoesTextModelMixin,
)


# The SMoES text model keeps Qwen3.5-MoE's weight names and layouts, so a Qwen3.5-MoE checkpoint (per-expert 2D
# tensors on disk) loads through transformers' own conversion to fused experts, which is keyed by model type.
register_checkpoint_conversion_mapping(
    SmoesQwen3_5MoeTextConfig.model_type, get_checkpoint_conversion_mapping("qwen3_5_moe_text"), overwrite=True
)

@use_experts_implementation
class SmoesQwen3_5MoeExperts(Qwen3_5MoeExperts):
    """transformers' Qwen3.5-MoE experts, unchanged. Declared here because transformers lets a model switch its
    experts implementation (`experts_implementation=`) only when the model's own file carries the decorator."""


class SmoesQwen3_5MoeTopKRouter(Fp32RouterMixin, Qwen3_5MoeTopKRouter):
    """transformers' router, its logits fp32 under autocast (`Fp32RouterMixin`)."""


class SmoesQwen3_5MoeSparseMoeBlock(SmoesSparseMoeBlockMixin, Qwen3_5MoeSparseMoeBlock):
    """The Qwen3.5-MoE sparse block (with its gated shared expert), whose `smoes` child keeps the layer's SMoES
    buffers. In a training forward it records the soft modality scores of its router input before running unchanged."""

    experts_class = SmoesQwen3_5MoeExperts
    router_class = SmoesQwen3_5MoeTopKRouter


class SmoesQwen3_5MoeAttention(Qwen3_5MoeAttention):
    """Qwen3.5's gated softmax attention. In a training forward with the attention estimator it also mixes the soft
    modality scores with this layer's head-averaged attention (one extra attention pass with the scores as values,
    without gradient) and advances them by the norm-weighted residual rule."""

    def __init__(self, config: SmoesQwen3_5MoeTextConfig, layer_idx: int, runtime: SmoesRuntime):
        super().__init__(config, layer_idx)
        self.smoes_runtime = runtime

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[FlashAttentionKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(*input_shape, -1)

        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        tracks_scores = self.smoes_runtime.tracks_attention
        if tracks_scores:
            # The keys of this forward's tokens only, before a cache adds earlier ones: the scores cover these tokens.
            self.smoes_runtime.mix_attention_scores(query_states, key_states, attention_mask)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = attn_output * torch.sigmoid(gate)

        attn_output = self.o_proj(attn_output)
        if tracks_scores:
            self.smoes_runtime.advance_attention_scores(attn_output)
        return attn_output, attn_weights


class SmoesQwen3_5MoeDecoderLayer(SmoesDecoderLayerMixin, Qwen3_5MoeDecoderLayer):
    """Qwen3.5-MoE's decoder layer with the SMoES attention and sparse block. Its input x^(l) is what the attention
    estimator weighs the residual branch by."""

    def __init__(self, config: SmoesQwen3_5MoeTextConfig, layer_idx: int, runtime: SmoesRuntime):
        super().__init__(config, layer_idx)
        if self.block_type == "full_attention":
            self.self_attn = SmoesQwen3_5MoeAttention(config, layer_idx, runtime)
        self.mlp = SmoesQwen3_5MoeSparseMoeBlock(config, runtime)
        self.smoes_runtime = runtime


class SmoesQwen3_5MoePreTrainedModel(SmoesPreTrainedModelMixin, Qwen3_5MoePreTrainedModel):
    config: SmoesQwen3_5MoeConfig
    _no_split_modules = ["SmoesQwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock"]


class SmoesQwen3_5MoeTextModel(SmoesTextModelMixin, SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeTextModel):
    """Qwen3.5-MoE's text model built from SMoES layers, which share one `smoes_runtime`. `smoes_step` counts the
    training forwards that updated the SMoES buffers (it drives the alpha_MI warm-up and the re-binning)."""

    config: SmoesQwen3_5MoeTextConfig
    decoder_layer_class = SmoesQwen3_5MoeDecoderLayer
    norm_class = Qwen3_5MoeRMSNorm
    rotary_embedding_class = Qwen3_5MoeTextRotaryEmbedding


class SmoesQwen3_5MoeModel(SmoesModelMixin, SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeModel):
    """Qwen3.5-MoE's vision tower and the SMoES text model."""

    text_model_class = SmoesQwen3_5MoeTextModel


@dataclass
class SmoesQwen3_5MoeCausalLMOutputWithPast(SmoesCausalLMOutputWithPast, Qwen3_5MoeCausalLMOutputWithPast):
    r"""Qwen3.5-MoE's outputs with the SMoES terms of `SmoesCausalLMOutputWithPast`."""


class SmoesQwen3_5MoeForConditionalGeneration(
    SmoesForConditionalGenerationMixin, SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeForConditionalGeneration
):
    """`Qwen3_5MoeForConditionalGeneration` trained with SMoES: equal to it in eval, in generation and with
    `smoes_enabled=False`; in a training forward with SMoES, its loss carries the SMoES losses instead of the base
    load-balancing loss, and the SMoES buffers are updated."""

    model_class = SmoesQwen3_5MoeModel
    output_class = SmoesQwen3_5MoeCausalLMOutputWithPast
