"""What the MoTE families share: the task-expert FFN, route resolution, expert management, generation with the
prompt's routes, and the output dataclasses (spec mote.md §2-3).

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
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    MoeModelOutputWithPast,
    MultimodalBaseModelOutputWithPast,
    MultimodalCausalLMOutputWithPast,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ...configuration.mote import LEARNED_ROUTING_MODES, ROUTING_MODES, check_expert_name
from ..moe.initialization import init_moe_module
from ..moe.losses import load_balancing_loss
from ..moe.pretrained import WithoutFusedExpertsMixin, checkpoints_reentrantly
from ..moe.router import TopKRouter
from ..moe.spec import MoeLayerSpec


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


def router_aux_loss(config, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Switch load balancing `M * sum_m f_m P_m` over the learned routers' logits, padding tokens excluded; `None`
    without a learned router."""
    if not router_logits:
        return None
    valid = attention_mask.reshape(-1).bool() if attention_mask is not None and attention_mask.ndim == 2 else None
    # Token routers see every (example, position) row; the sample router one row per example.
    logits = [x[valid.to(x.device)] if valid is not None and x.shape[0] == valid.numel() else x for x in router_logits]
    return load_balancing_loss(logits, num_experts=len(config.mote_expert_names), top_k=1)


def causal_lm_output(output_class, config, outputs, logits, loss, attention_mask, output_router_logits: bool):
    """What a MoTE LM head returns: its base model's `outputs` (all but `last_hidden_state`, which the head turned
    into `logits`) with the logits and the losses. With `output_router_logits` the learned routers' load-balancing
    loss is `aux_loss`, and is added to the LM `loss` times `mote_router_aux_loss_coef`."""
    aux_loss = router_aux_loss(config, outputs.router_logits, attention_mask) if output_router_logits else None
    if loss is not None and aux_loss is not None:
        loss = loss + config.mote_router_aux_loss_coef * aux_loss.to(loss.device)
    carried = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    return output_class(loss=loss, aux_loss=aux_loss, logits=logits, **carried)


# --- model-level API: expert management and parameter accounting (spec §2.8, §3.3-3.6) ----------------------------


class MoteExpertsMixin(WithoutFusedExpertsMixin):
    """Expert management and accounting for every MoTE model, placed before its `PreTrainedModel` base. Its task
    experts are whole FFNs, which no experts implementation runs: `WithoutFusedExpertsMixin` lets it take any.

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


# --- the routed text models: the Llama and GLM decoders with their route resolution ----------------------------------


class MoteTextModelMixin:
    """The MoTE decoder of a family, placed before the transformers text model whose forward it wraps.

    `__init__` builds the text model with the family's MoTE decoder layers and, in `sample_top1` mode, the sample
    router. `forward` embeds the tokens, resolves the routes (spec §2.3-2.5), runs the transformers decoder with
    `task_ids` and `route_weights` passed to every layer, and keeps the routes with the returned KV cache so that
    decoding steps continue on the prefill's routes.
    """

    # The family's modules, set by each text model: its MoTE decoder layer, final RMSNorm and rotary embedding.
    decoder_layer_class: type[nn.Module]
    norm_class: type[nn.Module]
    rotary_embedding_class: type[nn.Module]

    def __init__(self, config):
        # The modules of the transformers text model, built here rather than by its `__init__`, which would build
        # dense decoder layers; its forward runs them (called by `forward` below).
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_embedding_class(config=config)
        self.gradient_checkpointing = False
        # `sample_top1`: one global router on the mean embedding of each example's prompt (spec §2.5, A9).
        wants_sample_router = bool(config.mote_expert_names) and config.mote_routing_mode == "sample_top1"
        self.sample_router = top1_router(config) if wants_sample_router else None
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
