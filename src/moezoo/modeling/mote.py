"""MoTE: decoders whose FFNs are named task experts plus a shared expert, one route per example (spec mote.md §2).

Only the FFN of a converted decoder layer changes; everything else is transformers' own classes:

    MoteFeedForward                          replaces `layer.mlp`: experts[name] (one FFN per task) + shared_expert
    LlamaMoteForCausalLM                     Llama with MoTE layers (text only)
    VideoLlmMoteForConditionalGeneration     SigLIP vision tower -> frame tokens -> 2-layer projector -> LlamaMote
    GlmOcrMoteForConditionalGeneration       GLM-OCR (CogViT + merger, unchanged) with a MoTE decoder

The route is `task_ids: LongTensor (batch_size,)`, one id per example, index into `config.mote_expert_names` (spec
§2.1, 0-based). The text model resolves it once per batch (falling back to `mote_default_route`), passes it as an
explicit argument to every decoder layer (so it never reaches the attention kernels), and keeps it with the KV cache:
decoding steps must use the routes of the prefill (spec A20); without a cache, `generate` keeps the `sample_top1`
router on the prompt (`MoteGenerationMixin`). `generate(..., task_ids=...)` forwards `task_ids` at every step and
repeats it for beam search like any other per-example tensor.

State-dict keys of a MoTE FFN (Llama; GLM has a fused `gate_up_proj` instead of `gate_proj`/`up_proj`):

    model.layers.{l}.mlp.experts.{name}.{gate_proj,up_proj,down_proj}.weight
    model.layers.{l}.mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight
    model.layers.{l}.mlp.router.weight                                          (routing mode "token_top1")
    model.sample_router.weight                                                  (routing mode "sample_top1")
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    MultimodalBaseModelOutputWithPast,
    MultimodalCausalLMOutputWithPast,
)
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
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.siglip.modeling_siglip import SiglipVisionModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ..configuration.mote import (
    LEARNED_ROUTING_MODES,
    ROUTING_MODES,
    GlmOcrMoteConfig,
    GlmOcrMoteTextConfig,
    LlamaMoteConfig,
    VideoLlmMoteConfig,
    check_expert_name,
)
from .moe.initialization import init_moe_module
from .moe.losses import load_balancing_loss
from .moe.pretrained import checkpoints_reentrantly
from .moe.router import TopKRouter
from .moe.spec import MoeLayerSpec


logger = logging.get_logger(__name__)

# The cache's old argument name, accepted (with transformers' deprecation warning) as long as the transformers forwards
# these wrap accept it; every MoTE forward takes it, so that the cache is never lost between a wrapper and its base.
accepts_past_key_values = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")


# --- outputs ------------------------------------------------------------------------------------------------------


@dataclass
class MoteMultimodalModelOutputWithPast(MultimodalBaseModelOutputWithPast):
    r"""
    router_logits (`tuple` of `torch.FloatTensor`, *optional*): the learned routers' fp32 logits of the ablation
        modes, returned with `output_router_logits=True`: `(batch_size, num_experts)` from the sample router
        (`sample_top1`), `(batch_size * sequence_length, num_experts)` per layer (`token_top1`).
    """

    router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MoteMultimodalCausalLMOutputWithPast(MultimodalCausalLMOutputWithPast):
    r"""
    aux_loss (`torch.FloatTensor`, *optional*): the load-balancing loss of the learned-router ablation modes; `loss`
        includes it times `mote_router_aux_loss_coef`.
    router_logits (`tuple` of `torch.FloatTensor`, *optional*): as in `MoteMultimodalModelOutputWithPast`.
    """

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MoteRoutes:
    """The routes of one batch, chosen at prefill and kept with its KV cache (attribute `mote_routes`)."""

    task_ids: torch.LongTensor  # (batch_size,) the expert of each example
    route_weights: torch.Tensor | None = None  # (batch_size,) the sample router's probability of that expert


# --- the task-expert FFN ------------------------------------------------------------------------------------------


def top1_router(config) -> TopKRouter:
    """The learned router of the ablation modes: softmax over the experts, top-1, weighted by its probability
    (Switch-style, spec §2.5); its math runs in fp32."""
    spec = MoeLayerSpec(
        hidden_size=config.hidden_size,
        num_experts=len(config.mote_expert_names),
        num_experts_per_tok=1,
        expert_intermediate_size=config.mote_expert_config().intermediate_size,
        router_type="softmax",
        norm_topk_prob=False,
    )
    return TopKRouter(spec)


class MoteFeedForward(nn.Module):
    """Named routed experts and an optional shared expert in place of a decoder layer's FFN (spec §2.3).

    `out = lambda_sh * F_sh(x) + lambda_task * F_r(x)`, with `F_r` the expert of the example's route. Each expert is
    a `mlp_class` (the backbone's own FFN class, e.g. `LlamaMLP`), so its parameters keep the backbone's names under
    `experts.<name>.`. The output is the combined FFN output; the decoder layer adds the residual (and applies any
    post-FFN norm) once, which keeps a function-preserving conversion bit-exact.

    The routing ablations of spec §2.5 use the same experts: `dense` averages all routed experts; `token_top1` routes
    each token with a learned top-1 router (`router`) and scales by its probability; `sample_top1` is `task` routing
    with routes and weights chosen by the text model's sample router.
    """

    def __init__(self, config, mlp_class: type[nn.Module]):
        super().__init__()
        self.mlp_class = mlp_class
        self.expert_config = config.mote_expert_config()
        self.routing_mode = config.mote_routing_mode
        self.routed_expert_scale = config.mote_routed_expert_scale
        self.shared_expert_scale = config.mote_shared_expert_scale
        self.experts = nn.ModuleDict({name: mlp_class(self.expert_config) for name in config.mote_expert_names})
        self.shared_expert = mlp_class(self.expert_config) if config.mote_num_shared_experts else None
        self.router = top1_router(config) if self.routing_mode == "token_top1" else None

    def build_expert(self) -> nn.Module:
        """A new expert FFN on the device and in the dtype of the existing experts (its weights to be filled)."""
        reference = next(self.experts.parameters())
        return self.mlp_class(self.expert_config).to(device=reference.device, dtype=reference.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, D), the post-attention-normed input
        task_ids: torch.LongTensor | None = None,  # (B,) one route per example: "task" and "sample_top1"
        route_weights: torch.Tensor | None = None,  # (B,) the sample router's probabilities: "sample_top1"
    ) -> torch.Tensor:
        if self.routing_mode == "dense":
            routed = sum(expert(hidden_states) for expert in self.experts.values()) / len(self.experts)
        elif self.routing_mode == "token_top1":
            tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
            _, weights, expert_ids = self.router(tokens)
            routed = (self.dispatch(tokens, expert_ids[:, 0]) * weights).view_as(hidden_states)
        else:
            if task_ids is None:
                raise ValueError(
                    f"MoteFeedForward needs task_ids (one route id per example) in routing mode {self.routing_mode!r}"
                )
            routed = self.dispatch(hidden_states, task_ids)
            if route_weights is not None:
                routed = routed * route_weights.to(routed.dtype)[:, None, None]
        output = self.routed_expert_scale * routed
        if self.shared_expert is not None:
            output = self.shared_expert_scale * self.shared_expert(hidden_states) + output
        return output

    def dispatch(self, inputs: torch.Tensor, expert_ids: torch.LongTensor) -> torch.Tensor:
        """Row `i` of `inputs` through expert `expert_ids[i]`. One route runs as a single call, computing exactly
        what the dense FFN computes; a mixed batch gathers each route's rows, whose smaller GEMMs may differ from a
        per-example run in the last bits (spec §2.3)."""
        experts = list(self.experts.values())
        if bool((expert_ids == expert_ids[0]).all()):
            return experts[int(expert_ids[0])](inputs)
        outputs = torch.empty_like(inputs)
        for expert_id in expert_ids.unique().tolist():
            rows = (expert_ids == expert_id).nonzero().squeeze(1)
            outputs = outputs.index_copy(0, rows, experts[expert_id](inputs[rows]))
        return outputs


def feed_forward(mlp: nn.Module, hidden_states, task_ids, route_weights) -> torch.Tensor:
    """A decoder layer's FFN: the routed MoTE FFN, or the dense FFN of a layer outside `mote_layers`."""
    if isinstance(mlp, MoteFeedForward):
        return mlp(hidden_states, task_ids=task_ids, route_weights=route_weights)
    return mlp(hidden_states)


# --- routing: task ids, the sample router, the auxiliary loss -----------------------------------------------------


def check_task_ids(config, task_ids, batch_size: int, device) -> torch.LongTensor:
    """`task_ids` as a LongTensor `(batch_size,)` of valid route ids; `None` becomes the default route."""
    names = config.mote_expert_names
    routes = ", ".join(f"{index}={name}" for index, name in enumerate(names))
    if task_ids is None:
        if config.mote_default_route is None:
            raise ValueError(
                f"task_ids is required: pass one route id per example, a LongTensor of shape ({batch_size},) with "
                f"ids for the experts ({routes}), or set config.mote_default_route"
            )
        return torch.full((batch_size,), names.index(config.mote_default_route), dtype=torch.long, device=device)
    if not torch.is_tensor(task_ids) or task_ids.is_floating_point() or task_ids.dtype == torch.bool:
        raise ValueError(f"task_ids must be an integer tensor of route ids, got {task_ids!r}")
    if tuple(task_ids.shape) != (batch_size,):
        raise ValueError(
            f"task_ids must hold one route id per example, shape ({batch_size},); got shape {tuple(task_ids.shape)}"
        )
    unknown = task_ids[(task_ids < 0) | (task_ids >= len(names))]
    if unknown.numel():
        raise ValueError(
            f"task_ids {sorted(set(unknown.tolist()))} are not routes of this model ({routes}); look ids up by name "
            "with model.route_id(name)"
        )
    return task_ids.to(device=device, dtype=torch.long)


def starts_a_sequence(cache: Cache | None) -> bool:
    """Whether a forward starts a sequence (its prefill): no KV cache, or one that holds no tokens yet. A cache with
    tokens continues a sequence whose routes and media were fixed at its prefill."""
    return cache is None or cache.get_seq_length() == 0


def warn_of_placeholders_without_media(input_ids, cache, token_id: int, kind: str, missing: str, inputs: str) -> None:
    """Warn when a sequence starts with `kind` placeholders in `input_ids` but no media to put in their place: the
    placeholder's own embedding then stands in for it, which is what a forgotten `pixel_values` looks like. A warning,
    not an error: a text-only forward over any token ids is valid for transformers' VLMs (their common tests run
    them). Later decoding steps carry no media."""
    if input_ids is None or not starts_a_sequence(cache):
        return
    placeholders = int((input_ids == token_id).sum())
    if placeholders:
        logger.warning(
            f"the text has {placeholders} {kind} placeholders ({kind}_token_id={token_id}) but {missing}: their own "
            f"embeddings stand in for the {kind}. To use the {kind}, pass {inputs}"
        )


def masked_mean(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, S, D) -> (B, D) fp32 mean over the positions where `mask` (B, S) is set (all positions if None)."""
    if mask is None:
        return hidden_states.float().mean(1)
    weights = mask.to(device=hidden_states.device, dtype=torch.float32)[..., None]
    return (hidden_states.float() * weights).sum(1) / weights.sum(1).clamp(min=1)


def prompt_mask(attention_mask: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    """(B, S) positions the sample router pools in training: the non-padding positions before the first supervised
    label (the prompt; at inference the sample router pools the prefill). Rows without labels keep every position."""
    supervised = labels != -100
    first = torch.where(supervised.any(1), supervised.int().argmax(1), labels.shape[1])
    mask = torch.arange(labels.shape[1], device=labels.device)[None] < first[:, None]
    return mask if attention_mask is None else mask & attention_mask.bool()


def wants_router_logits(config, labels, output_router_logits: bool | None) -> bool:
    """Learned-router ablations return their router logits (for the auxiliary loss) whenever there are labels."""
    if output_router_logits is not None:
        return output_router_logits
    return labels is not None and bool(config.mote_expert_names) and config.mote_routing_mode in LEARNED_ROUTING_MODES


def sample_routing_mask(config, attention_mask, labels, routing_mask) -> torch.Tensor | None:
    """The positions the sample router pools: `routing_mask` when given (generation passes the prompt's), only the
    prompt in training (`labels` given), otherwise the text model's default (the attention mask)."""
    if routing_mask is not None or labels is None or config.mote_routing_mode != "sample_top1":
        return routing_mask
    return prompt_mask(attention_mask, labels)


def check_checkpointing(text_model) -> None:
    """Refuse reentrant activation checkpointing while training a learned router (spec §2.5). Reentrant
    checkpointing takes a decoder layer's positional input (the hidden states) as its only input and runs the
    layer's first pass without gradients: the sample router's `route_weights`, a keyword argument of every layer,
    would be back-propagated once per layer (a crash in the second layer's backward), and the token routers' logits,
    recorded in that first pass for the load-balancing loss, would carry no gradient (their loss silently untrained).
    Non-reentrant checkpointing, transformers' default, has neither problem."""
    mode = text_model.config.mote_routing_mode
    if mode in LEARNED_ROUTING_MODES and checkpoints_reentrantly(text_model):
        raise ValueError(
            f"routing mode {mode!r} cannot train its learned router under reentrant activation checkpointing (the "
            "sample router's weights enter every checkpointed layer; the token routers' logits for the load-balancing "
            "loss come from the pass without gradients): enable checkpointing with its default, "
            "model.activation_checkpointing_enable(), or activation_checkpointing_kwargs={'use_reentrant': False}"
        )


def with_aux_loss(config, loss, aux_loss):
    """The LM loss plus the weighted load-balancing loss, when there are both."""
    if loss is None or aux_loss is None:
        return loss
    return loss + config.mote_router_aux_loss_coef * aux_loss.to(loss.device)


def router_aux_loss(config, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Switch load balancing `M * sum_m f_m P_m` over the learned routers' logits, padding tokens excluded; `None`
    without a learned router."""
    if not router_logits:
        return None
    valid = attention_mask.reshape(-1).bool() if attention_mask is not None and attention_mask.ndim == 2 else None
    # Token routers see every (example, position) row; the sample router one row per example.
    logits = [x[valid.to(x.device)] if valid is not None and x.shape[0] == valid.numel() else x for x in router_logits]
    return load_balancing_loss(logits, num_experts=len(config.mote_expert_names), top_k=1)


# --- model-level API: expert management and parameter accounting (spec §2.8, §3.3-3.6) ----------------------------


class MoteExpertsMixin:
    """Expert management and accounting for every MoTE model, placed before its `PreTrainedModel` base.

    Every operation acts on all MoTE layers at once and keeps the text config's registry (`mote_expert_names`,
    `mote_expert_descriptions`) in sync, so that `save_pretrained` / `from_pretrained` round-trips the experts.
    Experts are addressed by name: route ids shift when an expert is removed.
    """

    def _init_weights(self, module: nn.Module):
        if not init_moe_module(module, self.config.get_text_config().initializer_range):
            super()._init_weights(module)

    @property
    def mote_config(self):
        """The text config holding the MoTE fields."""
        return self.config.get_text_config()

    def mote_layers(self) -> list[tuple[int, MoteFeedForward]]:
        """(decoder layer index, its MoTE FFN) for every layer with task experts."""
        return [
            (index, layer.mlp)
            for index, layer in enumerate(self.get_decoder().layers)
            if isinstance(layer.mlp, MoteFeedForward)
        ]

    def route_id(self, name: str) -> int:
        """The `task_ids` value that selects expert `name`."""
        return self.mote_config.mote_route_id(name)

    def add_expert(
        self,
        name: str,
        init_from: str = "dense",
        dense_source: PreTrainedModel | None = None,
        description: str | None = None,
    ) -> int:
        """Add expert `name` to every MoTE layer (spec §3.3) and return its route id (the next one).

        Args:
            init_from: `"dense"` copies each layer's FFN from `dense_source`; `"shared"` copies the shared expert; the
                name of an existing expert copies that expert (in GLM-OCR-MoTE, `"ocr"` equals the dense FFN).
            dense_source: the dense model the MoTE model was converted from (`config.mote_base_model`), loaded, e.g.
                `LlamaForCausalLM.from_pretrained(...)`; needed for `init_from="dense"`.
            description: the expert's description for the prompt route selector.
        """
        config = self._require_expert_management()
        check_expert_name(name, config.mote_expert_names)
        layers = self.mote_layers()
        sources = self._expert_sources(init_from, dense_source, layers)
        for (_, ffn), source in zip(layers, sources):
            expert = ffn.build_expert()
            expert.load_state_dict(source.state_dict())
            ffn.experts[name] = expert
        config.add_mote_expert(name, description)
        return config.mote_route_id(name)

    def remove_expert(self, name: str, force: bool = False) -> None:
        """Delete expert `name` from every layer (spec §3.4). The other experts keep their weights; those after it
        move down one route id. Removing the default route needs `force=True`; the last expert cannot be removed."""
        config = self._require_expert_management()
        config.remove_mote_expert(name, force=force)
        for _, ffn in self.mote_layers():
            del ffn.experts[name]

    def swap_experts(self, first: str, second: str) -> None:
        """Exchange the weights of two experts in every layer, keeping names, route ids and descriptions (the
        offline swap diagnostic of spec §3.5). Swapping again restores the model."""
        config = self._require_expert_management()
        config.mote_route_id(first)
        config.mote_route_id(second)
        if first == second:
            raise ValueError(f"swap_experts needs two different experts, got {first!r} twice")
        for _, ffn in self.mote_layers():
            ffn.experts[first], ffn.experts[second] = ffn.experts[second], ffn.experts[first]

    def freeze_for_expert_addition(self, name: str) -> list[nn.Parameter]:
        """Freeze every parameter except those of expert `name` in every layer, and return those (to build the
        optimizer from): the other routes then stay bit-identical while `name` trains (spec §3.3)."""
        return self.freeze_all_but_experts([name])

    def freeze_all_but_experts(self, names: list[str]) -> list[nn.Parameter]:
        """Freeze every parameter except those of the experts `names` in every layer (the shared expert, attention
        and embeddings included), and return those: the routes of the other experts stay bit-identical while these
        train, as GLM-OCR-MoTE's `kie` does with `ocr` (spec §7.1, §7.4, A18)."""
        for name in names:
            self.route_id(name)
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        trainable = [
            parameter for _, ffn in self.mote_layers() for name in names for parameter in ffn.experts[name].parameters()
        ]
        for parameter in trainable:
            parameter.requires_grad_(True)
        return trainable

    def set_routing_mode(self, mode: str) -> None:
        """Switch between MoTE's `task` routing and the ablations of spec §2.5. Learned routers are created
        (randomly initialised) when their mode is entered and deleted when it is left."""
        config = self.mote_config
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {', '.join(map(repr, ROUTING_MODES))}")
        if not config.mote_expert_names:
            raise ValueError("this model has no task experts (mote_expert_names is empty): convert it to MoTE first")
        reference = next(self.parameters())
        std = config.initializer_range

        def new_router(wanted: bool) -> TopKRouter | None:
            if not wanted:
                return None
            router = top1_router(config).to(device=reference.device, dtype=reference.dtype)
            init_moe_module(router, std)
            return router

        for _, ffn in self.mote_layers():
            ffn.routing_mode = mode
            if (ffn.router is not None) != (mode == "token_top1"):
                ffn.router = new_router(mode == "token_top1")
        for module in self.modules():
            if isinstance(module, MoteTextModelMixin) and (module.sample_router is not None) != (mode == "sample_top1"):
                module.sample_router = new_router(mode == "sample_top1")
        config.mote_routing_mode = mode

    def num_parameters_mote(self, active: bool = True, k: int = 1) -> int:
        """The language model's parameters as the paper counts them (spec §3.6, A.1): embeddings, decoder layers,
        final norm and LM head (tied weights once); not the vision tower or projector. `active=True` counts the
        parameters one example uses: the shared expert and `k` routed experts per layer (all of them in `dense`
        mode): `P_dense + (k + S - 1) * P_FFN` for a copy conversion."""
        modules = [self.get_decoder(), self.get_output_embeddings()]
        parameters = {id(p): p for module in modules if module is not None for p in module.parameters()}
        total = sum(p.numel() for p in parameters.values())
        return total - self._inactive_expert_parameters(k) if active else total

    def active_parameter_count(self) -> int:
        """Parameters of the whole model used for one example (one routed expert per layer); what
        `moezoo.modeling.moe.count_parameters` reports as active."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        return total - self._inactive_expert_parameters(1)

    def _inactive_expert_parameters(self, k: int) -> int:
        inactive = 0
        for _, ffn in self.mote_layers():
            experts = list(ffn.experts.values())
            if not isinstance(k, int) or not 1 <= k <= len(experts):
                raise ValueError(f"k (routed experts per example) must be in [1, {len(experts)}], got {k!r}")
            used = len(experts) if ffn.routing_mode == "dense" else k
            inactive += (len(experts) - used) * sum(p.numel() for p in experts[0].parameters())
        return inactive

    def _require_expert_management(self):
        config = self.mote_config
        if not config.mote_expert_names:
            raise ValueError("this model has no task experts (mote_expert_names is empty): convert it to MoTE first")
        if config.mote_routing_mode in LEARNED_ROUTING_MODES:
            raise ValueError(
                f"experts cannot be added, removed or swapped in routing mode {config.mote_routing_mode!r}: its "
                "learned router has one output per expert; call set_routing_mode('task') first"
            )
        return config

    def _expert_sources(self, init_from: str, dense_source, layers) -> list[nn.Module]:
        """The module each layer's new expert copies."""
        config = self.mote_config
        if init_from in config.mote_expert_names:
            return [ffn.experts[init_from] for _, ffn in layers]
        if init_from == "shared":
            if config.mote_num_shared_experts == 0:
                raise ValueError(
                    "init_from='shared' needs a shared expert; this model has none (mote_num_shared_experts=0)"
                )
            return [ffn.shared_expert for _, ffn in layers]
        if init_from != "dense":
            raise ValueError(
                f"init_from={init_from!r} must be 'dense', 'shared' or an existing expert ({config.mote_expert_names})"
            )
        if dense_source is None:
            raise ValueError(
                "init_from='dense' copies the dense FFNs of the base model, which a MoTE checkpoint does not store: "
                f"pass dense_source=<the loaded base model> (config.mote_base_model: {config.mote_base_model!r}), "
                "or init_from='shared' or an existing expert's name"
            )
        if config.mote_expert_config() is not config:
            raise ValueError(
                f"init_from='dense' needs experts as wide as the dense FFN, but this model's experts have "
                f"{config.mote_expert_intermediate_size} of {config.intermediate_size} units (split construction); "
                "copy an existing expert instead"
            )
        dense_layers = dense_source.get_decoder().layers
        if len(dense_layers) != len(self.get_decoder().layers):
            raise ValueError(
                f"dense_source has {len(dense_layers)} decoder layers, this model {len(self.get_decoder().layers)}: "
                "pass the model this one was converted from"
            )
        return [dense_layers[index].mlp for index, _ in layers]


# --- generation: one route per sequence, with or without a KV cache ----------------------------------------------


class MoteGenerationMixin:
    """`generate` for the MoTE LM heads, placed before their `GenerationMixin`: a sequence keeps the route chosen on
    its prompt (spec §2.5, A20).

    With a KV cache the routes travel with the cache. Without one every step re-runs the whole sequence, and the
    `sample_top1` router would pool the generated tokens too and could switch routes mid-sequence; so those steps
    pass `routing_mask`, the prompt's positions: the attention mask with the generated tokens left out. `generate`
    drops an all-ones attention mask, so the generated tokens are counted rather than masked from the first step.
    """

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        model_kwargs["num_generated_tokens"] = model_kwargs.get("num_generated_tokens", 0) + num_new_tokens
        return model_kwargs

    def prepare_inputs_for_generation(
        self, input_ids, attention_mask=None, inputs_embeds=None, num_generated_tokens: int = 0, **kwargs
    ):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
        )
        if num_generated_tokens and model_inputs.get("cache") is None:
            prompt = torch.ones_like(input_ids) if attention_mask is None else attention_mask.clone()
            prompt[:, -num_generated_tokens:] = 0
            model_inputs["routing_mask"] = prompt
        return model_inputs


# --- the routed text models: route resolution shared by the Llama and GLM decoders ---------------------------------


class MoteTextModelMixin:
    """Route resolution of a MoTE decoder, placed before the transformers text model whose forward it wraps.

    It embeds the tokens, resolves the routes (spec §2.3-2.5), runs the transformers decoder with `task_ids` and
    `route_weights` passed to every layer, and keeps the routes with the returned KV cache so that decoding steps
    continue on the prefill's routes.
    """

    sample_router: TopKRouter | None

    def _init_sample_router(self, config) -> None:
        # `sample_top1`: one global router on the mean embedding of each example's prompt (spec §2.5, A9).
        wanted = bool(config.mote_expert_names) and config.mote_routing_mode == "sample_top1"
        self.sample_router = top1_router(config) if wanted else None

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch_size,)`, *optional*): the route (expert index into
            `config.mote_expert_names`) of each example; default: the routes of the sequence a KV cache continues,
            else `config.mote_default_route`. Used in routing mode `task`; the ablation modes choose their own routes.
        routing_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): the positions the
            `sample_top1` router averages (default: `attention_mask`); the LM heads pass each prompt's positions.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_checkpointing(self)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # A cache that already holds tokens continues a sequence, whose routes were fixed at its prefill.
        kept = None if starts_a_sequence(cache) else getattr(cache, "mote_routes", None)
        routes, sample_router_logits = self.resolve_routes(
            task_ids, inputs_embeds, attention_mask if routing_mask is None else routing_mask, kept
        )
        outputs = super().forward(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            task_ids=None if routes is None else routes.task_ids,
            route_weights=None if routes is None else routes.route_weights,
            **kwargs,
        )
        if routes is not None and outputs.cache is not None and kept is None:
            outputs.cache.mote_routes = routes
        router_logits = outputs.get("router_logits")
        if router_logits is not None and sample_router_logits is not None:
            # The sample router runs before the decoder, outside the hooks that record the token routers' logits.
            router_logits = (sample_router_logits, *router_logits)
        return MoeModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=router_logits,
        )

    def resolve_routes(
        self, task_ids, inputs_embeds: torch.Tensor, routing_mask: torch.Tensor | None, kept: MoteRoutes | None
    ) -> tuple[MoteRoutes | None, torch.Tensor | None]:
        """The routes of the batch (`kept`, those of the sequence a KV cache continues, if any) and, for a new
        `sample_top1` decision, the sample router's logits. `None` routes in the modes that need none (`dense`,
        `token_top1`, or a model without experts). A continued sequence keeps its routes: `task_ids` may then be
        left out, and must equal them when given."""
        config = self.config
        if not config.mote_expert_names or config.mote_routing_mode in ("dense", "token_top1"):
            return None, None
        if config.mote_routing_mode == "sample_top1":
            if kept is not None:
                return kept, None
            router_logits, weights, expert_ids = self.sample_router(masked_mean(inputs_embeds, routing_mask))
            return MoteRoutes(expert_ids[:, 0], weights[:, 0]), router_logits
        if kept is not None and task_ids is None:
            return kept, None
        task_ids = check_task_ids(config, task_ids, inputs_embeds.shape[0], inputs_embeds.device)
        if kept is not None and not torch.equal(kept.task_ids, task_ids):
            raise ValueError(
                f"task_ids {task_ids.tolist()} differ from the routes {kept.task_ids.tolist()} this KV cache was built "
                "with: a route is fixed for a whole sequence (spec A20); start a new cache to change it"
            )
        return MoteRoutes(task_ids), None


# What `output_router_logits=True` records in the text models: each token router's logits (its first output).
ROUTER_LOGITS = OutputRecorder(TopKRouter, index=0)


# --- Llama (text-only LlamaMote, and VideoLLM-MoTE's decoder) ------------------------------------------------------


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
    """`LlamaModel` with MoTE decoder layers; `forward` adds `task_ids` (see `MoteTextModelMixin.forward`)."""

    def __init__(self, config: LlamaMoteConfig):
        # Not LlamaModel.__init__, which would build dense decoder layers; the forward is LlamaModel's.
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LlamaMoteDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self._init_sample_router(config)
        self.post_init()


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
        aux_loss = router_aux_loss(self.config, outputs.router_logits, attention_mask) if output_router_logits else None
        return MoeCausalLMOutputWithPast(
            loss=with_aux_loss(self.config, loss, aux_loss),
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


# --- VideoLLM-MoTE: SigLIP frames -> projector -> LlamaMote (spec §2.7) --------------------------------------------


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


class VideoLlmMotePreTrainedModel(MoteExpertsMixin, PreTrainedModel):
    config: VideoLlmMoteConfig
    base_model_prefix = "model"
    input_modalities = ("video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoteDecoderLayer", "SiglipEncoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False


class VideoLlmMoteModel(VideoLlmMotePreTrainedModel):
    """The vision tower, the projector and the MoTE decoder, without the LM head."""

    def __init__(self, config: VideoLlmMoteConfig):
        super().__init__(config)
        self.vision_tower = SiglipVisionModel._from_config(config.vision_config)
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
        return MoteMultimodalModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            video_outputs=video_outputs,
        )


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
        aux_loss = router_aux_loss(text_config, outputs.router_logits, attention_mask) if output_router_logits else None
        return MoteMultimodalCausalLMOutputWithPast(
            loss=with_aux_loss(text_config, loss, aux_loss),
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            video_outputs=outputs.video_outputs,
            router_logits=outputs.router_logits,
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


# --- GLM-OCR-MoTE: GLM-OCR with a MoTE decoder (spec §2.6) -------------------------------------------------------


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
    """`GlmOcrTextModel` with MoTE decoder layers; `forward` adds `task_ids` (see `MoteTextModelMixin.forward`)."""

    config: GlmOcrMoteTextConfig
    _can_record_outputs = {**GlmOcrTextModel._can_record_outputs, "router_logits": ROUTER_LOGITS}

    def __init__(self, config: GlmOcrMoteTextConfig):
        # Not GlmOcrTextModel.__init__, which would build dense decoder layers; the forward is GlmOcrTextModel's.
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [GlmOcrMoteTextDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = GlmOcrRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GlmOcrTextRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self._init_sample_router(config)
        self.post_init()


class GlmOcrMoteModel(GlmOcrMotePreTrainedModel, GlmOcrModel):
    """`GlmOcrModel` (CogViT vision tower and merger, unchanged) with the MoTE decoder."""

    def __init__(self, config: GlmOcrMoteConfig):
        PreTrainedModel.__init__(self, config)
        self.visual = GlmOcrVisionModel._from_config(config.vision_config)
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
        return MoteMultimodalModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_outputs=mm_encoder_outputs.get("image"),
            video_outputs=mm_encoder_outputs.get("video"),
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
        aux_loss = router_aux_loss(text_config, outputs.router_logits, attention_mask) if output_router_logits else None
        return MoteMultimodalCausalLMOutputWithPast(
            loss=with_aux_loss(text_config, loss, aux_loss),
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            image_outputs=outputs.image_outputs,
            video_outputs=outputs.video_outputs,
            router_logits=outputs.router_logits,
        )
