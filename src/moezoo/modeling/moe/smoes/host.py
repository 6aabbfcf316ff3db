"""SMoES on a model built from the shared core, attached without changing its forward (MoEMB's native Qwen3.5-MoE
design, OmniMoE-VL's language experts).

A host names, per decoder layer, the layer itself, its softmax-attention module (None for a linear-attention layer)
and its MoE block (None for a dense layer). `SmoesHost` then gives each MoE block a `smoes` child holding the layer's
buffers (`SmoesLayerState`) and feeds the shared `SmoesRuntime` from forward hooks, which do nothing outside a training
forward and during gradient checkpointing's re-run:

- a decoder layer reports its input x^(l) (the residual branch's weight of the attention estimator);
- a softmax-attention module reports its mask and rotary embeddings, its `q_norm` / `k_norm` their queries and keys
  (rotated here with the host's own RoPE function), and the module its output: the estimator mixes the scores with one
  extra attention pass and advances them; linear-attention layers report nothing and carry the scores unchanged;
- a MoE block records the scores (and, for the Gaussian estimator, the moments) of its router input.

The host's top-level forward wraps its training forward in `SmoesHost.recording(...)` and hands the router logits to
`SmoesHost.losses`, which replace its own load-balancing loss. The state dict gains `<block>.smoes.*` and the host's
`step`; everything else, and every forward output, is the model's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..pretrained import checkpoints_reentrantly
from .regularizer import SmoesLosses, apply_smoes, check_routers_trainable
from .scores import hard_modality
from .state import SmoesLayerState, SmoesRuntime


RotaryFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class HostLayer:
    """One decoder layer of a host: the layer, its softmax-attention module (None: linear attention, whose scores are
    carried) and its MoE block (None: a dense FFN, which still advances the attention estimator)."""

    layer: nn.Module
    attention: nn.Module | None
    moe_block: nn.Module | None


class AttentionScoreTap:
    """Feeds the attention estimator from a transformers attention module with `q_norm` and `k_norm` (Qwen3, Qwen3.5)
    through hooks: the queries and keys leave those norms before RoPE, which `apply_rotary` (the host modeling file's
    `apply_rotary_pos_emb`) applies with the rotary embeddings the module was called with."""

    def __init__(self, runtime: SmoesRuntime, apply_rotary: RotaryFunction):
        self.runtime = runtime
        self.apply_rotary = apply_rotary
        self._call = self._query = None

    def attach(self, attention: nn.Module) -> None:
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(attention, name, None), nn.Module):
                raise ValueError(
                    f"SMoES' attention score reads the queries and keys of {type(attention).__name__} at its {name}, "
                    "which it lacks; use smoes_score_type='gaussian' on this model"
                )
        attention.register_forward_pre_hook(self._enter, with_kwargs=True)
        attention.q_norm.register_forward_hook(self._keep_query)
        attention.k_norm.register_forward_hook(self._mix)
        attention.register_forward_hook(self._advance)

    def _enter(self, module, args, kwargs) -> None:
        self._call = self._query = None  # nothing left from a forward that failed halfway
        if not self.runtime.tracks_attention:
            return
        if "position_embeddings" not in kwargs:
            raise ValueError(
                f"SMoES' attention score needs {type(module).__name__} to be called with position_embeddings= (the "
                "rotary embeddings of its queries and keys)"
            )
        self._call = (kwargs["position_embeddings"], kwargs.get("attention_mask"))

    def _keep_query(self, module, args, output: torch.Tensor) -> None:
        if self._call is not None:
            self._query = output

    @torch.no_grad()
    def _mix(self, module, args, key: torch.Tensor) -> None:
        if self._call is None:
            return
        (cos, sin), attention_mask = self._call
        query, key = self.apply_rotary(self._query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        self.runtime.mix_attention_scores(query, key, attention_mask)
        self._query = None

    def _advance(self, module, args, output) -> None:
        if self._call is None:
            return
        self._call = None
        self.runtime.advance_attention_scores(output[0] if isinstance(output, tuple) else output)


class SmoesHost(nn.Module):
    """SMoES attached to a host's decoder layers (see the module docstring). Its only buffer, `step`, counts the
    training forwards that updated the SMoES buffers (it drives the alpha_MI warm-up and the re-binning).

    Args:
        settings: the `smoes_*` fields (`SmoesSettings` or any config with them).
        layers: every decoder layer of the host, in order.
        hidden_size: the router input's width (the Gaussian temperature is `smoes_gauss_tau_scale` times it).
        apply_rotary: the host's `apply_rotary_pos_emb(q, k, cos, sin)`, for the attention estimator.
    """

    def __init__(self, settings, layers: Sequence[HostLayer], hidden_size: int, apply_rotary: RotaryFunction):
        super().__init__()
        self.settings = settings
        self.runtime = SmoesRuntime(
            settings.smoes_score_type, settings.smoes_gauss_tau_scale * hidden_size, settings.smoes_gauss_var_eps
        )
        # A plain list: the blocks belong to the host model (registered here, their weights would be saved twice).
        self._moe_blocks = [host_layer.moe_block for host_layer in layers if host_layer.moe_block is not None]
        device = self._moe_blocks[0].gate.weight.device
        self.register_buffer("step", torch.zeros((), dtype=torch.long, device=device))
        for host_layer in layers:
            host_layer.layer.register_forward_pre_hook(self._enter_layer, with_kwargs=True)
            if host_layer.attention is not None:
                AttentionScoreTap(self.runtime, apply_rotary).attach(host_layer.attention)
            block = host_layer.moe_block
            if block is not None:
                weight = block.gate.weight
                block.smoes = SmoesLayerState(hidden_size, block.num_experts, settings.smoes_num_bins).to(weight.device)
                block.register_forward_pre_hook(self._record_router_input)

    @property
    def states(self) -> list[SmoesLayerState]:
        """The SMoES buffers of every MoE layer, in layer order."""
        return [block.smoes for block in self._moe_blocks]

    def router_weights(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Each MoE block's router weight, named by its position among the MoE blocks."""
        return {f"{prefix}{block.layer_name}.gate.weight": block.gate.weight for block in self._moe_blocks}

    def _enter_layer(self, layer, args, kwargs) -> None:
        if self.runtime.tracks_attention:
            self.runtime.enter_layer(args[0] if args else kwargs["hidden_states"])

    def _record_router_input(self, block, args) -> None:
        if self.runtime.recording:
            self.runtime.record_router_input(block.smoes, args[0])

    @contextmanager
    def recording(self, model: nn.Module, modality: torch.LongTensor, valid: torch.Tensor) -> Iterator[None]:
        """A training forward of (B, T) tokens with hard labels `modality` and padding mask `valid`: the hooks record
        during it. Refused, naming what to change, with frozen routers while a loss coefficient is non-zero and under
        reentrant activation checkpointing."""
        check_smoes_training(self.settings, model, self.router_weights())
        self.runtime.start(modality, valid)
        try:
            yield
        finally:
            self.runtime.stop()

    def losses(self, router_logits: Sequence[torch.Tensor], top_k: int) -> SmoesLosses:
        """The SMoES losses of the forward inside `recording` from its router logits (per MoE layer, of all tokens or
        of the valid ones), then the buffer updates. Call it inside `recording`."""
        selections = [logits.topk(top_k, dim=-1).indices for logits in router_logits]
        return apply_smoes(self.settings, self.states, self.runtime, router_logits, self.step, selections)


def smoes_recording(
    model: nn.Module, host: SmoesHost | None, tokens: Callable[[], tuple[torch.LongTensor, torch.Tensor]]
) -> tuple[bool, AbstractContextManager]:
    """Whether this forward of `model` trains with SMoES (training mode, a host, `smoes_enabled`), and the context to
    run it in: the host's `recording` of the tokens' hard modality and validity (`tokens()`, asked for only then), or
    none."""
    if host is None or not (model.training and host.settings.smoes_enabled):
        return False, nullcontext()
    return True, host.recording(model, *tokens())


def smoes_outputs(losses: SmoesLosses | None) -> dict:
    """The output fields of a training forward's SMoES terms (none without SMoES): `aux_loss` (what replaces the
    host's load-balancing loss), `smoes_bal_loss`, `smoes_mi_loss`, the per-layer MI `smoes_mi` and `smoes_bins`."""
    if losses is None:
        return {}
    return {
        "aux_loss": losses.loss,
        "smoes_bal_loss": losses.balance_loss,
        "smoes_mi_loss": losses.mi_loss,
        "smoes_mi": losses.layer_mi,
        "smoes_bins": losses.bins,
    }


def check_smoes_training(settings, model: nn.Module, router_weights: dict[str, torch.Tensor]) -> None:
    """Before an SMoES training forward: the routers must train if a loss coefficient is non-zero (checked when
    gradients are on), and activation checkpointing must be non-reentrant (reentrant checkpointing records the router
    logits without gradients, so the routers would silently not train)."""
    if torch.is_grad_enabled():
        check_routers_trainable(settings, router_weights)
    if checkpoints_reentrantly(model):
        raise ValueError(
            "SMoES losses need non-reentrant gradient checkpointing: reentrant checkpointing records the router "
            "logits without gradients, so the routers would silently not train; use the default, "
            "model.activation_checkpointing_enable(), or activation_checkpointing_kwargs={'use_reentrant': False}, "
            "or turn SMoES off (smoes_enabled=False)"
        )


def token_modality(
    batch_shape: torch.Size,
    *,
    mm_token_type_ids: torch.Tensor | None = None,
    vision_token_types: Sequence[int] = (1, 2),
    vision_token_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """(B, T) hard modality and validity of a training forward's tokens (spec §2.1): vision where `mm_token_type_ids`
    is one of `vision_token_types`, else where `vision_token_mask` (the host's image/video placeholders) is set;
    valid where `attention_mask` is 1 (all tokens without one)."""
    if mm_token_type_ids is not None:
        modality = hard_modality(mm_token_type_ids, vision_token_types)
    elif vision_token_mask is not None:
        modality = vision_token_mask.long()
    else:
        raise ValueError(
            "SMoES training needs each token's modality: pass mm_token_type_ids (the processor returns it) or "
            "input_ids holding the image/video placeholders, or turn SMoES off"
        )
    if modality.shape != batch_shape:
        raise ValueError(
            f"the token modalities have shape {tuple(modality.shape)}, expected {tuple(batch_shape)} (one per token)"
        )
    if attention_mask is None:
        return modality, torch.ones(batch_shape, dtype=torch.bool, device=modality.device)
    if attention_mask.shape != batch_shape:
        raise ValueError(
            f"SMoES training needs a 2D padding attention_mask of shape {tuple(batch_shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    return modality, attention_mask.bool()
