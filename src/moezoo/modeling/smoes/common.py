"""What every SMoES host built on a transformers Qwen-style MoE VLM shares (spec smoes.md §1.3 "SMoES hook points"):
the Qwen3.5-MoE host (`qwen3_5_moe.py`) and the Qwen3-VL-MoE host (`qwen3_vl_moe.py`) differ only in their
transformers base classes and their attention's forward.

Each mixin is placed before the transformers class it extends and changes no forward computation:

- `SmoesSparseMoeBlockMixin`: the sparse block whose `smoes` child holds the layer's buffers; in a training forward it
  records the soft modality scores of its router input;
- `Fp32RouterMixin`: the block's router, whose logits stay fp32 under autocast (the only change, and none without
  autocast);
- `SmoesDecoderLayerMixin`: the decoder layer, which hands its input x^(l) to the runtime (the attention estimator
  weighs the residual branch by its norm);
- `SmoesTextModelMixin`: the text model built from the host's SMoES decoder layers sharing one `SmoesRuntime`, with
  the `smoes_step` counter;
- `SmoesModelMixin`, `SmoesForConditionalGenerationMixin`: the vision-language model and its LM head, whose training
  forward with `smoes_enabled` replaces the base load-balancing loss by the SMoES losses and updates the buffers.

A host's attention subclass calls `runtime.mix_attention_scores` on its post-RoPE queries and keys (before the cache)
and `runtime.advance_attention_scores` on its output projection when `runtime.tracks_attention`.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPooling, MultimodalMoeCausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from ..moe.offload import OffloadMixin
from ..moe.precision import autocast_off
from ..moe.smoes.host import check_smoes_training, token_modality
from ..moe.smoes.regularizer import apply_smoes
from ..moe.smoes.state import SmoesLayerState, SmoesRuntime


class Fp32RouterMixin:
    """A transformers top-k router (`weight`; forward returns logits, top-k weights and indices) whose logits stay
    fp32 under autocast, where its `F.linear` would run in bf16: the SMoES losses and the balancing loss read them.
    Without autocast it is transformers' router, unchanged (its input already has the weight's dtype)."""

    weight: nn.Parameter

    def forward(self, hidden_states: torch.Tensor):
        with autocast_off(hidden_states):
            return super().forward(hidden_states.to(self.weight.dtype))


class SmoesSparseMoeBlockMixin:
    """A transformers sparse MoE block (router `gate`, fused `experts`) whose `smoes` child keeps the layer's SMoES
    buffers. In a training forward it records the soft modality scores of its router input before running unchanged.

    `experts_class` is the host's experts class, declared in the host's own file with `@use_experts_implementation`
    (transformers lets a model switch its experts implementation only when its modeling file carries the decorator);
    `router_class` the host's router with `Fp32RouterMixin`.
    """

    experts_class: type[nn.Module]
    router_class: type[nn.Module]

    def __init__(self, config, runtime: SmoesRuntime):
        super().__init__(config)
        self.gate = self.router_class(config)
        self.experts = self.experts_class(config)
        self.smoes = SmoesLayerState(config.hidden_size, config.num_experts, config.smoes_num_bins)
        self.smoes_runtime = runtime

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.smoes_runtime.recording:
            self.smoes_runtime.record_router_input(self.smoes, hidden_states)
        return super().forward(hidden_states)


class SmoesDecoderLayerMixin:
    """A transformers decoder layer whose input x^(l) is handed to the runtime while the attention estimator runs.
    The host's layer sets `self.smoes_runtime` and its SMoES attention and sparse block in `__init__`."""

    smoes_runtime: SmoesRuntime

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.smoes_runtime.tracks_attention:
            self.smoes_runtime.enter_layer(hidden_states)
        return super().forward(hidden_states, *args, **kwargs)


class SmoesPreTrainedModelMixin(OffloadMixin):
    """The initial values of the SMoES buffers, for the host's pretrained-model class."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SmoesLayerState):
            module.init_buffers()
        elif isinstance(module, SmoesTextModelMixin):
            init.zeros_(module.smoes_step)


class SmoesTextModelMixin:
    """The transformers text model built from the host's SMoES decoder layers, which share one `smoes_runtime`.
    `smoes_step` counts the training forwards that updated the SMoES buffers (it drives the alpha_MI warm-up and the
    re-binning). The transformers text model's forward runs the layers unchanged.

    The host sets its modules: `decoder_layer_class` (called with config, layer index and runtime), `norm_class` and
    `rotary_embedding_class`.
    """

    decoder_layer_class: type[nn.Module]
    norm_class: type[nn.Module]
    rotary_embedding_class: type[nn.Module]

    def __init__(self, config):
        # The transformers text model's modules, built here rather than by its `__init__`, which would build its own
        # decoder layers.
        PreTrainedModel.__init__(self, config)
        self.smoes_runtime = SmoesRuntime(
            config.smoes_score_type, config.smoes_gauss_tau_scale * config.hidden_size, config.smoes_gauss_var_eps
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [
                self.decoder_layer_class(config, layer_idx, self.smoes_runtime)
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_embedding_class(config=config)
        self.gradient_checkpointing = False
        self.register_buffer("smoes_step", torch.zeros((), dtype=torch.long))
        self.post_init()

    @property
    def moe_blocks(self) -> dict[int, SmoesSparseMoeBlockMixin]:
        """The SMoES sparse block of each MoE layer by layer index (layers with a dense MLP have none)."""
        blocks = {index: layer.mlp for index, layer in enumerate(self.layers)}
        return {index: block for index, block in blocks.items() if isinstance(block, SmoesSparseMoeBlockMixin)}

    @property
    def smoes_states(self) -> list[SmoesLayerState]:
        """The SMoES buffers of every MoE layer, in layer order (the order of the recorded router logits)."""
        return [block.smoes for block in self.moe_blocks.values()]


class SmoesModelMixin:
    """The transformers vision-language model with its vision tower and the host's SMoES text model
    (`text_model_class`)."""

    text_model_class: type[PreTrainedModel]

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = self.text_model_class(config.text_config)
        self.rope_deltas = None  # as in the transformers model: the 3D position offsets of the current generation
        self.post_init()


@dataclass
class SmoesCausalLMOutputWithPast(MultimodalMoeCausalLMOutputWithPast):
    r"""The host's outputs. In a training forward with SMoES, `loss` is the task loss plus `aux_loss`, which is
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


class SmoesForConditionalGenerationMixin:
    """A transformers `...ForConditionalGeneration` trained with SMoES: equal to it in eval, in generation and with
    `smoes_enabled=False`; in a training forward with SMoES, its loss carries the SMoES losses instead of the base
    load-balancing loss, and the SMoES buffers are updated.

    The host sets `model_class` (its SMoES vision-language model) and `output_class` (a subclass of
    `SmoesCausalLMOutputWithPast` and of the transformers model's output).
    """

    model_class: type[PreTrainedModel]
    output_class: type[SmoesCausalLMOutputWithPast]

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.model = self.model_class(config)
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
    ) -> tuple | SmoesCausalLMOutputWithPast:
        base_inputs = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids,
            logits_to_keep=logits_to_keep, mm_encoder_outputs=mm_encoder_outputs, return_dict=True,
        )  # fmt: skip
        text_config = self.config.text_config
        if not (self.training and text_config.smoes_enabled):
            outputs = super().forward(**base_inputs, labels=labels, output_router_logits=output_router_logits, **kwargs)
            return self.output_class(**outputs)

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
        return self.output_class(
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
        Qwen sparse blocks)."""
        text_config = self.config.text_config
        unused_share = (text_config.num_experts - text_config.num_experts_per_tok) / text_config.num_experts
        blocks = self.model.language_model.moe_blocks.values()
        routed = sum(p.numel() for block in blocks for p in block.experts.parameters())
        return sum(p.numel() for p in self.parameters()) - round(routed * unused_share)

    def _check_smoes_training(self, language_model: SmoesTextModelMixin) -> None:
        routers = {
            f"model.language_model.layers.{index}.mlp.gate.weight": block.gate.weight
            for index, block in language_model.moe_blocks.items()
        }
        check_smoes_training(self.config.text_config, language_model, routers)

    def _smoes_token_modality(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """(B, T) hard modality (spec §2.1: `mm_token_type_ids`, or the image/video placeholders of `input_ids`)
        and (B, T) validity of the tokens."""
        placeholders = None
        if input_ids is not None:
            placeholder_ids = [self.config.image_token_id, self.config.video_token_id]
            placeholders = torch.isin(input_ids, torch.tensor(placeholder_ids, device=input_ids.device))
        return token_modality(
            (input_ids if input_ids is not None else inputs_embeds).shape[:2],
            mm_token_type_ids=mm_token_type_ids,
            vision_token_types=self.config.text_config.smoes_vision_token_types,
            vision_token_mask=placeholders,
            attention_mask=attention_mask,
        )
