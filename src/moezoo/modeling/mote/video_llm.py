"""VideoLLM-MoTE: SigLIP frames -> frame tokens -> a two-layer projector -> the Llama-MoTE decoder (spec mote.md
§2.7)."""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.siglip.modeling_siglip import SiglipVisionModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import can_return_tuple

from ...configuration.mote import VideoLlmMoteConfig
from ..moe.pretrained import WithoutFusedExpertsMixin
from .common import (
    MoteExpertsMixin,
    MoteGenerationMixin,
    MoteMultimodalCausalLMOutputWithPast,
    MoteMultimodalModelOutputWithPast,
    accepts_past_key_values,
    causal_lm_output,
    sample_routing_mask,
    wants_router_logits,
    warn_of_placeholders_without_media,
)
from .llama import LlamaMoteModel


class VideoLlmMoteMultiModalProjector(nn.Module):
    """LLaVA's two-layer projector (`LlavaMultiModalProjector`'s names): frame tokens -> decoder embeddings."""

    def __init__(self, config: VideoLlmMoteConfig):
        super().__init__()
        vision_size, text_size = config.vision_config.hidden_size, config.text_config.hidden_size
        self.linear_1 = nn.Linear(vision_size, text_size, bias=config.multimodal_projector_bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_size, text_size, bias=config.multimodal_projector_bias)

    def forward(self, frame_tokens: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(frame_tokens)))


class VideoLlmMoteVisionModel(WithoutFusedExpertsMixin, SiglipVisionModel):
    """SigLIP's vision tower, unchanged but for `WithoutFusedExpertsMixin`: it takes the experts implementation given
    to the whole model, which transformers hands to every sub-config."""


class VideoLlmMotePreTrainedModel(MoteExpertsMixin, PreTrainedModel):
    config: VideoLlmMoteConfig
    base_model_prefix = "model"
    input_modalities = ("video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoteDecoderLayer", "SiglipEncoderLayer"]
    # The attention of both towers goes through transformers' interface; LlamaModel and SiglipVisionModel declare the
    # same backends.
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False


class VideoLlmMoteModel(VideoLlmMotePreTrainedModel):
    """The vision tower, the projector and the MoTE decoder, without the LM head."""

    def __init__(self, config: VideoLlmMoteConfig):
        super().__init__(config)
        self.vision_tower = VideoLlmMoteVisionModel._from_config(config.vision_config)
        self.multi_modal_projector = VideoLlmMoteMultiModalProjector(config)
        self.language_model = LlamaMoteModel._from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Module):
        self.language_model.embed_tokens = value

    @can_return_tuple
    def get_video_features(
        self,
        pixel_values_videos: torch.FloatTensor,
        video_num_frames: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPooling:
        r"""The frame tokens of every frame, before the projector (spec §2.7): SigLIP's attention-pooled output,
        then the average-pooled `frame_token_pooled` grid of its patch tokens in row-major order.

        pixel_values_videos (`torch.FloatTensor` of shape `(total_frames, 3, frame_resolution, frame_resolution)`):
            the frames of all videos, one after the other, normalised for SigLIP (values in [-1, 1]).
        video_num_frames (`torch.LongTensor` of shape `(num_videos,)`, *optional*): frames per video; default one
            frame per entry, which places features equally well.

        Returns `pooler_output`: a tuple with one `(num_frames * frame_num_tokens, vision_hidden_size)` tensor per
        video (the form generation repeats for beam search); `last_hidden_state` is SigLIP's.
        """
        resolution = self.config.frame_resolution
        if tuple(pixel_values_videos.shape[-2:]) != (resolution, resolution):
            raise ValueError(
                f"pixel_values_videos holds {'x'.join(map(str, pixel_values_videos.shape[-2:]))} frames, but "
                f"config.frame_resolution={resolution}: SigLIP's learned positions fix the frame size. Prepare frames "
                f"with the model's processor (VideoLlmMoteProcessor letterboxes them to {resolution}x{resolution})"
            )
        vision_outputs = self.vision_tower(pixel_values=pixel_values_videos.to(self.vision_tower.dtype), **kwargs)
        frame_tokens = self.frame_tokens(vision_outputs.last_hidden_state, vision_outputs.pooler_output)
        num_frames = frame_tokens.shape[0]
        sizes = [1] * num_frames if video_num_frames is None else [int(n) for n in video_num_frames]
        if sum(sizes) != num_frames or min(sizes, default=1) < 1:
            raise ValueError(
                f"video_num_frames {sizes} must be positive and sum to the {num_frames} frames of pixel_values_videos"
            )
        tokens_per_video = [n * frame_tokens.shape[1] for n in sizes]
        vision_outputs.pooler_output = torch.split(frame_tokens.flatten(0, 1), tokens_per_video)
        return vision_outputs

    def frame_tokens(self, patch_tokens: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        """(frames, patches, C) SigLIP patch tokens and (frames, C) pooled output -> (frames, frame_num_tokens, C)."""
        num_frames, _, channels = patch_tokens.shape
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        grid = patch_tokens.transpose(1, 2).reshape(num_frames, channels, side, side)
        pooled_grid = F.adaptive_avg_pool2d(grid, self.config.frame_token_pooled).flatten(2).transpose(1, 2)
        if not self.config.frame_token_cls:
            return pooled_grid
        return torch.cat([pooled[:, None], pooled_grid], dim=1)

    def get_placeholder_mask(
        self, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor, video_features: torch.Tensor
    ) -> torch.Tensor:
        """(B, S, 1) positions of the `<v>` placeholders, checked against the number of frame tokens."""
        if input_ids is None:
            video_embedding = self.get_input_embeddings()(
                torch.tensor(self.config.video_token_id, device=inputs_embeds.device)
            )
            mask = (inputs_embeds == video_embedding).all(-1)
        else:
            mask = input_ids == self.config.video_token_id
        if int(mask.sum()) != video_features.shape[0]:
            # Continuing a generation from its KV cache with the clip's frames again is the usual way to get none.
            hint = "; frames already in the KV cache must not be passed again" if not mask.any() else ""
            raise ValueError(
                f"the text has {int(mask.sum())} video placeholders (video_token_id={self.config.video_token_id}) but "
                f"the frames give {video_features.shape[0]} frame tokens ({self.config.frame_num_tokens} per frame)"
                f"{hint}"
            )
        return mask[..., None]

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values_videos: torch.FloatTensor | None = None,
        video_num_frames: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoteMultimodalModelOutputWithPast:
        r"""
        pixel_values_videos / video_num_frames: see `get_video_features`.
        mm_encoder_outputs (`dict`, *optional*): `{"video": BaseModelOutputWithPooling(pooler_output=...)}` with
            pre-extracted frame tokens (`(total_frames * frame_num_tokens, vision_hidden_size)`, or a tuple of them
            per video), in place of `pixel_values_videos`; they bypass the vision tower, not the projector.
        task_ids / routing_mask: see `MoteTextModelMixin.forward`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        mm_encoder_outputs = dict(mm_encoder_outputs or {})
        if pixel_values_videos is not None and mm_encoder_outputs.get("video") is not None:
            raise ValueError("pass either pixel_values_videos or pre-extracted mm_encoder_outputs['video'], not both")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values_videos is not None:
            mm_encoder_outputs["video"] = self.get_video_features(pixel_values_videos, video_num_frames, **kwargs)
        video_outputs = mm_encoder_outputs.get("video")
        if video_outputs is not None:
            frame_tokens = video_outputs.pooler_output
            if not torch.is_tensor(frame_tokens):
                frame_tokens = torch.cat(frame_tokens)
            projector_dtype = self.multi_modal_projector.linear_1.weight.dtype
            video_embeds = self.multi_modal_projector(frame_tokens.to(inputs_embeds.device, projector_dtype))
            mask = self.get_placeholder_mask(input_ids, inputs_embeds, video_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(mask, video_embeds.to(inputs_embeds.dtype))
        else:
            warn_of_placeholders_without_media(
                input_ids, cache, self.config.video_token_id, "video", "no frames were given",
                "the processor's pixel_values_videos and video_num_frames (or mm_encoder_outputs['video'])",
            )
        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            task_ids=task_ids,
            routing_mask=routing_mask,
            **kwargs,
        )
        # The decoder's outputs (hidden states, cache, attentions, router logits) and the vision tower's.
        return MoteMultimodalModelOutputWithPast(**outputs, video_outputs=video_outputs)


class VideoLlmMoteForConditionalGeneration(MoteGenerationMixin, VideoLlmMotePreTrainedModel, GenerationMixin):
    """VideoLLM-MoTE (spec §2.7): frames and text in, next-token logits out; `generate(**inputs, task_ids=...)`."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: VideoLlmMoteConfig):
        super().__init__(config)
        self.model = VideoLlmMoteModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_video_features(self, pixel_values_videos, video_num_frames=None, **kwargs) -> BaseModelOutputWithPooling:
        return self.model.get_video_features(pixel_values_videos, video_num_frames, **kwargs)

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values_videos: torch.FloatTensor | None = None,
        video_num_frames: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoteMultimodalCausalLMOutputWithPast:
        r"""
        input_ids (`(batch_size, sequence_length)`): text with `frame_num_tokens` `<v>` placeholders
            (`video_token_id`) per frame, frames separated by `frame_token_interval_id` (spec §2.7, §6.1).
        pixel_values_videos / video_num_frames / mm_encoder_outputs: see `VideoLlmMoteModel.forward`.
        labels (`(batch_size, sequence_length)`, *optional*): next-token targets, -100 where unsupervised. The loss
            averages over the supervised positions; positions whose input is `<v>` (silent-frame targets) are
            weighted by `config.stream_loss_weight` (spec §3.1).
        task_ids / routing_mask / output_router_logits: see `LlamaMoteForCausalLM.forward`.
        """
        text_config = self.config.text_config
        output_router_logits = wants_router_logits(text_config, labels, output_router_logits)
        outputs = self.model(
            input_ids=input_ids,
            pixel_values_videos=pixel_values_videos,
            video_num_frames=video_num_frames,
            attention_mask=attention_mask,
            position_ids=position_ids,
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
            loss = self.stream_loss(logits, labels, input_ids, **kwargs)
        return causal_lm_output(
            MoteMultimodalCausalLMOutputWithPast, text_config, outputs, logits, loss, attention_mask,
            output_router_logits,
        )

    def stream_loss(self, logits, labels, input_ids, **kwargs) -> torch.Tensor:
        """transformers' causal LM loss (`loss_function`: the mean next-token cross-entropy over supervised
        positions, or their sum over `num_items_in_batch`), with the terms predicted from a `<v>` input weighted by
        `stream_loss_weight`; the paper's weight 1 is `loss_function` itself.

        The targets are `shift_labels` when given (aligned with the logits already: sequence-parallel training
        shifts the full sequence before sharding it), else `labels` moved left by one."""
        weight = self.config.stream_loss_weight
        if weight == 1.0:
            return self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.text_config.vocab_size, **kwargs
            )
        if input_ids is None:
            raise ValueError(
                f"stream_loss_weight={weight} weighs the positions whose input is <v>, which needs input_ids"
            )
        targets = kwargs.get("shift_labels")
        if targets is None:
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
        targets = targets.to(logits.device)
        per_token = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=-100, reduction="none")
        from_frames = input_ids.to(logits.device) == self.config.video_token_id
        per_token = torch.where(from_frames, weight * per_token, per_token)
        count = kwargs.get("num_items_in_batch")
        return per_token.sum() / (count if count is not None else (targets != -100).sum())
