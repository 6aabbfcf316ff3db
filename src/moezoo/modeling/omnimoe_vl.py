"""OmniMoE-VL: a sparse VLM with a coupled visual-depth routed projector (spec omnimoe_vl.md §2).

    OmniMoeVlForConditionalGeneration          lm_head on top; generate() reuses the injection context
    └─ model: OmniMoeVlModel                   streams -> projector -> fused tokens into the image placeholders
       ├─ vision_tower: OmniMoeVlVisionModel   SigLIP (transformers' embeddings and encoder layers), MoE MLP on
       │                                      `moe_layers`, no post-layernorm: it returns the tapped hidden states
       ├─ projector: OmniMoeVlProjector        query synthesis, depth route, fusion, injection (omnimoe_vl_projector.py)
       └─ language_model: OmniMoeVlTextModel   Qwen3-MoE (transformers' attention, norms, rotary), MoE on the shared
                                              core, the routed injection added before each anchor layer

Both MoE stacks are the shared core's `SparseMoeBlock`: vision experts are GELU experts with top-1 straight-through
gates, language experts SwiGLU top-2 renormalised; every experts implementation applies. State-dict keys: the vision
tower's equal `SiglipVisionModel`'s (without `post_layernorm` and `head`), the language model's equal `Qwen3MoeModel`'s.

One image per sample (spec D21): with `pixel_values` (or precomputed `visual_streams`), every row of `input_ids` holds
exactly `num_image_tokens` image placeholders.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeMLP,
    Qwen3MoeModel,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.siglip.modeling_siglip import (
    SiglipAttention,
    SiglipEncoder,
    SiglipEncoderLayer,
    SiglipPreTrainedModel,
    SiglipVisionEmbeddings,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..configuration.omnimoe_vl import OmniMoeVlConfig, OmniMoeVlTextConfig, OmniMoeVlVisionConfig
from ..configuration.smoes_settings import SmoesSettings
from .moe.block import SparseMoeBlock
from .moe.initialization import init_moe_module
from .moe.losses import load_balancing_loss
from .moe.pretrained import MoePreTrainedMixin
from .moe.router import TopKRouter
from .moe.smoes.host import HostLayer, SmoesHost, smoes_outputs, smoes_recording, token_modality
from .omnimoe_vl_projector import (
    OmniMoeVlDepthRouter,
    OmniMoeVlInjection,
    OmniMoeVlProjector,
    OmniMoeVlQuerySynthesis,
    OmniMoeVlRoutingContext,
    RoutedInjection,
)


# The attribute of a KV cache that keeps its sequences' injection context: a decode step given only the cache continues
# with the context of the prefill that filled it (as MoTE keeps its routes with the cache).
ROUTING_CONTEXT_OF_CACHE = "omnimoe_vl_routing_context"
# What `output_router_logits=True` records in either stack: each token router's fp32 logits (its first output).
ROUTER_LOGITS = OutputRecorder(TopKRouter, index=0)


# --- outputs ---------------------------------------------------------------------------------------------------------


@dataclass
class OmniMoeVlVisionOutput(BaseModelOutputWithPooling):
    r"""
    last_hidden_state (`(batch_size, num_patches, hidden_size)`): the last block's output (no final norm).
    pooler_output (`(batch_size, num_streams * num_patches, hidden_size)`, *optional*): from `get_image_features`,
        the visual streams the projector reads, stream after stream (`view(batch, num_streams, num_patches, -1)`).
    hidden_states (`tuple`, *optional*): the patch embeddings and every block's output.
    router_logits (`tuple` of `(batch_size * num_patches, num_experts)`, *optional*): each MoE block's fp32 logits.
    """

    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class OmniMoeVlModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    router_logits (`tuple`, *optional*): the language routers' fp32 logits of the non-padding tokens, per MoE layer.
    image_outputs (`OmniMoeVlVisionOutput`, *optional*): the vision tower's outputs (`get_image_features`), with the
        vision routers' logits in `image_outputs.router_logits`.
    image_hidden_states (`(batch_size, num_patches, hidden_size)`, *optional*): Z, the fused tokens placed at the
        image placeholders.
    routing_context (`OmniMoeVlRoutingContext`, *optional*): the injection context of each sample, also kept with
        the returned cache, so that decode steps continue with it.
    depth_route / depth_scores (`(batch_size, num_streams)` fp32, *optional*): the route w (top-k sparse) and the
        content scores r it was drawn from.
    query_weights (`(batch_size, num_query_prototypes)` fp32, *optional*): p.
    fusion_weights (`(batch_size, num_groups, num_streams)` fp32, *optional*): g.
    prototypes / router_queries / prompt_lengths (*optional*): q, t and L_T, for the auxiliary losses.
    """

    image_outputs: OmniMoeVlVisionOutput | None = None
    image_hidden_states: torch.Tensor | None = None
    routing_context: OmniMoeVlRoutingContext | None = None
    depth_route: torch.Tensor | None = None
    depth_scores: torch.Tensor | None = None
    query_weights: torch.Tensor | None = None
    fusion_weights: torch.Tensor | None = None
    prototypes: torch.Tensor | None = None
    router_queries: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None


@dataclass
class OmniMoeVlCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""`MoeCausalLMOutputWithPast` plus the fields of `OmniMoeVlModelOutputWithPast` beyond its own. `aux_loss` is
    the token experts' load-balancing loss of both stacks, weighted by their `router_aux_loss_coef`.

    routing_loss (`()`, *optional*): in training with labels and an image, the weighted sum of the route's
        objectives (spec §3.1), included in `loss`.
    routing_losses (`dict[str, torch.Tensor]`, *optional*): each of those objectives unweighted, by name
        (`OmniMoeVlProjector.routing_objectives`), for the training logs.
    smoes_bal_loss / smoes_mi_loss / smoes_mi / smoes_bins (*optional*): in a training forward with SMoES
        (`config.smoes`), whose weighted loss replaces the language experts' load balancing in `aux_loss`: the
        bin-level balance loss and minus the inter-bin MI (reduced over MoE layers), each MoE layer's MI in nats, and
        the bins the losses used.
    """

    routing_loss: torch.Tensor | None = None
    routing_losses: dict[str, torch.Tensor] | None = None
    smoes_bal_loss: torch.Tensor | None = None
    smoes_mi_loss: torch.Tensor | None = None
    smoes_mi: torch.Tensor | None = None
    smoes_bins: tuple[torch.Tensor, ...] | None = None

    image_outputs: OmniMoeVlVisionOutput | None = None
    image_hidden_states: torch.Tensor | None = None
    routing_context: OmniMoeVlRoutingContext | None = None
    depth_route: torch.Tensor | None = None
    depth_scores: torch.Tensor | None = None
    query_weights: torch.Tensor | None = None
    fusion_weights: torch.Tensor | None = None
    prototypes: torch.Tensor | None = None
    router_queries: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None


ROUTING_FIELDS = ("image_outputs", "image_hidden_states", "routing_context", "depth_route", "depth_scores",
                  "query_weights", "fusion_weights", "prototypes", "router_queries", "prompt_lengths")


# --- vision tower ----------------------------------------------------------------------------------------------------


class OmniMoeVlVisionSparseMoeBlock(SparseMoeBlock):
    """The core's MoE block in place of `SiglipMLP`: a tensor in, a tensor out (the router logits are recorded by
    `output_router_logits`). Image patches have no padding, so every token is routed."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states)[0]


class OmniMoeVlVisionModel(MoePreTrainedMixin, SiglipPreTrainedModel):
    """`SiglipVisionModel`'s embeddings and encoder with experts in the MLPs of `config.moe_layers`. The streams are
    intermediate hidden states, so there is no post-layernorm and no pooling head (spec D23)."""

    config: OmniMoeVlVisionConfig
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    base_model_prefix = "vision_model"
    _can_record_outputs = {
        "hidden_states": SiglipEncoderLayer,
        "attentions": SiglipAttention,
        "router_logits": ROUTER_LOGITS,
    }

    def __init__(self, config: OmniMoeVlVisionConfig):
        super().__init__(config)
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        spec = config.moe_layer_spec()
        for index in config.moe_layers:
            self.encoder.layers[index].mlp = OmniMoeVlVisionSparseMoeBlock(
                config, spec, layer_idx=index, layer_name=f"vision block {index}"
            )
        self.post_init()

    def _init_weights(self, module):
        if init_moe_module(module, self.config.initializer_range):
            return
        super()._init_weights(module)

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self, pixel_values: torch.Tensor, **kwargs: Unpack[TransformersKwargs]  # (B, C, H, W)
    ) -> OmniMoeVlVisionOutput:
        hidden_states = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        hidden_states = self.encoder(inputs_embeds=hidden_states, **kwargs).last_hidden_state
        return OmniMoeVlVisionOutput(last_hidden_state=hidden_states)


# --- language model --------------------------------------------------------------------------------------------------


class OmniMoeVlDecoderLayer(Qwen3MoeDecoderLayer):
    """`Qwen3MoeDecoderLayer` with the core's MoE block: padding tokens are never routed."""

    def __init__(self, config: OmniMoeVlTextConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(config, config.moe_layer_spec(), layer_idx=layer_idx)
        else:
            self.mlp = Qwen3MoeMLP(config, intermediate_size=config.intermediate_size)
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, L, d)
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        token_mask: torch.Tensor | None = None,  # (B, L) 1 = real token: what the experts route
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
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
        if isinstance(self.mlp, SparseMoeBlock):
            hidden_states, _ = self.mlp(hidden_states, attention_mask=token_mask)
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class OmniMoeVlTextModel(MoePreTrainedMixin, Qwen3MoeModel):
    """`Qwen3MoeModel` (same modules and keys) whose layer loop adds the routed injection to the input of each anchor
    layer (Eq. 11: before the block), the way `Qwen3VLTextModel` adds DeepStack features: outside the layers, so that
    (reentrant or not) activation checkpointing sees the injected hidden states as the layer's input, and no hooks.
    `hidden_states[i]` of the outputs is the input of layer i, after the injection."""

    config: OmniMoeVlTextConfig
    _no_split_modules = ["OmniMoeVlDecoderLayer"]
    _can_compile_fullgraph = False  # the experts route data-dependently
    _can_record_outputs = {
        "router_logits": ROUTER_LOGITS,
        "hidden_states": OmniMoeVlDecoderLayer,
        "attentions": Qwen3MoeAttention,
    }

    def __init__(self, config: OmniMoeVlTextConfig):
        # Not Qwen3MoeModel.__init__, which would build transformers' own MoE blocks.
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(OmniMoeVlDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.smoes = None  # a SmoesHost once `attach_smoes` put SMoES on the layers
        self.post_init()

    def _init_weights(self, module):
        if init_moe_module(module, self.config.initializer_range):
            return
        super()._init_weights(module)

    def attach_smoes(self, settings: SmoesSettings) -> SmoesHost:
        """SMoES on every layer (`moezoo.modeling.moe.smoes.host`): each attention layer advances the attention score,
        each MoE block gets its buffers (the dense layers of `mlp_only_layers` have none)."""
        layers = [
            HostLayer(layer, layer.self_attn, layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else None)
            for layer in self.layers
        ]
        self.smoes = SmoesHost(settings, layers, self.config.hidden_size, apply_rotary_pos_emb)
        return self.smoes

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,  # (B, past + L) 1 = real token
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        injection: RoutedInjection | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens)[None]
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids,
        )
        # The padding mask of the new tokens, for the experts (a 2D mask spans the cached tokens too).
        token_mask = None
        if attention_mask is not None and attention_mask.ndim == 2:
            token_mask = attention_mask[:, -inputs_embeds.shape[1]:]

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers:
            if injection is not None:
                hidden_states = injection.apply(decoder_layer.layer_idx, hidden_states)
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                token_mask=token_mask,
                **kwargs,
            )
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


# --- the VLM ---------------------------------------------------------------------------------------------------------


class OmniMoeVlPreTrainedModel(MoePreTrainedMixin, PreTrainedModel):
    config: OmniMoeVlConfig
    base_model_prefix = "model"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["OmniMoeVlDecoderLayer", "SiglipEncoderLayer"]
    # The injection's weights are read before each anchor layer and at decode steps, outside any forward of its own.
    _resident_modules = ["OmniMoeVlInjection"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False  # routing is data-dependent
    # The usage EMA of exploration must stay fp32 under any load dtype (spec §9.5). Named alone: transformers casts
    # every tensor whose name matches to fp32, and "depth_router" would turn the int64 routing_step into a float.
    _keep_in_fp32_modules_strict = ["depth_usage_ema"]

    def _init_weights(self, module):
        """Spec §5.2. The towers initialise their own modules (SigLIP's and Qwen3-MoE's schemes); Linear and LayerNorm
        modules of the projector get transformers' default (N(0, initializer_range), ones / zeros)."""
        std = self.config.initializer_range
        if init_moe_module(module, std):
            return
        if isinstance(module, OmniMoeVlQuerySynthesis):
            init.normal_(module.query_bank, std=std)
            init.normal_(module.prompt_null, std=std)
            init.zeros_(module.gate_bias)
            init.normal_(module.router_mix, std=1.0)  # M = 0 would make every router query the same
        elif isinstance(module, OmniMoeVlInjection):
            hidden_size = self.config.text_config.hidden_size
            init.normal_(module.text_bank, std=std)
            init.normal_(module.visual_bank, std=std)
            init.normal_(module.adapter_down, std=hidden_size**-0.5)
            init.normal_(module.adapter_up, std=self.config.adapter_rank**-0.5)
            init.constant_(module.gate, self.config.injection_gate_init)  # 0: no injection until trained
            init.ones_(module.type_gain)
        elif isinstance(module, OmniMoeVlProjector):
            init.ones_(module.fusion_output_scale)
        elif isinstance(module, OmniMoeVlDepthRouter):
            init.zeros_(module.depth_usage_ema)
            init.zeros_(module.routing_step)
        else:
            super()._init_weights(module)


class OmniMoeVlModel(OmniMoeVlPreTrainedModel):
    def __init__(self, config: OmniMoeVlConfig):
        super().__init__(config)
        self.vision_tower = OmniMoeVlVisionModel._from_config(config.vision_config)
        self.projector = OmniMoeVlProjector(config)
        self.language_model = OmniMoeVlTextModel._from_config(config.text_config)
        if config.smoes is not None:
            self.language_model.attach_smoes(config.smoes_settings())
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.language_model.embed_tokens = value

    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> OmniMoeVlVisionOutput:
        """The vision tower's outputs, with the visual streams V as `pooler_output` (B, S * N, d_V): the hidden states
        at `vision_feature_layers`, stream after stream. Only the tapped hidden states are kept unless
        `output_hidden_states=True` asks for all of them."""
        taps = self.config.vision_feature_layers
        everything = bool(kwargs.pop("output_hidden_states", None) or self.config.vision_config.output_hidden_states)
        outputs = self.vision_tower(pixel_values, output_hidden_states=True if everything else taps, **kwargs)
        outputs.pooler_output = torch.cat([outputs.hidden_states[index] for index in taps], dim=1)
        if not everything:
            outputs.hidden_states = None
        return outputs

    def visual_streams(self, image_outputs: OmniMoeVlVisionOutput) -> torch.Tensor:
        """`get_image_features(...).pooler_output` as the streams V (B, S, N, d_V)."""
        batch, _, width = image_outputs.pooler_output.shape
        return image_outputs.pooler_output.view(batch, self.config.num_streams, -1, width)

    def token_mask(
        self, token_ids: list[int], input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, L) bool: where the tokens `token_ids` are; from `inputs_embeds` (their embedding rows, as LLaVA does)
        when there are no `input_ids`."""
        if input_ids is not None:
            return torch.isin(input_ids, torch.tensor(token_ids, device=input_ids.device))
        embeddings = self.get_input_embeddings()(torch.tensor(token_ids, device=inputs_embeds.device))
        return (inputs_embeds[:, :, None] == embeddings.to(inputs_embeds.dtype)).all(-1).any(-1)

    def get_placeholder_mask(
        self, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor, num_images: int
    ) -> torch.Tensor:
        """(B, L) bool: the image placeholders, checked to be `num_image_tokens` per row, one image per row."""
        mask = self.token_mask([self.config.image_token_id], input_ids, inputs_embeds)
        per_row = mask.sum(dim=-1)
        expected = self.config.num_image_tokens
        if num_images != mask.shape[0] or bool((per_row != expected).any()):
            raise ValueError(
                f"OmniMoE-VL takes one image per sample, each written as {expected} <|image_pad|> tokens (id "
                f"{self.config.image_token_id}): got {num_images} images for {mask.shape[0]} rows, with "
                f"{per_row.tolist()} placeholders per row; let the processor expand the image placeholder"
            )
        return mask

    def default_prompt_mask(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Without a processor's `prompt_mask`: every real token that is not an image or vision marker token."""
        config = self.config
        vision_ids = [config.image_token_id, config.vision_start_token_id, config.vision_end_token_id]
        mask = ~self.token_mask(vision_ids, input_ids, inputs_embeds)
        return mask if attention_mask is None else mask & attention_mask[:, -mask.shape[1]:].bool()

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,  # (B, L)
        attention_mask: torch.Tensor | None = None,  # (B, past + L)
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        pixel_values: torch.Tensor | None = None,  # (B, C, H, W): one image per row
        prompt_mask: torch.Tensor | None = None,  # (B, L) 1 on the question tokens of the image's turn
        visual_streams: torch.Tensor | None = None,  # (B, S, N, d_V): precomputed streams instead of pixel_values
        routing_context: OmniMoeVlRoutingContext | None = None,  # a prefill's context, for decode steps
        route_override: dict[str, torch.Tensor | None] | None = None,
        inputs_embeds: torch.Tensor | None = None,  # (B, L, d) instead of input_ids
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> OmniMoeVlModelOutputWithPast:
        r"""
        prompt_mask: which tokens condition the route (spec D9); default every real token that is not an image or
            vision marker token. It must not include answer tokens (the route must not see the answer).
        visual_streams: a test and analysis hook (spec §2.9): streams that skip the vision tower.
        routing_context: the injection context of the prefill, which decode steps reuse (default: the one kept with
            `cache`, which a forward with images and a cache stores there); ignored when images are given.
        route_override: `{"fusion": w_u, "injection": w_v}`, each `(batch, num_streams)` or None: route
            interventions (spec §9.6, Table 5b), applied where the route is computed (with the images); the
            injection route travels in `routing_context` to the decode steps. The outputs keep the sample's own
            `depth_route`.
        """
        if output_router_logits is None:
            output_router_logits = self.config.text_config.output_router_logits
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        visual_token_mask = self.token_mask([self.config.image_token_id], input_ids, inputs_embeds)
        image_outputs, projected = None, None
        if pixel_values is not None and visual_streams is not None:
            raise ValueError("give pixel_values or visual_streams, not both")
        if pixel_values is not None:
            image_outputs = self.get_image_features(
                pixel_values, output_router_logits=output_router_logits,
                output_attentions=kwargs.get("output_attentions", False),
                output_hidden_states=kwargs.get("output_hidden_states", False),
            )
            visual_streams = self.visual_streams(image_outputs)
        if visual_streams is not None:
            visual_token_mask = self.get_placeholder_mask(input_ids, inputs_embeds, visual_streams.shape[0])
            if prompt_mask is None:
                prompt_mask = self.default_prompt_mask(input_ids, attention_mask, inputs_embeds)
            if prompt_mask.shape != visual_token_mask.shape:
                raise ValueError(
                    f"prompt_mask has shape {tuple(prompt_mask.shape)}, the input {tuple(visual_token_mask.shape)}: "
                    "one entry per token"
                )
            projected = self.projector(visual_streams, inputs_embeds, prompt_mask, route_override)
            routing_context = projected.routing_context
            inputs_embeds = inputs_embeds.masked_scatter(
                visual_token_mask[..., None], projected.fused_tokens.to(inputs_embeds.dtype)
            )
        elif routing_context is None and cache is not None and cache.get_seq_length() > 0:
            routing_context = getattr(cache, ROUTING_CONTEXT_OF_CACHE, None)
        injection = None
        if routing_context is not None and self.config.injection_type != "none":
            injection = RoutedInjection(
                self.projector.injection, routing_context, visual_token_mask,
                {layer: stream for stream, layer in enumerate(self.config.injection_layers)},
            )
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            injection=injection,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        if routing_context is not None and outputs.cache is not None:
            setattr(outputs.cache, ROUTING_CONTEXT_OF_CACHE, routing_context)
        routing = {} if projected is None else {
            "image_hidden_states": projected.fused_tokens,
            "depth_route": projected.depth_route,
            "depth_scores": projected.depth_scores,
            "query_weights": projected.query_weights,
            "fusion_weights": projected.fusion_weights,
            "prototypes": projected.prototypes,
            "router_queries": projected.router_queries,
            "prompt_lengths": projected.prompt_lengths,
        }
        return OmniMoeVlModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_outputs=image_outputs,
            routing_context=routing_context,
            **routing,
        )


class OmniMoeVlForConditionalGeneration(OmniMoeVlPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: OmniMoeVlConfig):
        super().__init__(config)
        self.model = OmniMoeVlModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        pixel_values: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        visual_streams: torch.Tensor | None = None,
        routing_context: OmniMoeVlRoutingContext | None = None,
        route_override: dict[str, torch.Tensor | None] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> OmniMoeVlCausalLMOutputWithPast:
        r"""See `OmniMoeVlModel.forward`. With `labels` and no `prompt_mask`, the supervised positions are left out of
        the default prompt, so that the route never sees the answer. With `output_router_logits`, `aux_loss` is the
        load-balancing loss of both stacks' token experts, added to `loss` when there are labels. In `train()` mode
        with labels and an image, `loss` also holds the route's objectives (`routing_loss`, spec §3.1), weighted by the
        schedules at the projector's `routing_step`, which the training callback advances once per optimizer step."""
        text_config = self.config.text_config
        if output_router_logits is None:
            output_router_logits = text_config.output_router_logits
        if labels is not None and prompt_mask is None and (pixel_values is not None or visual_streams is not None):
            prompt_mask = self.model.default_prompt_mask(input_ids, attention_mask, inputs_embeds) & (labels == -100)
        smoes, smoes_losses = self.model.language_model.smoes, None
        trains_smoes, recording = smoes_recording(self, smoes, lambda: self._smoes_tokens(input_ids, inputs_embeds,
                                                                                           attention_mask))
        with recording:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                pixel_values=pixel_values,
                prompt_mask=prompt_mask,
                visual_streams=visual_streams,
                routing_context=routing_context,
                route_override=route_override,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                output_router_logits=output_router_logits or trains_smoes,
                **kwargs,
            )
            if trains_smoes:
                smoes_losses = smoes.losses(outputs.router_logits, text_config.num_experts_per_tok)
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = routing_loss = routing_losses = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs)
        if loss is not None and self.training and outputs.depth_route is not None:
            # In the model rather than in a Trainer, so that any trainer (TRL's SFTTrainer too) gets them in `loss`.
            objectives = self.model.projector.routing_objectives(outputs, loss)
            if objectives:
                routing_loss = sum(weight * term for weight, term in objectives.values())
                routing_losses = {name: term for name, (_, term) in objectives.items()}
                loss = loss + routing_loss.to(loss.device)
        aux_loss = self._router_aux_loss(outputs, language=not trains_smoes) if output_router_logits else None
        if smoes_losses is not None:
            aux_loss = smoes_losses.loss if aux_loss is None else aux_loss + smoes_losses.loss
        if loss is not None and aux_loss is not None:
            loss = loss + aux_loss.to(loss.device)
        return OmniMoeVlCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            routing_loss=routing_loss,
            routing_losses=routing_losses,
            **{name: outputs[name] for name in ROUTING_FIELDS if name in outputs},
            **{name: value for name, value in smoes_outputs(smoes_losses).items() if name != "aux_loss"},
        )

    def _smoes_tokens(self, input_ids, inputs_embeds, attention_mask) -> tuple[torch.LongTensor, torch.Tensor]:
        """(B, L) hard modality and validity of an SMoES training forward's tokens: vision at the image placeholders."""
        vision = self.model.token_mask([self.config.image_token_id], input_ids, inputs_embeds)
        return token_modality(vision.shape, vision_token_mask=vision, attention_mask=attention_mask)

    def _router_aux_loss(self, outputs: OmniMoeVlModelOutputWithPast, language: bool = True) -> torch.Tensor | None:
        """Switch load balancing of each stack's token experts, weighted by its `router_aux_loss_coef` (spec D28);
        `language=False` leaves the language experts out (SMoES' losses replace theirs)."""
        terms = []
        for config, logits in (
            (self.config.text_config, outputs.router_logits if language else None),
            (self.config.vision_config, outputs.image_outputs.router_logits if outputs.image_outputs else None),
        ):
            if logits:
                balance = load_balancing_loss(logits, config.num_experts, config.num_experts_per_tok)
                terms.append(config.router_aux_loss_coef * balance)
        return sum(terms) if terms else None

    def generate(self, inputs=None, **kwargs):
        """`GenerationMixin.generate`, with the default prompt mask taken from the prompt itself: steps that recompute
        the route from the whole sequence (without a KV cache) must not count the generated tokens as prompt."""
        input_ids, inputs_embeds = kwargs.get("input_ids", inputs), kwargs.get("inputs_embeds")
        has_image = kwargs.get("pixel_values") is not None or kwargs.get("visual_streams") is not None
        if kwargs.get("prompt_mask") is None and has_image and (input_ids is not None or inputs_embeds is not None):
            kwargs["prompt_mask"] = self.model.default_prompt_mask(
                None if inputs_embeds is not None else input_ids, kwargs.get("attention_mask"), inputs_embeds
            )
        return super().generate(inputs, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids, cache=None, visual_streams=None, prompt_mask=None, is_first_iteration=False, **kwargs
    ):
        """A step that feeds the whole sequence (the prefill, or any step without a KV cache) recomputes the route
        from the image, with `prompt_mask` padded with zeros over the generated tokens (so the route is the prefill's);
        a decode step with a cache continues with the context kept in the cache (transformers drops `pixel_values`
        there, and `visual_streams` too)."""
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, cache=cache, is_first_iteration=is_first_iteration, **kwargs
        )
        if is_first_iteration or cache is None:
            model_inputs["visual_streams"] = visual_streams
            if prompt_mask is not None and prompt_mask.shape[1] < input_ids.shape[1]:
                prompt_mask = nn.functional.pad(prompt_mask, (0, input_ids.shape[1] - prompt_mask.shape[1]))
            model_inputs["prompt_mask"] = prompt_mask
        return model_inputs
