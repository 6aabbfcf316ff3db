"""MoE-ViE: a CLIP-style dual encoder whose vision tower is a fine-grained sparse MoE (spec moe_vie.md §2).

    MoeVieModel
    ├─ vision_model: MoeVieVisionModel   patch embedding (+ learned positions), 2D RoPE in every attention, pre-LN
    │                                    blocks whose MLPs are SparseMoeBlocks in `moe_layers`, attention pooling
    ├─ text_model:   MoeVieTextModel     token + absolute position embeddings, (causal) blocks, EOS / last pooling
    ├─ visual_projection, text_projection
    └─ logit_scale (, logit_bias for the sigmoid loss)

Parameter names follow Siglip2 (`embeddings.patch_embedding`, `encoder.layers.{i}.self_attn.q_proj`, `head.probe`,
...); the MoE blocks are the core's `SparseMoeBlock` (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.gate_up_proj`, `mlp.shared_expert.*`).

Images come pre-patchified as in Siglip2's NaFlex format: `pixel_values (B, N, p*p*C)` in (py, px, c) patch order,
`pixel_attention_mask (B, N)` and `spatial_shapes (B, 2)` = (rows, cols) of each image's patch grid, its
`rows * cols` patches first in row-major order and padding after. Padding patches are masked out of attention,
never routed to an expert and never pooled, so they cannot change a valid patch's output.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, torch_compilable_check
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..configuration.moe_vie import MoeVieConfig, MoeVieTextConfig, MoeVieVisionConfig
from .moe.block import SparseMoeBlock
from .moe.experts import SwiGLUMLP
from .moe.initialization import init_moe_module
from .moe.losses import load_balancing_loss, router_z_loss
from .moe.pretrained import MoePreTrainedMixin, WithoutFusedExpertsMixin, checkpoints_reentrantly
from .moe.precision import autocast_off
from .moe.router import TopKRouter
from .moe.spec import MoeLayerSpec


# --- outputs ------------------------------------------------------------------------------------------------------


@dataclass
class MoeVieVisionModelOutput(BaseModelOutputWithPooling):
    r"""
    last_hidden_state (`(batch_size, num_patches, hidden_size)`): the patch tokens after the last block (and the
        post-LayerNorm, if any); padding positions hold meaningless values.
    pooler_output (`(batch_size, hidden_size)`): the attention-pooled image features, before the projection.
    router_logits (`tuple` of `(num_valid_patches, n_routed_experts)` per MoE layer, *optional*): the fp32 router
        logits of the valid patches, returned with `output_router_logits=True`.
    """

    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class MoeVieVideoOutput(MoeVieVisionModelOutput):
    r"""
    pooler_output (`(batch_size, embedding_dim)`): the video embeddings: the pooled features of the valid frames,
        averaged, then projected (spec §2.3, item 8). Not normalised.
    frame_embeds (`(batch_size, num_frames, embedding_dim)`): each frame's projected embedding, zero for padded
        frames (the per-frame features that frame-level distillation compares, spec §4).
    last_hidden_state (`(num_valid_frames, num_patches, hidden_size)`): the patch tokens of the valid frames, in
        the order of `padding_mask_videos.nonzero()`.
    """

    frame_embeds: torch.Tensor | None = None


@dataclass
class MoeVieOutput(ModelOutput):
    r"""
    loss (`()`, *optional*, with `return_loss=True`): the contrastive loss (`config.loss_type`), plus the router
        auxiliary loss if `vision_config.router_aux_loss_type` is not `"none"`.
    logits_per_image (`(image_batch_size, text_batch_size)`): scaled cosine similarities (plus the logit bias of the
        sigmoid loss); for videos, `logits_per_video` instead.
    logits_per_text (`(text_batch_size, image_batch_size)`): the transpose of `logits_per_image` (or of
        `logits_per_video`).
    text_embeds / image_embeds / video_embeds (`(batch_size, embedding_dim)`): the L2-normalised, projected
        embeddings.
    frame_embeds (`(batch_size, num_frames, embedding_dim)`, videos only): each frame's projected embedding, not
        normalised, zero for padded frames (what frame-level distillation compares).
    text_model_output / vision_model_output: the outputs of the two towers (pooled features before projection; for
        videos, `MoeVieVideoOutput`).
    router_logits (`tuple`, *optional*): the vision tower's router logits, with `output_router_logits=True`.
    aux_loss (`()`, *optional*): the router auxiliary loss included in `loss`.
    """

    loss: torch.Tensor | None = None
    logits_per_image: torch.Tensor | None = None
    logits_per_text: torch.Tensor | None = None
    text_embeds: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    logits_per_video: torch.Tensor | None = None
    video_embeds: torch.Tensor | None = None
    frame_embeds: torch.Tensor | None = None
    text_model_output: BaseModelOutputWithPooling | None = None
    vision_model_output: MoeVieVisionModelOutput | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    aux_loss: torch.Tensor | None = None

    def to_tuple(self) -> tuple[Any]:
        return tuple(v.to_tuple() if isinstance(v, ModelOutput) else v for v in self.values())


# --- embeddings and 2D RoPE ---------------------------------------------------------------------------------------


def rope_2d_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The `head_dim / 4` frequencies of one axis: `1 / theta^(2j / (head_dim / 2))` (what the official checkpoint
    stores as `rope.freqs`)."""
    axis_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, axis_dim, 2, device=device, dtype=torch.float32) / axis_dim))


def patch_grid_positions(spatial_shapes: torch.LongTensor, num_patches: int) -> tuple[torch.Tensor, ...]:
    """Row, column and validity `(B, N)` of every patch slot: each image's `rows * cols` patches come first in
    row-major order, padding slots after."""
    slots = torch.arange(num_patches, device=spatial_shapes.device)[None, :]
    cols = spatial_shapes[:, 1:2]
    valid = slots < spatial_shapes.prod(-1, keepdim=True)
    return slots // cols, slots % cols, valid


def check_spatial_shapes(
    spatial_shapes: torch.LongTensor | None,
    batch_size: int,
    num_patches: int,
    pixel_attention_mask: torch.Tensor | None = None,
    name: str = "spatial_shapes",
) -> None:
    """Raise unless `spatial_shapes` holds the (rows, cols) patch grid of each of `batch_size` images in
    `num_patches` slots, and agrees with `pixel_attention_mask` if given. A wrong grid would otherwise broadcast,
    or place RoPE angles and padding wrongly, and give wrong embeddings without an error."""
    if spatial_shapes is None or tuple(spatial_shapes.shape) != (batch_size, 2):
        raise ValueError(
            f"MoE-ViE needs `{name}` (batch, 2) = (rows, cols) of each image's patch grid, as its image processor "
            f"returns them, for a batch of {batch_size}; got "
            f"{None if spatial_shapes is None else tuple(spatial_shapes.shape)}"
        )
    torch_compilable_check(
        ((spatial_shapes >= 1).all(-1) & (spatial_shapes.prod(-1) <= num_patches)).all(),
        lambda: f"every grid of `{name}` must have rows, cols >= 1 and rows * cols <= {num_patches}, the patch "
        f"slots of the pixel values; got {spatial_shapes.tolist()}",
    )
    if pixel_attention_mask is None:
        return
    if tuple(pixel_attention_mask.shape) != (batch_size, num_patches):
        raise ValueError(
            f"pixel_attention_mask must be (batch, num_patches) = {(batch_size, num_patches)}, got "
            f"{tuple(pixel_attention_mask.shape)}"
        )
    torch_compilable_check(
        (pixel_attention_mask.bool() == patch_grid_positions(spatial_shapes, num_patches)[2]).all(),
        lambda: f"pixel_attention_mask must mark exactly the first rows * cols patch slots of each image, as `{name}` "
        f"{spatial_shapes.tolist()} says; it marks {pixel_attention_mask.bool().sum(-1).tolist()} slots",
    )


class MoeVieVisionRotaryEmbedding(nn.Module):
    """2D RoPE angles from each image's patch grid (spec §2.3, item 2).

    A patch at 0-based (row, col) gets the angles `[(col + offset) * f ‖ (row + offset) * f]` (column first) for the
    `head_dim / 4` frequencies `f`; each angle rotates one pair of channels: pairs `(2j, 2j+1)` when interleaved
    (the official layout), `(j, j + head_dim/2)` otherwise. Padding slots get angle 0, as in the official code.
    The frequencies are recomputed in fp32 on every call (a few numbers), so no buffer can lose precision when the
    model is cast or materialised from the meta device.
    """

    def __init__(self, config: MoeVieVisionConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.position_offset = config.rope_position_offset
        self.interleaved = config.rope_interleaved

    def forward(self, spatial_shapes: torch.LongTensor, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns cos and sin, each `(B, N, head_dim)` in fp32."""
        rows, cols, valid = patch_grid_positions(spatial_shapes, num_patches)
        inv_freq = rope_2d_inverse_frequencies(self.head_dim, self.theta, device=spatial_shapes.device)
        angles = torch.cat(
            [(cols + self.position_offset)[..., None] * inv_freq, (rows + self.position_offset)[..., None] * inv_freq],
            dim=-1,
        )  # (B, N, head_dim / 2): one angle per rotated pair
        angles = angles * valid[..., None]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """`(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)`: the pairs `(2j, 2j+1)` turned by 90 degrees."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`(a, b) -> (-b, a)` on the two halves of the last dimension (the pairs `(j, j + d/2)`)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class MoeVieVisionEmbeddings(nn.Module):
    """Linear patch embedding of pre-patchified pixels, plus, for `position_embedding_type="learned"`, a learned
    position grid resized to each image exactly like Siglip2's NaFlex embeddings."""

    def __init__(self, config: MoeVieVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Linear(
            config.num_channels * config.patch_size**2, config.hidden_size, bias=config.patch_embedding_bias
        )
        self.position_embedding = None
        if config.position_embedding_type == "learned":
            self.position_embedding_size = math.isqrt(config.num_patches)
            self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, spatial_shapes: torch.LongTensor) -> torch.Tensor:
        embeddings = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        if self.position_embedding is not None:
            side = self.position_embedding_size
            grid = self.position_embedding.weight.reshape(side, side, -1)
            embeddings = embeddings + Siglip2VisionEmbeddings.resize_positional_embeddings(
                grid, spatial_shapes, max_length=pixel_values.shape[1]
            )
        return embeddings


class MoeVieTextEmbeddings(nn.Module):
    def __init__(self, config: MoeVieTextConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor | None = None) -> torch.Tensor:
        seq_length = input_ids.shape[-1]
        max_length = self.position_embedding.num_embeddings
        if seq_length > max_length:
            raise ValueError(f"the text has {seq_length} tokens but max_position_embeddings is {max_length}")
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=input_ids.device)[None, :]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


# --- transformer blocks -------------------------------------------------------------------------------------------


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MoeVieAttention(nn.Module):
    """Multi-head self-attention; in the vision tower q and k are rotated by the 2D RoPE angles."""

    def __init__(self, config: MoeVieVisionConfig | MoeVieTextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        # Read by the attention functions (sdpa, flash) when no mask is materialised; only the text config has it.
        self.is_causal = getattr(config, "is_causal", False)
        # Only the vision config has rotary embeddings.
        self.rotate = rotate_interleaved if getattr(config, "rope_interleaved", True) else rotate_half
        width = config.hidden_size
        self.q_proj = nn.Linear(width, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, width, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, width, bias=config.attention_bias)
        self.out_proj = nn.Linear(width, width, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, N, H)
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin: (B, N, head_dim)
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        queries = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, heads, N, head_dim)
        keys = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        values = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = (t.unsqueeze(1).to(queries.dtype) for t in position_embeddings)
            queries = queries * cos + self.rotate(queries) * sin
            keys = keys * cos + self.rotate(keys) * sin

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            queries,
            keys,
            values,
            attention_mask,
            scaling=self.scaling,
            dropout=self.dropout if self.training else 0.0,
            **kwargs,
        )
        attn_output = self.out_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights


class MoeVieMLP(nn.Module):
    """`fc2(act(fc1(x)))`: the SigLIP MLP, and the MLP of the attention-pooling head."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


# SwiGLU with biases is the official dense MLP (block 0 and the text tower).
DENSE_MLP_CLASSES = {"gelu": MoeVieMLP, "swiglu": SwiGLUMLP}


class MoeVieEncoderLayer(GradientCheckpointingLayer):
    """Pre-LN block: `x + Attn(LN1(x))`, then `x + MLP(LN2(x))`; the MLP is a `SparseMoeBlock` when a MoE spec is
    given."""

    def __init__(self, config: MoeVieVisionConfig | MoeVieTextConfig, layer_idx: int, moe_spec: MoeLayerSpec | None):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = MoeVieAttention(config, layer_idx)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.is_moe = moe_spec is not None
        if self.is_moe:
            self.mlp = SparseMoeBlock(config, moe_spec, layer_idx=layer_idx, layer_name=f"vision layer {layer_idx}")
        else:
            self.mlp = DENSE_MLP_CLASSES[config.mlp_type](
                config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        token_mask: torch.Tensor | None = None,  # (B, N), 1 = valid: what the MoE block may route
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.layer_norm1(hidden_states), attention_mask, position_embeddings=position_embeddings, **kwargs
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        if self.is_moe:
            hidden_states, _ = self.mlp(hidden_states, attention_mask=token_mask)  # router logits are hooked
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class MoeVieEncoder(nn.Module):
    def __init__(self, config: MoeVieVisionConfig | MoeVieTextConfig, moe_spec: MoeLayerSpec | None = None):
        super().__init__()
        moe_layers = set(config.moe_layers) if moe_spec is not None else set()
        self.layers = nn.ModuleList(
            MoeVieEncoderLayer(config, i, moe_spec if i in moe_layers else None)
            for i in range(config.num_hidden_layers)
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
        return hidden_states


class MoeVieMultiheadAttentionPoolingHead(nn.Module):
    """MAP head: a learned probe attends over the valid patches (`nn.MultiheadAttention`), then `h + MLP(LN(h))`.

    Padding is excluded with `key_padding_mask`, which does not depend on the attention backend of the encoder.
    """

    def __init__(self, config: MoeVieVisionConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, config.hidden_size))
        self.attention = nn.MultiheadAttention(config.hidden_size, config.pooling_num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MoeVieMLP(config.hidden_size, config.pooling_intermediate_size, config.pooling_hidden_act)

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        probe = self.probe.repeat(hidden_states.shape[0], 1, 1)  # (B, 1, H)
        pooled = self.attention(probe, hidden_states, hidden_states, key_padding_mask=~token_mask.bool(),
                                need_weights=False)[0]
        pooled = pooled + self.mlp(self.layernorm(pooled))
        return pooled[:, 0]


# --- pretrained models --------------------------------------------------------------------------------------------


class MoeViePreTrainedModel(PreTrainedModel):
    """What the three models share. The two that hold the sparse vision tower add `MoePreTrainedMixin`, which makes
    `experts_implementation` switchable although the experts live in the core (the transformers heuristic only reads
    this file) and registers moezoo's experts implementation; the dense text tower adds `WithoutFusedExpertsMixin`,
    which lets it take the choice `MoeVieModel` hands to both towers."""

    config: MoeVieConfig
    base_model_prefix = "moe_vie"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = [
        "MoeVieTextEmbeddings",
        "MoeVieVisionEmbeddings",
        "MoeVieEncoderLayer",
        "MoeVieMultiheadAttentionPoolingHead",
    ]
    # The encoders use the attention interface; the pooling head's `nn.MultiheadAttention` masks padding with
    # `key_padding_mask`, whatever the encoders' backend (flex attention has no backward on the CPU).
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        if init_moe_module(module, self.config.initializer_range):
            return
        super()._init_weights(module)
        if isinstance(module, MoeVieVisionEmbeddings) and module.position_embedding is not None:
            init.normal_(module.position_embedding.weight, std=module.position_embedding.embedding_dim**-0.5)
        elif isinstance(module, MoeVieMultiheadAttentionPoolingHead):
            init.normal_(module.probe, std=module.probe.shape[-1] ** -0.5)
        elif isinstance(module, MoeVieModel):
            init.constant_(module.logit_scale, self.config.logit_scale_init_value)
            if module.logit_bias is not None:
                init.constant_(module.logit_bias, self.config.logit_bias_init_value)


class MoeVieVisionModel(MoePreTrainedMixin, MoeViePreTrainedModel):
    """The vision tower. `last_hidden_state` holds the patch tokens (what a VLM projector reads), `pooler_output`
    the attention-pooled features before the projection."""

    config: MoeVieVisionConfig
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    base_model_prefix = "vision_model"
    _input_embed_layer = "patch_embedding"
    _can_record_outputs = {
        "hidden_states": MoeVieEncoderLayer,
        "attentions": OutputRecorder(MoeVieAttention, index=1),
        "router_logits": OutputRecorder(TopKRouter, index=0),
    }
    # The balancing bias moves by ~1e-3 per step: bf16 would round most updates away. (MoeVieModel collects this
    # from its vision tower.)
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self, config: MoeVieVisionConfig):
        super().__init__(config)
        self.embeddings = MoeVieVisionEmbeddings(config)
        self.rotary_emb = MoeVieVisionRotaryEmbedding(config) if config.position_embedding_type == "rope_2d" else None
        self.pre_layernorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.use_pre_layernorm else None
        )
        self.encoder = MoeVieEncoder(config, moe_spec=config.moe_layer_spec())
        self.post_layernorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.use_post_layernorm else None
        )
        self.head = MoeVieMultiheadAttentionPoolingHead(config)
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        pixel_values: torch.Tensor,  # (B, N, p*p*C)
        pixel_attention_mask: torch.Tensor | None = None,  # (B, N), 1 = valid patch; default: from spatial_shapes
        spatial_shapes: torch.LongTensor | None = None,  # (B, 2): rows, cols
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeVieVisionModelOutput:
        patch_dim = self.config.num_channels * self.config.patch_size**2
        if pixel_values.ndim != 3 or pixel_values.shape[-1] != patch_dim:
            raise ValueError(
                f"pixel_values must be pre-patchified (batch, num_patches, patch_size**2 * num_channels = {patch_dim}) "
                f"in (py, px, channel) order, got shape {tuple(pixel_values.shape)}"
            )
        batch_size, num_patches = pixel_values.shape[:2]
        check_spatial_shapes(spatial_shapes, batch_size, num_patches, pixel_attention_mask)
        if pixel_attention_mask is None:
            pixel_attention_mask = patch_grid_positions(spatial_shapes, num_patches)[2]
        pixel_attention_mask = pixel_attention_mask.bool()

        hidden_states = self.embeddings(pixel_values, spatial_shapes)
        position_embeddings = self.rotary_emb(spatial_shapes, num_patches) if self.rotary_emb is not None else None
        if self.pre_layernorm is not None:
            hidden_states = self.pre_layernorm(hidden_states)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden_states, attention_mask=pixel_attention_mask
        )
        hidden_states = self.encoder(
            hidden_states,
            attention_mask,
            position_embeddings=position_embeddings,
            token_mask=pixel_attention_mask,
            **kwargs,
        )
        if self.post_layernorm is not None:
            hidden_states = self.post_layernorm(hidden_states)
        return MoeVieVisionModelOutput(
            last_hidden_state=hidden_states, pooler_output=self.head(hidden_states, pixel_attention_mask)
        )


class MoeVieTextModel(WithoutFusedExpertsMixin, MoeViePreTrainedModel):
    """The text tower; `pooler_output` is the hidden state at the first EOS (`pooling_type="eos"`) or at the last
    position (`"last"`), before the projection."""

    config: MoeVieTextConfig
    input_modalities = ("text",)
    base_model_prefix = "text_model"
    _input_embed_layer = "token_embedding"
    _can_record_outputs = {
        "hidden_states": MoeVieEncoderLayer,
        "attentions": OutputRecorder(MoeVieAttention, index=1),
    }

    def __init__(self, config: MoeVieTextConfig):
        super().__init__(config)
        self.embeddings = MoeVieTextEmbeddings(config)
        self.encoder = MoeVieEncoder(config)
        self.final_layer_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.use_final_layer_norm else None
        )
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,  # (B, L)
        attention_mask: torch.Tensor | None = None,  # (B, L)
        position_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPooling:
        if input_ids is None:
            raise ValueError("You have to specify input_ids")
        hidden_states = self.embeddings(input_ids, position_ids)
        # Causal or bidirectional, following `config.is_causal`.
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask, cache=None,
            position_ids=position_ids,
        )
        hidden_states = self.encoder(hidden_states, mask, **kwargs)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)

        if self.config.pooling_type == "eos":
            is_eos = input_ids == self.config.eos_token_id
            torch_compilable_check(
                is_eos.any(-1).all(),
                lambda: f"pooling_type='eos' needs eos_token_id={self.config.eos_token_id} in every text; truncate "
                "texts so that they keep their EOS token",
            )
            first_eos = is_eos.int().argmax(-1)
            pooled = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), first_eos]
        else:
            pooled = hidden_states[:, -1]  # SigLIP pads to a fixed length and pools the last position
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)


class MoeVieModel(MoePreTrainedMixin, MoeViePreTrainedModel):
    """The dual encoder. Also the class for `AutoModelForZeroShotImageClassification`: `forward` takes the
    processor's `input_ids`, `attention_mask`, `pixel_values`, `pixel_attention_mask`, `spatial_shapes` and returns
    `logits_per_image`."""

    config: MoeVieConfig
    input_modalities = ("image", "video", "text")

    def __init__(self, config: MoeVieConfig):
        super().__init__(config)
        vision_config, text_config = config.vision_config, config.text_config
        self.text_model = MoeVieTextModel._from_config(text_config)
        self.vision_model = MoeVieVisionModel._from_config(vision_config)
        if config.projection_dim is None:
            self.visual_projection = nn.Identity()
        else:
            self.visual_projection = nn.Linear(vision_config.hidden_size, config.projection_dim, bias=False)
        self.text_projection = nn.Linear(
            text_config.hidden_size, config.embedding_dim, bias=config.text_projection_bias
        )
        self.logit_scale = nn.Parameter(torch.tensor(config.logit_scale_init_value))
        self.logit_bias = (
            nn.Parameter(torch.tensor([config.logit_bias_init_value])) if config.loss_type == "sigmoid" else None
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.text_model.embeddings.token_embedding

    def set_input_embeddings(self, value: nn.Module):
        self.text_model.embeddings.token_embedding = value

    @can_return_tuple
    def get_text_features(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPooling:
        """The text tower's output with `pooler_output` = the projected (not normalised) text embeddings."""
        text_outputs = self.text_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       **kwargs)
        text_outputs.pooler_output = self.text_projection(text_outputs.pooler_output)
        return text_outputs

    @can_return_tuple
    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeVieVisionModelOutput:
        """The vision tower's output with `pooler_output` = the projected (not normalised) image embeddings."""
        vision_outputs = self.vision_model(
            pixel_values=pixel_values, pixel_attention_mask=pixel_attention_mask, spatial_shapes=spatial_shapes,
            **kwargs,
        )
        vision_outputs.pooler_output = self.visual_projection(vision_outputs.pooler_output)
        return vision_outputs

    @can_return_tuple
    def get_video_features(
        self,
        pixel_values_videos: torch.Tensor,  # (B, T, N, p*p*C)
        video_pixel_attention_mask: torch.Tensor | None = None,  # (B, T, N)
        video_spatial_shapes: torch.LongTensor | None = None,  # (B, 2): every frame of a video has one grid
        padding_mask_videos: torch.Tensor | None = None,  # (B, T), 1 = real frame
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeVieVideoOutput:
        """Video embeddings (spec §2.3 item 8, §4): every real frame goes through the vision tower on its own (no
        temporal modelling), the pooled features are averaged over the real frames, then projected. Padded frames
        are never computed."""
        batch_size, num_frames, num_patches = pixel_values_videos.shape[:3]
        # Each frame's pixel_attention_mask is checked against its grid by the vision tower.
        check_spatial_shapes(video_spatial_shapes, batch_size, num_patches, name="video_spatial_shapes")
        if padding_mask_videos is None:
            padding_mask_videos = pixel_values_videos.new_ones(batch_size, num_frames, dtype=torch.bool)
        real = padding_mask_videos.bool()
        torch_compilable_check(real.any(-1).all(), "every video needs at least one frame that is not padding")

        frame_outputs = self.vision_model(
            pixel_values=pixel_values_videos[real],
            pixel_attention_mask=None if video_pixel_attention_mask is None else video_pixel_attention_mask[real],
            spatial_shapes=video_spatial_shapes[:, None].expand(batch_size, num_frames, 2)[real],
            **kwargs,
        )
        frame_features = frame_outputs.pooler_output  # (num_real_frames, H)
        pooled = frame_features.new_zeros(batch_size, num_frames, frame_features.shape[-1])
        pooled = pooled.masked_scatter(real[..., None], frame_features)
        video_features = pooled.sum(1) / real.sum(1, keepdim=True).to(pooled.dtype)  # mean over the real frames
        frame_embeds = self.visual_projection(pooled)  # no bias: padded frames stay zero
        return MoeVieVideoOutput(
            last_hidden_state=frame_outputs.last_hidden_state,
            pooler_output=self.visual_projection(video_features),
            hidden_states=frame_outputs.hidden_states,
            attentions=frame_outputs.attentions,
            router_logits=frame_outputs.router_logits,
            frame_embeds=frame_embeds,
        )

    def contrastive_logits(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """`logits_per_text (texts, images)` of normalised embeddings: cosine similarity times the (clamped)
        inverse temperature, plus the sigmoid loss's bias. fp32 whatever the model dtype or autocast (`autocast_off`):
        at a logit scale of 100, bf16's rounding of the similarities would be ~0.4 logits."""
        logit_scale = self.logit_scale.float()
        if self.config.max_logit_scale is not None:
            logit_scale = logit_scale.clamp(max=self.config.max_logit_scale)
        with autocast_off(text_embeds):
            logits_per_text = text_embeds.float() @ image_embeds.float().t().to(text_embeds.device) * logit_scale.exp()
        if self.logit_bias is not None:
            logits_per_text = logits_per_text + self.logit_bias.float()
        return logits_per_text

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_pixel_attention_mask: torch.Tensor | None = None,
        video_spatial_shapes: torch.LongTensor | None = None,
        padding_mask_videos: torch.Tensor | None = None,
        return_loss: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeVieOutput:
        """Texts against images (`pixel_values`, ...) or against videos (`pixel_values_videos`, ...)."""
        if pixel_values is not None and pixel_values_videos is not None:
            raise ValueError(
                "MoeVieModel compares texts with images or with videos, not both: call it once with "
                "processor(text=..., images=...) and once with processor(text=..., videos=...)"
            )
        if input_ids is None or (pixel_values is None and pixel_values_videos is None):
            # At most one of the three is given here.
            given = [name for name, value in (("text", input_ids), ("images", pixel_values),
                                              ("videos", pixel_values_videos)) if value is not None]  # fmt: skip
            raise ValueError(
                f"MoeVieModel compares texts with images or videos, got {given[0] + ' only' if given else 'nothing'}: "
                "pass the output of processor(text=..., images=...) or processor(text=..., videos=...), or embed one "
                "modality alone with get_text_features, get_image_features or get_video_features"
            )
        is_video = pixel_values_videos is not None
        vision_config = self.config.vision_config
        use_aux_loss = bool(return_loss) and vision_config.router_aux_loss_type != "none"
        if use_aux_loss and checkpoints_reentrantly(self.vision_model):
            raise ValueError(
                f"router_aux_loss_type={vision_config.router_aux_loss_type!r} cannot train under reentrant activation "
                "checkpointing, whose pass that records the router logits runs without gradients (the auxiliary loss "
                "would silently train nothing): use the default, model.activation_checkpointing_enable(), or "
                "activation_checkpointing_kwargs={'use_reentrant': False}"
            )
        if output_router_logits is None:
            output_router_logits = vision_config.output_router_logits
        vision_kwargs = kwargs | {"output_router_logits": output_router_logits or use_aux_loss}
        if is_video:
            vision_outputs = self.get_video_features(
                pixel_values_videos, video_pixel_attention_mask, video_spatial_shapes, padding_mask_videos,
                **vision_kwargs,
            )
            vision_embeds = vision_outputs.pooler_output  # already projected
        else:
            vision_outputs = self.vision_model(
                pixel_values=pixel_values,
                pixel_attention_mask=pixel_attention_mask,
                spatial_shapes=spatial_shapes,
                **vision_kwargs,
            )
            vision_embeds = self.visual_projection(vision_outputs.pooler_output)
        text_outputs = self.text_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        text_embeds = self.text_projection(text_outputs.pooler_output)
        vision_embeds = vision_embeds / vision_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        logits_per_text = self.contrastive_logits(vision_embeds, text_embeds)

        loss = aux_loss = None
        if return_loss:
            num_texts, num_visuals = logits_per_text.shape
            if num_texts != num_visuals:
                visual = "video" if is_video else "image"
                raise ValueError(
                    f"return_loss=True: the contrastive loss needs one text per {visual} (the matching pairs are the "
                    f"diagonal), got {num_texts} texts and {num_visuals} {visual}s"
                )
            loss = CONTRASTIVE_LOSSES[self.config.loss_type](logits_per_text)
            if use_aux_loss:
                aux_loss = self.router_aux_loss(vision_outputs.router_logits)
                loss = loss + vision_config.router_aux_loss_coef * aux_loss.to(loss.device)

        return MoeVieOutput(
            loss=loss,
            logits_per_image=None if is_video else logits_per_text.t(),
            logits_per_text=logits_per_text,
            text_embeds=text_embeds,
            image_embeds=None if is_video else vision_embeds,
            logits_per_video=logits_per_text.t() if is_video else None,
            video_embeds=vision_embeds if is_video else None,
            frame_embeds=vision_outputs.frame_embeds if is_video else None,
            text_model_output=text_outputs,
            vision_model_output=vision_outputs,
            router_logits=vision_outputs.router_logits if output_router_logits else None,
            aux_loss=aux_loss,
        )

    def router_aux_loss(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The optional ablation loss of `vision_config.router_aux_loss_type` (MoE-ViE itself uses none)."""
        vision_config = self.config.vision_config
        if vision_config.router_aux_loss_type == "z_loss":
            return router_z_loss(router_logits)
        return load_balancing_loss(
            router_logits, vision_config.n_routed_experts, vision_config.num_experts_per_tok, router_type="sigmoid"
        )


# --- contrastive losses --------------------------------------------------------------------------------------------
# `logits_per_text (texts, images)`; the texts may be one process's slice of a batch gathered across processes, whose
# matching images then start at column `label_offset` (OpenCLIP's local loss). With every text and image, the
# matching pairs are the diagonal.


def softmax_contrastive_loss(
    logits_per_text: torch.Tensor, logits_per_image: torch.Tensor | None = None, label_offset: int = 0
) -> torch.Tensor:
    """Symmetric InfoNCE (CLIP, MoE-ViE): the mean of the text->image and image->text cross-entropies.
    `logits_per_image (images, texts)` defaults to the transpose of `logits_per_text`."""
    if logits_per_image is None:
        logits_per_image = logits_per_text.t()
    labels = torch.arange(logits_per_text.shape[0], device=logits_per_text.device) + label_offset
    text_loss = nn.functional.cross_entropy(logits_per_text, labels)
    image_loss = nn.functional.cross_entropy(logits_per_image, labels)
    return (text_loss + image_loss) / 2


def sigmoid_contrastive_loss(
    logits_per_text: torch.Tensor, logits_per_image: torch.Tensor | None = None, label_offset: int = 0
) -> torch.Tensor:
    """SigLIP: `-sum_j log sigmoid(z_ij * logit_ij)` with `z = +1` for matching pairs and -1 elsewhere, averaged
    over the texts (every pair is one text row's term, so `logits_per_image` is not needed)."""
    num_texts, num_images = logits_per_text.shape
    matching = torch.zeros(num_texts, num_images, device=logits_per_text.device)
    matching[torch.arange(num_texts), torch.arange(num_texts) + label_offset] = 1
    return -nn.functional.logsigmoid((2 * matching - 1) * logits_per_text).sum(dim=-1).mean()


CONTRASTIVE_LOSSES = {"softmax": softmax_contrastive_loss, "sigmoid": sigmoid_contrastive_loss}
