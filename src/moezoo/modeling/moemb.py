"""MoEMB: a universal multimodal embedder on a sparse-MoE Qwen3.5 backbone (spec moemb.md §2, §3.14).

    MoEmbForEmbedding                      embeddings = normalize(last_hidden_state[pooled token])
    └─ model: MoEmbModel                   image/video features scattered into their placeholders, MRoPE positions
       ├─ visual: Qwen3_5MoeVisionModel    transformers' vision tower, unchanged
       └─ language_model: MoEmbTextModel   embed_tokens, layers[i]: MoEmbDecoderLayer, norm, rotary_emb
            └─ MoEmbDecoderLayer           h += Mixer(RMSNorm(h)); h += MoE(RMSNorm(h))
                                           Mixer: transformers' Gated DeltaNet or gated attention
                                           MoE: the shared core's SparseMoeBlock (padding never routed)

Parameter names equal `Qwen3_5MoeForConditionalGeneration`'s without `lm_head` and `mtp.*`, so a Qwen3.5-MoE state
dict loads as is. Everything the paper does not change is transformers' code; what is new here is the layer loop
(written out so that later adaptive computation has one place per layer to act: after the token mixer, around the
MoE block, between layers), pooling, and packed execution.

Two execution modes give the same embeddings:
- padded: `input_ids (B, S)` with `attention_mask`; left or right padding;
- packed (varlen): `input_ids (1, T)` holding B sequences back to back, with `cu_seqlens (B + 1)`. Attention gets a
  block-diagonal causal mask (and flash-attention's varlen arguments), and every Gated DeltaNet layer runs each
  sequence on its own. Stock transformers does not keep packed sequences apart there: the causal convolution sees
  the previous sequence's last tokens, and its PyTorch fallbacks carry the recurrent state across sequences (spec
  §3.14).
"""

from contextlib import contextmanager, nullcontext
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    packed_sequence_mask_function,
)
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeAttention,
    Qwen3_5MoeGatedDeltaNet,
    Qwen3_5MoeModel,
    Qwen3_5MoePreTrainedModel,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextRotaryEmbedding,
    Qwen3_5MoeVisionModel,
    apply_rotary_pos_emb,
)
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..configuration.moemb import TOKEN_MODALITIES, MoEmbConfig, MoEmbTextConfig
from ..configuration.moemb_adaptive import AdaptiveSettings, check_adaptive_settings
from ..configuration.smoes_settings import SmoesSettings
from .moe.block import SparseMoeBlock
from .moe.initialization import init_moe_module
from .moe.precision import scaled_similarities
from .moe.pretrained import MoePreTrainedMixin
from .moe.smoes.host import HostLayer, SmoesHost, smoes_outputs, smoes_recording, token_modality
from .moe.statistics import record_routing
from .moemb_adaptive.forward import AdaptiveForward, AdaptiveReport, TokenMetadata
from .moemb_adaptive.gates import GateControl, attach_gate_modules, init_gate_module
from .moemb_adaptive.trained import masked_attention, masked_gated_delta_net
from .moemb_adaptive.packed import PaddedBatch


try:  # flash-linear-attention: varlen Gated DeltaNet kernels (GPU)
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_causal_conv1d = fla_chunk_gated_delta_rule = None


# --- outputs ------------------------------------------------------------------------------------------------------


@dataclass
class MoEmbModelOutput(ModelOutput):
    r"""
    last_hidden_state (`(batch_size, sequence_length, hidden_size)`, packed: `(1, total_length, hidden_size)`): the
        text model's output after its final norm; padding positions hold meaningless values.
    hidden_states (`tuple`, *optional*, with `output_hidden_states=True`, or only the selected ones with a list of
        indices): the token embeddings (image and video features included), the output of every layer but the last,
        and `last_hidden_state`.
    attentions (`tuple` of `(batch_size, num_heads, sequence_length, sequence_length)`, *optional*, with
        `output_attentions=True` and eager attention): the weights of the gated-attention layers (the Gated DeltaNet
        layers have none).
    router_logits (`tuple` of `(num_valid_tokens, num_experts)` per layer, *optional*, with
        `output_router_logits=True`): fp32 router logits of the non-padding tokens, in row-major token order.
    routing_counts (`(num_layers, 3, num_experts)` int64, *optional*, with `output_routing_counts=True`): (token,
        slot) assignments per layer, expert and token modality (text, image, video), padding excluded.
    adaptive (`AdaptiveReport`, *optional*, with adaptive computation on): the forward's logical FLOPs, its saving
        S(a) against full compute, and the realised token-drop, expert-skip and slot-skip rates per layer and
        modality. With token pruning, the hidden states of the layers after the pruning hold the kept tokens only.
    """

    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    routing_counts: torch.Tensor | None = None
    adaptive: AdaptiveReport | None = None


@dataclass
class MoEmbOutput(MoEmbModelOutput):
    r"""
    embeddings (`(batch_size, hidden_size)` float32): the pooled hidden states, L2-normalised unless
        `config.normalize_embeddings=False`.
    pooled_index (`(batch_size,)`): where each item was pooled: a position in its row, or in the packed sequence.
    aux_loss (`()`, *optional*): in a training forward with SMoES (`config.smoes`), its weighted loss
        `smoes_bal_coef * smoes_bal_loss + alpha_MI * smoes_mi_loss`, for the trainer to add to the contrastive loss.
    smoes_bal_loss / smoes_mi_loss (`()`, *optional*): the bin-level balance loss and minus the inter-bin mutual
        information, reduced over MoE layers.
    smoes_mi (`(num_layers,)`, *optional*): each MoE layer's batch-mean MI in nats, detached.
    smoes_bins (`tuple` of `(num_experts,)`, *optional*): the bins the SMoES losses used.
    """

    embeddings: torch.Tensor | None = None
    pooled_index: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    smoes_bal_loss: torch.Tensor | None = None
    smoes_mi_loss: torch.Tensor | None = None
    smoes_mi: torch.Tensor | None = None
    smoes_bins: tuple[torch.Tensor, ...] | None = None


# --- packed (varlen) batches ---------------------------------------------------------------------------------------


@dataclass
class PackedSequences:
    """Item `b` of a packed batch is tokens `cu_seqlens[b]:cu_seqlens[b + 1]` of a `(1, total_length)` row."""

    cu_seqlens: torch.Tensor  # (B + 1,) int32, starts at 0, non-decreasing
    max_seqlen: int
    segment_ids: torch.Tensor  # (total_length,) long: the item each token belongs to

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total_length: int) -> "PackedSequences":
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [0, end_0, end_1, ..., total_length], got "
                f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
            )
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total_length or bool((lengths <= 0).any()):
            raise ValueError(
                f"cu_seqlens {cu_seqlens.tolist()} must start at 0, increase strictly (no empty item) and end at the "
                f"packed length {total_length}"
            )
        segment_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
        return cls(cu_seqlens.to(torch.int32), int(lengths.max()), segment_ids)

    @classmethod
    def from_segment_ids(cls, segment_ids: torch.Tensor) -> "PackedSequences":
        """The bounds of a packed row whose tokens are in segment order (e.g. after tokens were removed)."""
        lengths = torch.bincount(segment_ids)
        return cls.from_cu_seqlens(F.pad(lengths.cumsum(0), (1, 0)), segment_ids.numel())

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def bounds(self) -> list[tuple[int, int]]:
        edges = self.cu_seqlens.tolist()
        return list(zip(edges[:-1], edges[1:]))

    def padded_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, max_seqlen)` packed index of every item's tokens (left-aligned) and the mask of the real ones."""
        offsets = torch.arange(self.max_seqlen, device=self.cu_seqlens.device)
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1])[:, None]
        mask = offsets[None, :] < lengths
        index = torch.where(mask, self.cu_seqlens[:-1, None] + offsets, 0)
        return index.long(), mask

    def attention_kwargs(self) -> dict:
        """Flash-attention's varlen arguments; other attention implementations use the block-diagonal mask."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


def packed_sequences(
    input_ids: torch.LongTensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> PackedSequences | None:
    """Checks the `(B, S)` layout of a batch (`input_ids`, or `inputs_embeds` without them): padded, with an optional
    mask of the same shape, or, with `cu_seqlens`, one packed row without a mask."""
    tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
    batch_shape = tokens.shape
    if len(batch_shape) != 2:
        raise ValueError(
            "MoEMB needs input_ids of shape (batch, sequence), or (1, total_length) with cu_seqlens for a packed "
            f"batch; got {tuple(batch_shape)}"
        )
    if attention_mask is not None and attention_mask.shape != batch_shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(batch_shape)}")
    if cu_seqlens is None:
        return None
    if batch_shape[0] != 1 or attention_mask is not None:
        raise ValueError(
            "a packed batch is input_ids of shape (1, total_length) with cu_seqlens and no attention_mask, got "
            f"input_ids {tuple(batch_shape)}" + (" and an attention_mask" if attention_mask is not None else "")
        )
    return PackedSequences.from_cu_seqlens(cu_seqlens.to(tokens.device), batch_shape[1])


def text_positions(
    batch_shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    packed: PackedSequences | None,
    device: torch.device,
) -> torch.LongTensor:
    """`(B, S)` positions of text-only items, counted from each item's first real token, as `get_rope_index` counts
    them for text: left padding does not shift them, and every item of a packed row starts at 0."""
    if packed is not None:
        positions = torch.arange(batch_shape[1], device=device)
        return (positions - packed.cu_seqlens[:-1].long()[packed.segment_ids])[None]
    if attention_mask is None:
        return torch.arange(batch_shape[1], device=device).expand(batch_shape)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_gated_delta_net(
    module: Qwen3_5MoeGatedDeltaNet, hidden_states: torch.Tensor, packed: PackedSequences
) -> torch.Tensor:
    """transformers' Gated DeltaNet on a packed `(1, T, H)` row, each sequence with its own convolution window and
    recurrent state: fla's varlen kernels on the GPU when installed, else the stock layer once per sequence (exact)."""
    if fla_chunk_gated_delta_rule is not None and hidden_states.is_cuda:
        return _gated_delta_net_varlen(module, hidden_states, packed.cu_seqlens)
    return torch.cat([module(hidden_states[:, start:end]) for start, end in packed.bounds()], dim=1)


def _gated_delta_net_varlen(module: Qwen3_5MoeGatedDeltaNet, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor):
    """`Qwen3_5MoeGatedDeltaNet.forward` without a cache, with the segment bounds given to the convolution too (the
    stock layer passes them to the delta rule only)."""
    length = hidden_states.shape[1]
    mixed_qkv, _ = fla_causal_conv1d(
        x=module.in_proj_qkv(hidden_states),
        weight=module.conv1d.weight.squeeze(1),
        bias=module.conv1d.bias,
        activation=module.activation,
        cu_seqlens=cu_seqlens,
    )
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    beta = module.in_proj_b(hidden_states).sigmoid()
    # fp32 before exp/softplus, as the stock layer: in half precision A could overflow to -inf
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    core_attn_out, _ = fla_chunk_gated_delta_rule(
        query.reshape(1, length, -1, module.head_k_dim),
        key.reshape(1, length, -1, module.head_k_dim),
        value.reshape(1, length, -1, module.head_v_dim),
        g=g,
        beta=beta,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )
    gate = module.in_proj_z(hidden_states).reshape(-1, module.head_v_dim)
    core_attn_out = module.norm(core_attn_out.reshape(-1, module.head_v_dim), gate)
    return module.out_proj(core_attn_out.reshape(1, length, -1))


# --- decoder ------------------------------------------------------------------------------------------------------


class MoEmbDecoderLayer(GradientCheckpointingLayer):
    """Qwen3.5-MoE's pre-norm decoder layer (`Qwen3_5MoeDecoderLayer`) with its MoE FFN on the shared core:

        h <- h + Mixer(RMSNorm_in(h))      Gated DeltaNet ("linear_attention") or gated attention ("full_attention")
        h <- h + MoE(RMSNorm_post(h))      only non-padding tokens are routed
    """

    def __init__(self, config: MoEmbTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3_5MoeGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3_5MoeAttention(config, layer_idx)
        self.mlp = SparseMoeBlock(config, config.moe_layer_spec(), layer_idx=layer_idx)
        self.input_layernorm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, H) or packed (1, T, H)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,  # this layer type's mask (4D for attention, 2D padding for GDN)
        token_mask: torch.Tensor | None = None,  # (B, S), 1 = token to route; None = all
        routes: torch.Tensor | None = None,  # (B, S) expert ids of the modality variant's fixed routing
        packed: PackedSequences | None = None,
        adaptive: AdaptiveForward | None = None,
        **kwargs: Unpack[FlashAttentionKwargs],
    ) -> torch.Tensor:
        """The new hidden states; the attention weights and router logits are recorded by `capture_outputs` hooks on
        the attention and the MoE block. Adaptive computation reads β here and post-processes the routed slots."""
        mixer_input = self.input_layernorm(hidden_states)
        if adaptive is not None:
            adaptive.read_beta(self.layer_idx, getattr(self, "linear_attn", None), mixer_input)
        # Training the one-shot pruner: its straight-through keep mask acts inside the mixers (trained.py).
        keep = adaptive.trained.key_keep if adaptive is not None and adaptive.trained is not None else None
        if keep is not None:
            if self.layer_type == "linear_attention":
                mixer_output = masked_gated_delta_net(self.linear_attn, mixer_input, token_mask, keep)
            else:
                mixer_output = masked_attention(self.self_attn, mixer_input, position_embeddings, token_mask, keep)
        elif self.layer_type == "linear_attention":
            if packed is not None:
                mixer_output = packed_gated_delta_net(self.linear_attn, mixer_input, packed)
            else:
                mixer_output = self.linear_attn(mixer_input, attention_mask=attention_mask)
        else:
            if packed is not None:
                kwargs = {**kwargs, **packed.attention_kwargs()}
            mixer_output, _ = self.self_attn(
                mixer_input, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs
            )
        hidden_states = hidden_states + mixer_output

        with adaptive.routing(self.layer_idx, self.mlp) if adaptive is not None else nullcontext():
            moe_output, _ = self.mlp(
                self.post_attention_layernorm(hidden_states), attention_mask=token_mask, routes=routes
            )
        if keep is not None:
            moe_output = moe_output * keep[..., None]
        return hidden_states + moe_output


# --- pretrained models --------------------------------------------------------------------------------------------


def check_text_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
    """Every MoEMB forward reads the token sequence, images and videos included (as placeholder tokens), from exactly
    one of `input_ids` and `inputs_embeds`."""
    if (input_ids is None) == (inputs_embeds is None):
        given = "both" if input_ids is not None else "neither"
        raise ValueError(
            f"MoEMB needs exactly one of input_ids and inputs_embeds, got {given}: images and videos enter as "
            "placeholder tokens in input_ids beside their pixel values, so pass everything the processor returned"
        )


class MoEmbPreTrainedModel(MoePreTrainedMixin, Qwen3_5MoePreTrainedModel):
    """Qwen3.5-MoE's weight initialisation and attention support, plus the core's modules. `MoePreTrainedMixin`
    makes `experts_implementation` switchable although the experts live in the core."""

    config: MoEmbConfig
    base_model_prefix = "model"
    input_modalities = ("image", "video", "text")
    _no_split_modules = ["MoEmbDecoderLayer", "Qwen3_5MoeVisionBlock"]
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.", r"^mtp\."]
    _can_record_outputs = {
        # The core's block returns the fp32 logits of the routed (non-padding) tokens second; None for fixed routes.
        "router_logits": OutputRecorder(SparseMoeBlock, index=1),
        "hidden_states": MoEmbDecoderLayer,
        "attentions": Qwen3_5MoeAttention,
    }
    # Host syncs in positions and packing; no cache (an embedder encodes each input once).
    _can_compile_fullgraph = False
    _is_stateful = False

    def _init_weights(self, module):
        if init_gate_module(module) or init_moe_module(module, self.config.get_text_config().initializer_range):
            return
        super()._init_weights(module)


class MoEmbTextModel(MoEmbPreTrainedModel):
    """`Qwen3_5MoeTextModel`'s modules (same names) with MoEMB's decoder layers and layer loop, built from the text
    config alone (which holds the MoE block, see `MoEmbTextConfig`), as `Qwen3_5MoeTextModel` is: inside
    `MoEmbModel`, transformers sets the attention and experts implementations there, and the text model's output
    flags (`output_router_logits`, ...) are read from it."""

    config: MoEmbTextConfig
    input_modalities = ("text",)

    def __init__(self, config: MoEmbTextConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MoEmbDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3_5MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(config=config)
        self.modality_expert_map = config.modality_expert_map
        attach_gate_modules(self, config)  # the trained efficiency modules of config.gates (moemb_adaptive.gates)
        self.smoes = None  # a SmoesHost once `attach_smoes` put SMoES on the layers
        self.post_init()

    def attach_smoes(self, settings: SmoesSettings) -> SmoesHost:
        """SMoES on every layer (`moezoo.modeling.moe.smoes.host`): the gated-attention layers advance the attention
        score, the Gated DeltaNet layers carry it, each MoE block gets its buffers."""
        layers = [HostLayer(layer, getattr(layer, "self_attn", None), layer.mlp) for layer in self.layers]
        self.smoes = SmoesHost(settings, layers, self.config.hidden_size, apply_rotary_pos_emb)
        return self.smoes

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,  # (B, S), or packed (1, T) with cu_seqlens
        attention_mask: torch.Tensor | None = None,  # (B, S), 1 = real token; not with cu_seqlens
        position_ids: torch.LongTensor | None = None,  # (3, B, S) MRoPE or (B, S) text positions; default: text
        inputs_embeds: torch.Tensor | None = None,  # (B, S, H) instead of input_ids
        mm_token_type_ids: torch.Tensor | None = None,  # (B, S) 0 text, 1 image, 2 video; default: all text
        cu_seqlens: torch.Tensor | None = None,  # (B + 1,) item bounds of a packed batch
        output_routing_counts: bool = False,
        adaptive: AdaptiveForward | None = None,  # built by MoEmbModel from the adaptive settings
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoEmbModelOutput:
        check_text_inputs(input_ids, inputs_embeds)
        packed = packed_sequences(input_ids, inputs_embeds, attention_mask, cu_seqlens)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        output_router_logits = kwargs.get("output_router_logits", self.config.output_router_logits)
        if output_router_logits and self.modality_expert_map is not None:
            raise ValueError(
                "moe_variant='modality' routes by token modality and has no router logits; ask for "
                "output_routing_counts=True instead"
            )
        if mm_token_type_ids is None:
            mm_token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        if position_ids is None:
            position_ids = text_positions(inputs_embeds.shape[:2], attention_mask, packed, inputs_embeds.device)
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)

        hidden_states = inputs_embeds
        masks = self.layer_masks(hidden_states, attention_mask, packed)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        routes = None
        if self.modality_expert_map is not None:
            expert_of_modality = [self.modality_expert_map[modality] for modality in sorted(TOKEN_MODALITIES)]
            routes = torch.tensor(expert_of_modality, device=mm_token_type_ids.device)[mm_token_type_ids]

        with self._routing_recorder(output_routing_counts) as routing:
            if routing is not None:
                routing.set_groups(mm_token_type_ids)
            for layer in self.layers:
                block_input = hidden_states
                trained = adaptive.trained if adaptive is not None else None
                layer_skip = trained.layer_skip_mask(layer.layer_idx, hidden_states) if trained is not None else None
                bypassed = None if layer_skip is None or trained.train else layer_skip[..., 0] > 0
                if bypassed is not None and packed is not None:  # spec §3.10: the block runs the others only
                    hidden_states = self._run_without(layer, hidden_states, bypassed[0], position_embeddings,
                                                      routes, adaptive, **kwargs)  # fmt: skip
                    layer_skip = None
                else:
                    with adaptive.bypassing(bypassed) if bypassed is not None else nullcontext():
                        hidden_states = layer(
                            hidden_states,
                            position_embeddings=position_embeddings,
                            attention_mask=masks[layer.layer_type],
                            token_mask=attention_mask,
                            routes=routes,
                            packed=packed,
                            adaptive=adaptive,
                            **kwargs,
                        )
                if layer_skip is not None:  # h <- h + m (Block(h) - h), m = 1 - skip (spec §3.10)
                    hidden_states = block_input + (1 - layer_skip) * (hidden_states - block_input)
                if trained is not None:
                    trained.after_block(layer.layer_idx, hidden_states)
                if adaptive is not None and adaptive.pending_drop is not None:  # one-shot token pruning
                    hidden_states, position_embeddings, attention_mask = adaptive.remove_dropped(
                        hidden_states, position_embeddings
                    )
                    if packed is not None:  # one row: the survivors, their segments shorter
                        packed = PackedSequences.from_segment_ids(adaptive.metadata.segment_id[0])
                        attention_mask = None
                    masks = self.layer_masks(hidden_states, attention_mask, packed)
        if adaptive is not None:
            hidden_states = adaptive.restore_layout(hidden_states)
        return MoEmbModelOutput(
            last_hidden_state=self.norm(hidden_states),
            routing_counts=(
                torch.stack([routing.counts[routing.layer_names[layer.mlp]] for layer in self.layers])
                if output_routing_counts
                else None
            ),
            adaptive=adaptive.report(cu_seqlens) if adaptive is not None else None,
        )

    def _run_without(self, layer, hidden_states, bypassed, position_embeddings, routes, adaptive, **kwargs):
        """Packed execution of a block some samples bypass: their tokens (`bypassed` `(T,)`) are left out of the
        block's packed row (index-selected out, cu_seqlens recomputed) and keep their hidden states. The block's
        `output_hidden_states` entry holds the rows it ran, and is missing when every item bypasses it."""
        rows = (~bypassed).nonzero().flatten()
        segments = adaptive.metadata.segment_id[0, rows]
        sub_packed = PackedSequences.from_cu_seqlens(
            F.pad(torch.unique_consecutive(segments, return_counts=True)[1].cumsum(0), (1, 0)), rows.numel()
        ) if rows.numel() else None  # fmt: skip
        with adaptive.running_only(rows, layer, hidden_states):
            if sub_packed is None:  # every sample bypasses the block
                return hidden_states
            sub_hidden = hidden_states[:, rows]
            output = layer(
                sub_hidden,
                position_embeddings=tuple(part[:, rows] for part in position_embeddings),
                attention_mask=self.layer_masks(sub_hidden, None, sub_packed)[layer.layer_type],
                routes=None if routes is None else routes[:, rows],
                packed=sub_packed,
                adaptive=adaptive,
                **kwargs,
            )
        return hidden_states.index_copy(1, rows, output)

    def layer_masks(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, packed: PackedSequences | None
    ) -> dict:
        """The attention mask of each layer type: 4D causal for attention, 2D padding for Gated DeltaNet."""
        if packed is not None:
            return {
                "full_attention": create_causal_mask(
                    config=self.config, inputs_embeds=hidden_states, attention_mask=None, cache=None,
                    and_mask_function=packed_sequence_mask_function(packed.segment_ids[None]),
                ),
                "linear_attention": None,  # sequences are kept apart by running them one by one
            }  # fmt: skip
        return {
            "full_attention": create_causal_mask(
                config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask, cache=None
            ),
            "linear_attention": create_recurrent_attention_mask(self.config, hidden_states, attention_mask),
        }

    def _routing_recorder(self, enabled: bool):
        if not enabled:
            return nullcontext()
        if any(layer.mlp.routing_recorder is not None for layer in self.layers):
            raise ValueError(
                "routing is already recorded by an enclosing record_routing(); read the counts there, or call the "
                "model outside it with output_routing_counts=True"
            )
        return record_routing(self, group_names=[TOKEN_MODALITIES[i] for i in sorted(TOKEN_MODALITIES)])


class MoEmbModel(MoEmbPreTrainedModel):
    """The backbone: `Qwen3_5MoeModel`'s vision tower, placeholder scattering and MRoPE positions, with
    MoEMB's text model. `forward` returns the text model's hidden states; `MoEmbForEmbedding` pools them. As in
    `Qwen3_5MoeModel`, placeholders without pixels are embedded as ordinary tokens; the embedder refuses them."""

    # Qwen3.5's multimodal plumbing, reused as is.
    get_vision_position_ids = Qwen3_5MoeModel.get_vision_position_ids
    get_rope_index = Qwen3_5MoeModel.get_rope_index
    get_image_features = Qwen3_5MoeModel.get_image_features
    get_video_features = Qwen3_5MoeModel.get_video_features
    get_placeholder_mask = Qwen3_5MoeModel.get_placeholder_mask

    def __init__(self, config: MoEmbConfig):
        super().__init__(config)
        self.visual = Qwen3_5MoeVisionModel._from_config(config.vision_config)
        self.language_model = MoEmbTextModel(config.text_config)
        self.gate_control: GateControl | None = None  # set by `controlled_gates`
        if config.smoes is not None:
            self.language_model.attach_smoes(config.smoes_settings())
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.language_model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,  # (B, S), or packed (1, T) with cu_seqlens
        attention_mask: torch.Tensor | None = None,  # (B, S), 1 = real token; not with cu_seqlens
        position_ids: torch.LongTensor | None = None,  # (3, B, S) MRoPE positions; default: computed
        inputs_embeds: torch.Tensor | None = None,  # (B, S, H) instead of input_ids, placeholders included
        pixel_values: torch.Tensor | None = None,  # (image patches, C * T_p * P * P)
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,  # (images, 3)
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,  # (B, S) 0 text, 1 image, 2 video; default: the placeholders
        cu_seqlens: torch.Tensor | None = None,  # (B + 1,) item bounds of a packed batch
        output_routing_counts: bool = False,
        pooled_index: torch.LongTensor | None = None,  # (B,) the pooled tokens, which adaptive computation keeps
        adaptive: AdaptiveSettings | dict | None = None,  # overrides config.adaptive for this call; {}: none
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoEmbModelOutput:
        check_text_inputs(input_ids, inputs_embeds)
        # Validated before the vision tower runs: a malformed batch fails fast.
        packed = packed_sequences(input_ids, inputs_embeds, attention_mask, cu_seqlens)
        settings = self.adaptive_settings(adaptive, packed)
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if mm_token_type_ids is None:
            image_placeholders, video_placeholders = self.get_placeholder_mask(input_ids, inputs_embeds)
            mm_token_type_ids = image_placeholders[..., 0].long() + 2 * video_placeholders[..., 0].long()
        if pixel_values is not None:
            image_outputs = self.get_image_features(pixel_values, image_grid_thw, return_dict=True)
            image_features = torch.cat(image_outputs.pooler_output).to(inputs_embeds)
            image_mask, _ = self.get_placeholder_mask(input_ids, inputs_embeds, image_features=image_features)
            inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_features)
        if pixel_values_videos is not None:
            video_outputs = self.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)
            video_features = torch.cat(video_outputs.pooler_output).to(inputs_embeds)
            _, video_mask = self.get_placeholder_mask(input_ids, inputs_embeds, video_features=video_features)
            inputs_embeds = inputs_embeds.masked_scatter(video_mask, video_features)
        if position_ids is None and (image_grid_thw is not None or video_grid_thw is not None):
            position_ids = self.rope_positions(
                mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, packed
            )  # without visual inputs, the text model's own text positions are the same as Qwen's
        adaptive_forward = padded = None
        if settings is None and self.gate_control is not None:  # trained gates run under a GateControl
            settings = AdaptiveSettings()
        if settings is not None:
            if position_ids is None:
                position_ids = text_positions(inputs_embeds.shape[:2], attention_mask, packed, inputs_embeds.device)
            if settings.execution == "packed" and packed is None:  # spec §3.14: the real tokens in one row
                padded = PaddedBatch.from_mask(attention_mask, inputs_embeds.shape[:2], inputs_embeds.device)
                inputs_embeds, mm_token_type_ids = padded.pack(inputs_embeds), padded.pack(mm_token_type_ids)
                position_ids = padded.pack(position_ids, batch_dim=position_ids.ndim - 2)
                pooled_index = None if pooled_index is None else padded.packed_index(pooled_index)
                packed = PackedSequences.from_cu_seqlens(padded.cu_seqlens, inputs_embeds.shape[1])
                attention_mask, cu_seqlens = None, padded.cu_seqlens
            metadata = TokenMetadata.from_inputs(
                mm_token_type_ids,
                attention_mask,
                position_ids if position_ids.ndim == 3 else position_ids[None].expand(3, -1, -1),
                pooled_index,
                packed.segment_ids if packed is not None else None,
            )
            control = self.gate_control
            if padded is not None and control is not None and control.actions is not None:
                # Forced actions come in the input's layout: packed like its tokens for this forward.
                control = dataclasses.replace(control, actions=padded.pack(control.actions))
            adaptive_forward = AdaptiveForward(
                settings, self.config, metadata, (image_grid_thw, video_grid_thw),
                control=control, text_model=self.language_model,
            )  # fmt: skip
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            mm_token_type_ids=mm_token_type_ids,
            cu_seqlens=cu_seqlens,
            output_routing_counts=output_routing_counts,
            adaptive=adaptive_forward,
            **kwargs,
        )
        if padded is not None:  # the input's layout; the hidden states of output_hidden_states stay packed
            outputs.last_hidden_state = padded.unpack(outputs.last_hidden_state)
            trained = adaptive_forward.trained
            if self.gate_control is not None and trained is not None:  # the gates' record too (-1: no decision)
                if trained.record.actions is not None:
                    trained.record.actions = padded.unpack(trained.record.actions + 1) - 1
                self.gate_control.record = trained.record
        return outputs

    def adaptive_settings(
        self, adaptive: AdaptiveSettings | dict | None, packed: PackedSequences | None
    ) -> AdaptiveSettings | None:
        """The adaptive computation of this call: the keyword's (checked), else the config's; None for none."""
        if adaptive is None:
            settings = AdaptiveSettings.from_dict(self.config.adaptive)
        else:
            settings = AdaptiveSettings.from_dict(adaptive)
            check_adaptive_settings(
                settings, self.config.text_config, self.config.moe_variant, "model(adaptive=...): ",
                gates=self.config.gate_modules(),
            )  # fmt: skip
        if settings is None or not settings.is_active:
            return None
        return settings

    def rope_positions(
        self,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.LongTensor | None,
        video_grid_thw: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        packed: PackedSequences | None,
    ) -> torch.LongTensor:
        """`(3, B, S)` MRoPE positions from Qwen3.5's `get_rope_index`, counted from each item's first real token
        (so left padding does not shift them). A packed row is unpacked for it, and the positions packed back.
        `get_rope_index` reads only the shape of its `input_ids`, so the token types stand in for them (the ids may
        not be there: `inputs_embeds`)."""
        if packed is None:
            positions, _ = self.get_rope_index(
                mm_token_type_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask=attention_mask
            )
            return positions
        index, real = packed.padded_layout()
        token_types = mm_token_type_ids[0, index]
        positions, _ = self.get_rope_index(
            token_types, token_types, image_grid_thw, video_grid_thw, attention_mask=real
        )
        return positions[:, real][:, None, :]


@contextmanager
def controlled_gates(model: nn.Module, control: GateControl):
    """While active, every forward of the MoEMB backbone inside `model` (a PEFT wrapper too) runs its gates as
    `control` says (`moemb_adaptive.gates`), and records what they did in `control.record` (reset at each forward)."""
    backbones = [module for module in model.modules() if isinstance(module, MoEmbModel)]
    if not backbones:
        raise ValueError(f"controlled_gates needs a MoEMB model, got {type(model).__name__}")
    for backbone in backbones:
        backbone.gate_control = control
    try:
        yield control
    finally:
        for backbone in backbones:
            backbone.gate_control = None


class MoEmbForEmbedding(MoEmbPreTrainedModel):
    """The embedder (`AutoModel`): one L2-normalised float32 vector per query or target (spec §2.2).

    Pooling (`config.pooling`): the hidden state of the `<emb>` token (`config.emb_token_id`, the last one of each
    item), or of each item's last real token; an explicit `pooled_index` (what `MoEmbProcessor` returns) overrides
    both.
    """

    def __init__(self, config: MoEmbConfig):
        super().__init__(config)
        self.model = MoEmbModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding):
        self.model.set_input_embeddings(value)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pooled_index: torch.LongTensor | None = None,  # (B,) position of each item's pooled token
        output_routing_counts: bool = False,
        adaptive: AdaptiveSettings | dict | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoEmbOutput:
        """Inputs as `MoEmbModel.forward` (what the processor returns), plus an optional `pooled_index`: for padded
        batches the position in each row, for packed ones the position in the packed row. `adaptive` overrides
        `config.adaptive` for this call (`{}` turns it off)."""
        check_text_inputs(input_ids, inputs_embeds)
        self._check_visual_inputs(input_ids, inputs_embeds, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                  pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)  # fmt: skip
        if pooled_index is None:  # before the forward: a batch without its <emb> tokens fails fast
            pooled_index = self.pooled_positions(input_ids, attention_mask, cu_seqlens, inputs_embeds)
        smoes, losses = self.model.language_model.smoes, None
        trains_smoes, recording = smoes_recording(self, smoes, lambda: self._smoes_tokens(
            input_ids, inputs_embeds, mm_token_type_ids, attention_mask, cu_seqlens, adaptive
        ))  # fmt: skip
        if trains_smoes:
            kwargs["output_router_logits"] = True
        with recording:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                mm_token_type_ids=mm_token_type_ids,
                cu_seqlens=cu_seqlens,
                output_routing_counts=output_routing_counts,
                pooled_index=pooled_index,
                adaptive=adaptive,
                return_dict=True,
                **kwargs,
            )
            if trains_smoes:
                losses = smoes.losses(outputs.router_logits, self.config.text_config.num_experts_per_tok)
        hidden_states = outputs.last_hidden_state
        if cu_seqlens is not None:
            pooled = hidden_states[0, pooled_index]
        else:
            pooled = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), pooled_index]
        embeddings = pooled.float()
        if self.config.normalize_embeddings:
            embeddings = F.normalize(embeddings, dim=-1)
        return MoEmbOutput(embeddings=embeddings, pooled_index=pooled_index, **outputs, **smoes_outputs(losses))

    def _smoes_tokens(self, input_ids, inputs_embeds, mm_token_type_ids, attention_mask, cu_seqlens, adaptive):
        """(B, T) hard modality and validity of an SMoES training forward's tokens: vision where `mm_token_type_ids`
        says image or video (by default: the image and video placeholders)."""
        if cu_seqlens is not None:
            raise ValueError(
                "SMoES training runs on padded batches (input_ids (B, S) with attention_mask), not packed ones with "
                "cu_seqlens"
            )
        if self.model.adaptive_settings(adaptive, None) is not None:
            raise ValueError(
                "SMoES training needs the full forward: adaptive computation changes the routing; pass adaptive={} "
                "or clear config.adaptive while training"
            )
        placeholders = self._token_mask(self.config.image_token_id, input_ids, inputs_embeds)
        placeholders |= self._token_mask(self.config.video_token_id, input_ids, inputs_embeds)
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
        return token_modality(
            tokens.shape, mm_token_type_ids=mm_token_type_ids,
            vision_token_types=self.config.smoes_settings().smoes_vision_token_types, vision_token_mask=placeholders,
            attention_mask=attention_mask,
        )  # fmt: skip

    def pooled_positions(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.LongTensor:
        """`(B,)` position of each item's pooled token: its last `<emb>` token, or its last real token. Without
        `input_ids`, `<emb>` tokens are found in `inputs_embeds` by their embedding, as transformers finds image
        placeholders."""
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]  # (B, S): the batch layout
        device, length = tokens.device, tokens.shape[1]
        positions = torch.arange(length, device=device)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device)
            if self.config.pooling == "last_token":
                return (cu_seqlens[1:] - 1).long()
            packed = PackedSequences.from_cu_seqlens(cu_seqlens, length)
            is_emb = self._token_mask(self._emb_token_id(), input_ids, inputs_embeds)[0]
            pooled = torch.full((packed.num_sequences,), -1, dtype=torch.long, device=device)
            pooled = pooled.scatter_reduce(0, packed.segment_ids[is_emb], positions[is_emb], reduce="amax")
        else:
            is_real = torch.ones(tokens.shape, dtype=torch.bool, device=device)
            if attention_mask is not None:
                is_real = attention_mask.bool()
            candidates = is_real
            if self.config.pooling == "emb_token":
                candidates = is_real & self._token_mask(self._emb_token_id(), input_ids, inputs_embeds)
            pooled = torch.where(candidates, positions, -1).amax(dim=-1)
        missing = (pooled < 0).nonzero().flatten().tolist()
        if missing:
            if self.config.pooling == "last_token":
                raise ValueError(f"items {missing} of the batch have no real token: their attention_mask is all 0")
            raise ValueError(
                f"items {missing} of the batch have no {self.config.emb_token} token (id {self.config.emb_token_id}) "
                f"among their real tokens, probably truncated away: truncate the content, not the end (MoEmbProcessor "
                f"keeps {self.config.emb_token} last), or pass pooled_index"
            )
        return pooled

    def _check_visual_inputs(self, input_ids, inputs_embeds, **visual_inputs) -> None:
        """Placeholders need their pixels and grid, and pixels their grid (e.g. a collator that dropped the visual
        keys): without this, the vision tower fails with an unrelated TypeError or AttributeError, or the
        placeholders are silently embedded as text."""
        for kind, token_id, pixels, grid in (
            ("image", self.config.image_token_id, "pixel_values", "image_grid_thw"),
            ("video", self.config.video_token_id, "pixel_values_videos", "video_grid_thw"),
        ):
            missing = [name for name in (pixels, grid) if visual_inputs[name] is None]
            if not missing:
                continue
            num_placeholders = int(self._token_mask(token_id, input_ids, inputs_embeds).sum())
            if num_placeholders or visual_inputs[pixels] is not None:
                raise ValueError(
                    f"input_ids hold {num_placeholders} {kind} placeholder tokens (id {token_id}) but "
                    f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: pass {pixels} and "
                    f"{grid} as the processor returned them with these input_ids"
                )

    def _token_mask(
        self, token_id: int, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """`(B, S)` where `token_id` is; without `input_ids`, found by its embedding, as transformers finds image
        placeholders in `inputs_embeds`."""
        if input_ids is not None:
            return input_ids == token_id
        token_embedding = self.get_input_embeddings()(torch.tensor(token_id, device=inputs_embeds.device))
        return (inputs_embeds == token_embedding).all(-1)

    def _emb_token_id(self) -> int:
        if self.config.emb_token_id is None:
            raise ValueError(
                "config.emb_token_id is not set (it is assigned when a checkpoint is converted): set it to the "
                f"tokenizer's {self.config.emb_token} id, pass pooled_index, or use pooling='last_token'"
            )
        return self.config.emb_token_id

    def contrastive_logits(self, query_embeddings: torch.Tensor, target_embeddings: torch.Tensor) -> torch.Tensor:
        """`(queries, targets)` scaled cosine similarities `logit_scale * q . t` of normalised embeddings: the logits
        of the one-directional InfoNCE loss, whose labels are the matching targets (spec §2.3). fp32 whatever the
        model dtype or autocast (`scaled_similarities`)."""
        targets = target_embeddings.to(query_embeddings.device)
        return scaled_similarities(query_embeddings, targets, self.config.logit_scale)
