"""GLM-OCR-MoTE: GLM-OCR (CogViT vision tower and merger, unchanged) with a MoTE decoder (spec mote.md §2.6)."""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.glm_ocr.modeling_glm_ocr import (
    GlmOcrForConditionalGeneration,
    GlmOcrModel,
    GlmOcrPreTrainedModel,
    GlmOcrRMSNorm,
    GlmOcrTextDecoderLayer,
    GlmOcrTextMLP,
    GlmOcrTextModel,
    GlmOcrTextRotaryEmbedding,
    GlmOcrVisionModel,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import can_return_tuple

from ...configuration.mote import GlmOcrMoteConfig, GlmOcrMoteTextConfig
from ..moe.pretrained import WithoutFusedExpertsMixin
from .common import (
    ROUTER_LOGITS,
    MoteExpertsMixin,
    MoteFeedForward,
    MoteGenerationMixin,
    MoteMultimodalCausalLMOutputWithPast,
    MoteMultimodalModelOutputWithPast,
    MoteTextModelMixin,
    accepts_past_key_values,
    causal_lm_output,
    feed_forward,
    sample_routing_mask,
    wants_router_logits,
    warn_of_placeholders_without_media,
)


class GlmOcrMoteTextDecoderLayer(GlmOcrTextDecoderLayer):
    """`GlmOcrTextDecoderLayer` (sandwich norms) whose FFN is a `MoteFeedForward`; `post_mlp_layernorm` stays shared
    and is applied once to the combined expert output (spec A21)."""

    def __init__(self, config: GlmOcrMoteTextConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.is_mote_layer(layer_idx):
            self.mlp = MoteFeedForward(config, GlmOcrTextMLP)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        task_ids: torch.LongTensor | None = None,
        route_weights: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = self.post_self_attn_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = feed_forward(self.mlp, hidden_states, task_ids, route_weights)
        hidden_states = self.post_mlp_layernorm(hidden_states)
        return residual + hidden_states


class GlmOcrMotePreTrainedModel(MoteExpertsMixin, GlmOcrPreTrainedModel):
    config: GlmOcrMoteConfig
    _no_split_modules = ["GlmOcrMoteTextDecoderLayer", "GlmOcrVisionBlock"]
    _can_compile_fullgraph = False


class GlmOcrMoteTextModel(MoteTextModelMixin, GlmOcrMotePreTrainedModel, GlmOcrTextModel):
    """`GlmOcrTextModel` with MoTE decoder layers (built by `MoteTextModelMixin.__init__`); `forward` adds `task_ids`
    (see `MoteTextModelMixin.forward`) and runs `GlmOcrTextModel.forward`."""

    config: GlmOcrMoteTextConfig
    _can_record_outputs = {**GlmOcrTextModel._can_record_outputs, "router_logits": ROUTER_LOGITS}
    decoder_layer_class = GlmOcrMoteTextDecoderLayer
    norm_class = GlmOcrRMSNorm
    rotary_embedding_class = GlmOcrTextRotaryEmbedding


class GlmOcrMoteVisionModel(WithoutFusedExpertsMixin, GlmOcrVisionModel):
    """GLM-OCR's vision tower, unchanged but for `WithoutFusedExpertsMixin`: it takes the experts implementation given
    to the whole model, which transformers hands to every sub-config."""


class GlmOcrMoteModel(GlmOcrMotePreTrainedModel, GlmOcrModel):
    """`GlmOcrModel` (CogViT vision tower and merger, unchanged) with the MoTE decoder."""

    def __init__(self, config: GlmOcrMoteConfig):
        PreTrainedModel.__init__(self, config)
        self.visual = GlmOcrMoteVisionModel._from_config(config.vision_config)
        self.language_model = GlmOcrMoteTextModel._from_config(config.text_config)
        self.rope_deltas = None  # GlmOcrModel caches the M-RoPE offsets of the prefill here
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
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoteMultimodalModelOutputWithPast:
        r"""`GlmOcrModel.forward` (images and videos placed at their placeholders, M-RoPE positions) with the
        routing arguments of `MoteTextModelMixin.forward`, which reach the decoder only."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if (pixel_values is not None or pixel_values_videos is not None) and mm_encoder_outputs is not None:
            raise ValueError(
                "You cannot specify both pixel_values/pixel_values_videos and mm_encoder_outputs at the same time"
            )
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)

        mm_encoder_outputs = dict(mm_encoder_outputs or {})
        if mm_encoder_outputs.get("image") is None and pixel_values is not None:
            mm_encoder_outputs["image"] = self.get_image_features(
                pixel_values, image_grid_thw, return_dict=True, **kwargs
            )
        if mm_encoder_outputs.get("video") is None and pixel_values_videos is not None:
            mm_encoder_outputs["video"] = self.get_video_features(
                pixel_values_videos, video_grid_thw, return_dict=True, **kwargs
            )
        if mm_encoder_outputs.get("image") is not None:
            image_embeds = torch.cat(mm_encoder_outputs["image"].pooler_output, dim=0)
            image_embeds = image_embeds.to(inputs_embeds.device, inputs_embeds.dtype)
            image_mask, _ = self.get_placeholder_mask(input_ids, inputs_embeds, image_features=image_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_embeds)
        if mm_encoder_outputs.get("video") is not None:
            video_embeds = torch.cat(mm_encoder_outputs["video"].pooler_output, dim=0)
            video_embeds = video_embeds.to(inputs_embeds.device, inputs_embeds.dtype)
            _, video_mask = self.get_placeholder_mask(input_ids, inputs_embeds, video_features=video_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(video_mask, video_embeds)
        if mm_encoder_outputs.get("image") is None and mm_encoder_outputs.get("video") is None:
            # GLM-OCR marks video patches with the image token too.
            warn_of_placeholders_without_media(
                input_ids, cache, self.config.image_token_id, "image", "no image was given",
                "the processor's pixel_values and image_grid_thw (or mm_encoder_outputs['image'])",
            )

        if position_ids is None:
            position_ids = self.compute_3d_position_ids(
                input_ids=input_ids,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                mm_token_type_ids=mm_token_type_ids,
            )
            if position_ids is not None:
                # Continuing from a cache, GlmOcrModel numbers every position of the attention mask (the cached
                # tokens' too); the decoder takes those of the new tokens.
                position_ids = position_ids[..., -inputs_embeds.shape[1] :]
        outputs = self.language_model(
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            task_ids=task_ids,
            routing_mask=routing_mask,
            **kwargs,
        )
        # The decoder's outputs (hidden states, cache, attentions, router logits) and the vision encoder's.
        return MoteMultimodalModelOutputWithPast(
            **outputs, image_outputs=mm_encoder_outputs.get("image"), video_outputs=mm_encoder_outputs.get("video")
        )


class GlmOcrMoteForConditionalGeneration(
    MoteGenerationMixin, GlmOcrMotePreTrainedModel, GlmOcrForConditionalGeneration
):
    """GLM-OCR-MoTE (spec §2.6): `GlmOcrForConditionalGeneration` with task experts. Without `task_ids` it uses
    `mote_default_route` (`"ocr"`), which after a function-preserving conversion is GLM-OCR itself."""

    def __init__(self, config: GlmOcrMoteConfig):
        PreTrainedModel.__init__(self, config)
        self.model = GlmOcrMoteModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
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
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoteMultimodalCausalLMOutputWithPast:
        r"""`GlmOcrForConditionalGeneration.forward` with `task_ids`, `routing_mask` and `output_router_logits` (see
        `LlamaMoteForCausalLM.forward`)."""
        text_config = self.config.text_config
        output_router_logits = wants_router_logits(text_config, labels, output_router_logits)
        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            mm_encoder_outputs=mm_encoder_outputs,
            task_ids=task_ids,
            routing_mask=sample_routing_mask(text_config, attention_mask, labels, routing_mask),
            output_router_logits=output_router_logits,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs)
        return causal_lm_output(
            MoteMultimodalCausalLMOutputWithPast, text_config, outputs, logits, loss, attention_mask,
            output_router_logits,
        )
