"""SMoES on Qwen3-VL-MoE (spec smoes.md §1.3, the second host): transformers' `Qwen3VLMoeForConditionalGeneration`
with the SMoES bookkeeping of `moezoo.modeling.moe.smoes` and nothing else changed.

Every class subclasses its transformers counterpart and keeps its forward computation, so logits and generation
are those of the base model on the same weights, in eval and in training. Every decoder layer is softmax attention,
so the paper's attention-accumulated score applies at each one (the default score type here); DeepStack's visual
features, added to the image tokens' hidden states after the first layers, are part of the next layer's input x^(l)
like any residual update. Only a training forward with `smoes_enabled` does more, without gradient and without
touching any output:

- each decoder layer hands its input to the shared runtime, and its attention mixes the attention estimator's scores
  with one extra attention pass (`SmoesQwen3VLMoeTextAttention`);
- each MoE block records the scores of its router input and, for the Gaussian estimator, their moments
  (`SmoesQwen3VLMoeTextSparseMoeBlock`, whose `smoes` child holds the layer's buffers); layers with a dense MLP
  (`mlp_only_layers`, `decoder_sparse_step`) have none but still advance the scores;
- the top-level forward computes the bin-level balance and inter-bin MI losses from the recorded router logits,
  adds them to the task loss in place of `router_aux_loss_coef * load_balancing_loss`, and updates the buffers.

What this host shares with the Qwen3.5-MoE one lives in `common.py`; this file holds what is Qwen3-VL-MoE's: its
classes and its attention's forward.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.integrations import use_experts_implementation
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoeCausalLMOutputWithPast,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeModel,
    Qwen3VLMoePreTrainedModel,
    Qwen3VLMoeTextAttention,
    Qwen3VLMoeTextDecoderLayer,
    Qwen3VLMoeTextExperts,
    Qwen3VLMoeTextModel,
    Qwen3VLMoeTextRMSNorm,
    Qwen3VLMoeTextRotaryEmbedding,
    Qwen3VLMoeTextSparseMoeBlock,
    Qwen3VLMoeTextTopKRouter,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack

from ...configuration.smoes import SmoesQwen3VLMoeConfig, SmoesQwen3VLMoeTextConfig
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


# The SMoES model keeps Qwen3-VL-MoE's weight names and layouts, so a Qwen3-VL-MoE checkpoint (fused experts stored
# transposed on disk) loads through transformers' own conversion, which is keyed by the top-level model type.
register_checkpoint_conversion_mapping(
    SmoesQwen3VLMoeConfig.model_type, get_checkpoint_conversion_mapping("qwen3_vl_moe"), overwrite=True
)


@use_experts_implementation
class SmoesQwen3VLMoeTextExperts(Qwen3VLMoeTextExperts):
    """transformers' Qwen3-VL-MoE experts, unchanged. Declared here because transformers lets a model switch its
    experts implementation (`experts_implementation=`) only when the model's own file carries the decorator."""


class SmoesQwen3VLMoeTextTopKRouter(Fp32RouterMixin, Qwen3VLMoeTextTopKRouter):
    """transformers' router, its logits fp32 under autocast (`Fp32RouterMixin`)."""


class SmoesQwen3VLMoeTextSparseMoeBlock(SmoesSparseMoeBlockMixin, Qwen3VLMoeTextSparseMoeBlock):
    """The Qwen3-VL-MoE sparse block (no shared expert), whose `smoes` child keeps the layer's SMoES buffers. In a
    training forward it records the soft modality scores of its router input before running unchanged."""

    experts_class = SmoesQwen3VLMoeTextExperts
    router_class = SmoesQwen3VLMoeTextTopKRouter


class SmoesQwen3VLMoeTextAttention(Qwen3VLMoeTextAttention):
    """Qwen3-VL-MoE's softmax attention. In a training forward with the attention estimator it also mixes the soft
    modality scores with this layer's head-averaged attention (one extra attention pass with the scores as values,
    without gradient) and advances them by the norm-weighted residual rule."""

    def __init__(self, config: SmoesQwen3VLMoeTextConfig, layer_idx: int, runtime: SmoesRuntime):
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

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
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
        attn_output = self.o_proj(attn_output)
        if tracks_scores:
            self.smoes_runtime.advance_attention_scores(attn_output)
        return attn_output, attn_weights


class SmoesQwen3VLMoeTextDecoderLayer(SmoesDecoderLayerMixin, Qwen3VLMoeTextDecoderLayer):
    """Qwen3-VL-MoE's decoder layer with the SMoES attention and, where the layer is an MoE layer, the SMoES sparse
    block. Its input x^(l) is what the attention estimator weighs the residual branch by."""

    def __init__(self, config: SmoesQwen3VLMoeTextConfig, layer_idx: int, runtime: SmoesRuntime):
        super().__init__(config, layer_idx)
        self.self_attn = SmoesQwen3VLMoeTextAttention(config, layer_idx, runtime)
        if isinstance(self.mlp, Qwen3VLMoeTextSparseMoeBlock):
            self.mlp = SmoesQwen3VLMoeTextSparseMoeBlock(config, runtime)
        self.smoes_runtime = runtime


class SmoesQwen3VLMoePreTrainedModel(SmoesPreTrainedModelMixin, Qwen3VLMoePreTrainedModel):
    config: SmoesQwen3VLMoeConfig
    _no_split_modules = ["SmoesQwen3VLMoeTextDecoderLayer", "Qwen3VLMoeVisionBlock"]


class SmoesQwen3VLMoeTextModel(SmoesTextModelMixin, SmoesQwen3VLMoePreTrainedModel, Qwen3VLMoeTextModel):
    """Qwen3-VL-MoE's text model (with DeepStack) built from SMoES layers, which share one `smoes_runtime`.
    `smoes_step` counts the training forwards that updated the SMoES buffers (it drives the alpha_MI warm-up and the
    re-binning)."""

    config: SmoesQwen3VLMoeTextConfig
    decoder_layer_class = SmoesQwen3VLMoeTextDecoderLayer
    norm_class = Qwen3VLMoeTextRMSNorm
    rotary_embedding_class = Qwen3VLMoeTextRotaryEmbedding


class SmoesQwen3VLMoeModel(SmoesModelMixin, SmoesQwen3VLMoePreTrainedModel, Qwen3VLMoeModel):
    """Qwen3-VL-MoE's vision tower and the SMoES text model."""

    text_model_class = SmoesQwen3VLMoeTextModel


@dataclass
class SmoesQwen3VLMoeCausalLMOutputWithPast(SmoesCausalLMOutputWithPast, Qwen3VLMoeCausalLMOutputWithPast):
    r"""Qwen3-VL-MoE's outputs with the SMoES terms of `SmoesCausalLMOutputWithPast`."""


class SmoesQwen3VLMoeForConditionalGeneration(
    SmoesForConditionalGenerationMixin, SmoesQwen3VLMoePreTrainedModel, Qwen3VLMoeForConditionalGeneration
):
    """`Qwen3VLMoeForConditionalGeneration` trained with SMoES: equal to it in eval, in generation and with
    `smoes_enabled=False`; in a training forward with SMoES, its loss carries the SMoES losses instead of the base
    load-balancing loss, and the SMoES buffers are updated."""

    model_class = SmoesQwen3VLMoeModel
    output_class = SmoesQwen3VLMoeCausalLMOutputWithPast
