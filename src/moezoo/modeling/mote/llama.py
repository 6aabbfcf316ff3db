"""Llama-MoTE: `LlamaForCausalLM` whose FFNs are task experts (spec mote.md §2.3); its decoder, `LlamaMoteModel`, is
also VideoLLM-MoTE's."""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import can_return_tuple

from ...configuration.mote import LlamaMoteConfig
from .common import (
    ROUTER_LOGITS,
    MoteExpertsMixin,
    MoteFeedForward,
    MoteGenerationMixin,
    MoteTextModelMixin,
    accepts_past_key_values,
    causal_lm_output,
    feed_forward,
    sample_routing_mask,
    wants_router_logits,
)


class LlamaMoteDecoderLayer(LlamaDecoderLayer):
    """`LlamaDecoderLayer` whose FFN is a `MoteFeedForward` (in `mote_layers`); the route is an explicit argument."""

    def __init__(self, config: LlamaMoteConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.is_mote_layer(layer_idx):
            self.mlp = MoteFeedForward(config, LlamaMLP)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        task_ids: torch.LongTensor | None = None,
        route_weights: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = feed_forward(self.mlp, hidden_states, task_ids, route_weights)
        return residual + hidden_states


class LlamaMotePreTrainedModel(MoteExpertsMixin, LlamaPreTrainedModel):
    config: LlamaMoteConfig
    _no_split_modules = ["LlamaMoteDecoderLayer"]
    # Routing is data-dependent (per-route gathers, route checks).
    _can_compile_fullgraph = False
    _can_record_outputs = {**LlamaPreTrainedModel._can_record_outputs, "router_logits": ROUTER_LOGITS}


class LlamaMoteModel(MoteTextModelMixin, LlamaMotePreTrainedModel, LlamaModel):
    """`LlamaModel` with MoTE decoder layers (built by `MoteTextModelMixin.__init__`); `forward` adds `task_ids`
    (see `MoteTextModelMixin.forward`) and runs `LlamaModel.forward`."""

    decoder_layer_class = LlamaMoteDecoderLayer
    norm_class = LlamaRMSNorm
    rotary_embedding_class = LlamaRotaryEmbedding


class LlamaMoteForCausalLM(MoteGenerationMixin, LlamaMotePreTrainedModel, LlamaForCausalLM):
    """Text-only MoTE: `LlamaForCausalLM` with task experts."""

    def __init__(self, config: LlamaMoteConfig):
        PreTrainedModel.__init__(self, config)
        self.model = LlamaMoteModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch_size,)`, *optional*): the route of each example, an index
            into `config.mote_expert_names`; default: the routes of the sequence a KV cache continues, else
            `config.mote_default_route`.
        routing_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): the positions the
            `sample_top1` router pools (see `MoteTextModelMixin.forward`); default the prompt when there are
            `labels`, else `attention_mask`. `generate` passes the prompt's positions.
        output_router_logits (`bool`, *optional*): return the learned routers' logits (ablation modes); on by
            default there when `labels` are given, and the load-balancing loss is then added to `loss`.
        """
        output_router_logits = wants_router_logits(self.config, labels, output_router_logits)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            task_ids=task_ids,
            routing_mask=sample_routing_mask(self.config, attention_mask, labels, routing_mask),
            output_router_logits=output_router_logits,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return causal_lm_output(
            MoeCausalLMOutputWithPast, self.config, outputs, logits, loss, attention_mask, output_router_logits
        )
