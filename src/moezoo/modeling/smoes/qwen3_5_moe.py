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
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.integrations import use_experts_implementation
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_outputs import BaseModelOutputWithPooling
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
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from ...configuration.smoes import SmoesQwen3_5MoeConfig, SmoesQwen3_5MoeTextConfig
from ..moe.pretrained import checkpoints_reentrantly
from ..moe.smoes.regularizer import apply_smoes, check_routers_trainable
from ..moe.smoes.scores import hard_modality
from ..moe.smoes.state import SmoesLayerState, SmoesRuntime


# The SMoES text model keeps Qwen3.5-MoE's weight names and layouts, so a Qwen3.5-MoE checkpoint (per-expert 2D
# tensors on disk) loads through transformers' own conversion to fused experts, which is keyed by model type.
register_checkpoint_conversion_mapping(
    SmoesQwen3_5MoeTextConfig.model_type, get_checkpoint_conversion_mapping("qwen3_5_moe_text"), overwrite=True
)

@use_experts_implementation
class SmoesQwen3_5MoeExperts(Qwen3_5MoeExperts):
    """transformers' Qwen3.5-MoE experts, unchanged. Declared here because transformers lets a model switch its
    experts implementation (`experts_implementation=`) only when the model's own file carries the decorator."""


class SmoesQwen3_5MoeSparseMoeBlock(Qwen3_5MoeSparseMoeBlock):
    """The Qwen3.5-MoE sparse block, whose `smoes` child keeps the layer's SMoES buffers. In a training forward it
    records the soft modality scores of its router input before running unchanged."""

    def __init__(self, config: SmoesQwen3_5MoeTextConfig, runtime: SmoesRuntime):
        super().__init__(config)
        self.experts = SmoesQwen3_5MoeExperts(config)
        self.smoes = SmoesLayerState(config.hidden_size, config.num_experts, config.smoes_num_bins)
        self.smoes_runtime = runtime

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.smoes_runtime.recording:
            self.smoes_runtime.record_router_input(self.smoes, hidden_states)
        return super().forward(hidden_states)


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


class SmoesQwen3_5MoeDecoderLayer(Qwen3_5MoeDecoderLayer):
    """Qwen3.5-MoE's decoder layer with the SMoES attention and sparse block. Its input x^(l) is what the attention
    estimator weighs the residual branch by."""

    def __init__(self, config: SmoesQwen3_5MoeTextConfig, layer_idx: int, runtime: SmoesRuntime):
        super().__init__(config, layer_idx)
        if self.block_type == "full_attention":
            self.self_attn = SmoesQwen3_5MoeAttention(config, layer_idx, runtime)
        self.mlp = SmoesQwen3_5MoeSparseMoeBlock(config, runtime)
        self.smoes_runtime = runtime

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.smoes_runtime.tracks_attention:
            self.smoes_runtime.enter_layer(hidden_states)
        return super().forward(hidden_states, *args, **kwargs)


class SmoesQwen3_5MoePreTrainedModel(Qwen3_5MoePreTrainedModel):
    config: SmoesQwen3_5MoeConfig
    _no_split_modules = ["SmoesQwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SmoesLayerState):
            module.init_buffers()
        elif isinstance(module, SmoesQwen3_5MoeTextModel):
            init.zeros_(module.smoes_step)


class SmoesQwen3_5MoeTextModel(SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeTextModel):
    """Qwen3.5-MoE's text model built from SMoES layers, which share one `smoes_runtime`. `smoes_step` counts the
    training forwards that updated the SMoES buffers (it drives the alpha_MI warm-up and the re-binning)."""

    config: SmoesQwen3_5MoeTextConfig

    def __init__(self, config: SmoesQwen3_5MoeTextConfig):
        super(Qwen3_5MoeTextModel, self).__init__(config)
        self.smoes_runtime = SmoesRuntime(
            config.smoes_score_type, config.smoes_gauss_tau_scale * config.hidden_size, config.smoes_gauss_var_eps
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [
                SmoesQwen3_5MoeDecoderLayer(config, layer_idx, self.smoes_runtime)
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.register_buffer("smoes_step", torch.zeros((), dtype=torch.long))
        self.post_init()

    @property
    def smoes_states(self) -> list[SmoesLayerState]:
        """The SMoES buffers of every MoE layer, in layer order."""
        return [layer.mlp.smoes for layer in self.layers]


class SmoesQwen3_5MoeModel(SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeModel):
    """Qwen3.5-MoE's vision tower and the SMoES text model."""

    def __init__(self, config: SmoesQwen3_5MoeConfig):
        super(Qwen3_5MoeModel, self).__init__(config)
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = SmoesQwen3_5MoeTextModel(config.text_config)
        self.rope_deltas = None  # as in Qwen3_5MoeModel: the 3D position offsets of the current generation
        self.post_init()


@dataclass
class SmoesQwen3_5MoeCausalLMOutputWithPast(Qwen3_5MoeCausalLMOutputWithPast):
    r"""Qwen3.5-MoE's outputs. In a training forward with SMoES, `loss` is the task loss plus `aux_loss`, which is
    `smoes_bal_coef * smoes_bal_loss + alpha_MI * smoes_mi_loss` (alpha_MI after its warm-up).

    smoes_bal_loss (`torch.FloatTensor` of shape `()`): the bin-level balance loss, reduced over MoE layers.
    smoes_mi_loss (`torch.FloatTensor` of shape `()`): minus the inter-bin mutual information, reduced over layers.
    smoes_mi (`torch.FloatTensor` of shape `(num_moe_layers,)`): each layer's batch-mean MI in nats, detached.
    smoes_bins (`tuple[torch.LongTensor]`, one of shape `(num_experts,)` per MoE layer): the bins the losses used.
    """

    smoes_bal_loss: torch.FloatTensor | None = None
    smoes_mi_loss: torch.FloatTensor | None = None
    smoes_mi: torch.FloatTensor | None = None
    smoes_bins: tuple[torch.LongTensor, ...] | None = None


class SmoesQwen3_5MoeForConditionalGeneration(SmoesQwen3_5MoePreTrainedModel, Qwen3_5MoeForConditionalGeneration):
    """`Qwen3_5MoeForConditionalGeneration` trained with SMoES: equal to it in eval, in generation and with
    `smoes_enabled=False`; in a training forward with SMoES, its loss carries the SMoES losses instead of the base
    load-balancing loss, and the SMoES buffers are updated."""

    def __init__(self, config: SmoesQwen3_5MoeConfig):
        super(Qwen3_5MoeForConditionalGeneration, self).__init__(config)
        self.model = SmoesQwen3_5MoeModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple | SmoesQwen3_5MoeCausalLMOutputWithPast:
        base_inputs = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids,
            logits_to_keep=logits_to_keep, mm_encoder_outputs=mm_encoder_outputs, return_dict=True,
        )  # fmt: skip
        text_config = self.config.text_config
        if not (self.training and text_config.smoes_enabled):
            outputs = super().forward(**base_inputs, labels=labels, output_router_logits=output_router_logits, **kwargs)
            return SmoesQwen3_5MoeCausalLMOutputWithPast(**outputs)

        language_model = self.model.language_model
        self._check_smoes_training(language_model)
        modality, valid = self._smoes_token_modality(input_ids, inputs_embeds, mm_token_type_ids, attention_mask)
        runtime = language_model.smoes_runtime
        runtime.start(modality, valid)
        try:
            # Without labels the base computes no loss; its load-balancing loss, which SMoES replaces, is dropped.
            outputs = super().forward(**base_inputs, output_router_logits=True, **kwargs)
            smoes = apply_smoes(
                text_config, language_model.smoes_states, runtime, outputs.router_logits, language_model.smoes_step
            )
        finally:
            runtime.stop()

        loss = None
        if labels is not None:
            task_loss = self.loss_function(
                logits=outputs.logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs
            )
            loss = task_loss + smoes.loss.to(task_loss.device)
        return SmoesQwen3_5MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=smoes.loss,
            logits=outputs.logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            image_outputs=outputs.image_outputs,
            video_outputs=outputs.video_outputs,
            router_logits=outputs.router_logits,
            smoes_bal_loss=smoes.balance_loss,
            smoes_mi_loss=smoes.mi_loss,
            smoes_mi=smoes.layer_mi,
            smoes_bins=smoes.bins,
        )

    def active_parameter_count(self) -> int:
        """The parameters one token uses, for `moezoo list` and model cards: each MoE layer's routed experts count
        k / E of their size (`moezoo.modeling.moe.accounting` counts the core's `SparseMoeBlock`, not transformers'
        Qwen3.5-MoE block)."""
        text_config = self.config.text_config
        unused_share = (text_config.num_experts - text_config.num_experts_per_tok) / text_config.num_experts
        routed = sum(p.numel() for layer in self.model.language_model.layers for p in layer.mlp.experts.parameters())
        return sum(p.numel() for p in self.parameters()) - round(routed * unused_share)

    def _check_smoes_training(self, language_model: SmoesQwen3_5MoeTextModel) -> None:
        text_config = self.config.text_config
        if torch.is_grad_enabled():
            routers = {
                f"model.language_model.layers.{index}.mlp.gate.weight": layer.mlp.gate.weight
                for index, layer in enumerate(language_model.layers)
            }
            check_routers_trainable(text_config, routers)
        if checkpoints_reentrantly(language_model):
            raise ValueError(
                "SMoES losses need non-reentrant gradient checkpointing: reentrant checkpointing records the router "
                "logits without gradients, so the routers would silently not train; use the default, "
                "model.activation_checkpointing_enable(), or activation_checkpointing_kwargs={'use_reentrant': False}, "
                f"or set {type(text_config).__name__}.smoes_enabled=False"
            )

    def _smoes_token_modality(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """(B, T) hard modality (spec §2.1: `mm_token_type_ids`, or the image/video placeholders of `input_ids`)
        and (B, T) validity of the tokens."""
        text_config = self.config.text_config
        if mm_token_type_ids is not None:
            modality = hard_modality(mm_token_type_ids, text_config.smoes_vision_token_types)
        elif input_ids is not None:
            placeholders = torch.tensor([self.config.image_token_id, self.config.video_token_id], device=input_ids.device)
            modality = torch.isin(input_ids, placeholders).long()
        else:
            raise ValueError(
                "SMoES training needs each token's modality: pass mm_token_type_ids (the Qwen3-VL processor returns "
                "it) or input_ids, or set text_config.smoes_enabled=False"
            )
        batch_shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if modality.shape != batch_shape:
            raise ValueError(
                f"mm_token_type_ids has shape {tuple(modality.shape)}, expected {tuple(batch_shape)} (one per token)"
            )
        if attention_mask is None:
            return modality, torch.ones(batch_shape, dtype=torch.bool, device=modality.device)
        if attention_mask.shape != batch_shape:
            raise ValueError(
                f"SMoES training needs a 2D padding attention_mask of shape {tuple(batch_shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
        return modality, attention_mask.bool()
