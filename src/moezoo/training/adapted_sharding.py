"""`--fsdp` / `--ep` for recipes that change the model after loading it: PEFT's LoRA adapters and trainable token
rows, the expert adapters (`expert_lora`: parametrizations of the fused expert weights), the trainable parameters
they add.

transformers shards a model inside `from_pretrained(distributed_config=...)`, before the weights are read, so what a
recipe adds afterwards would sit beside the shards: FSDP2 would neither shard nor reduce it, and a parametrization
registered on a sharded weight would read the shard. Here the same machinery runs in another order, on a model loaded
whole on every process:

1. the experts are split as the model's EP plan says (transformers' `apply_expert_parallelism`: each process keeps
   its contiguous range of the experts it loaded, and gets the token exchange);
2. the recipe adapts the model (`adapt`);
3. FSDP2 shards what the model's FSDP plan names (transformers' `apply_fully_sharded_data_parallelism`), adapters
   included. Modules the recipe added inside an experts module (the expert adapters) become FSDP2 units of the
   dense mesh first: they are replicated per process, not split by expert, so their gradients, like the dense ones,
   are averaged over every process (the experts' own gradients are reduced over the expert-sharding group only).
   0-d parameters (MoE-ViE's `logit_scale`, OmniMoE-VL's `fusion_output_scale`), which FSDP2 cannot shard, stay
   whole (`parameters_set_aside`): a model that holds them shards through here even with nothing to adapt. The
   recipes adapt fused experts with the expert adapters, not PEFT's `target_parameters`, whose update, built for all
   the experts at once, would meet expert weights split over the processes under EP.

The cost: each process reads the whole model once before the shards are cut (a sharded load reads its shard only).
At the end `unsharded_copy` gathers the trained weights into an unsharded model of the same recipe on every process,
which the commands merge and save as they do after a single-process run.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism

from .distributed import check_shardable, distributed_config, load_for_training


def load_adapted_for_training(model_class: type[PreTrainedModel], folder: str | Path,
                              adapt: Callable[[PreTrainedModel], nn.Module] | None, fsdp: int = 1, ep: int = 1,
                              ep_implementation: str = "auto", root_held: tuple[str, ...] = (),
                              kept_whole: tuple[str, ...] = (), **kwargs) -> nn.Module:  # fmt: skip
    """`adapt(model_class.from_pretrained(folder, **kwargs))`, sharded as `--fsdp` / `--ep` ask (checked as
    `load_for_training` checks them) with what `adapt` added (see the module docstring and `shard_adapted` for
    `root_held` and `kept_whole`). `adapt` returns the model to train (a PEFT model wrapping the one it was given, or
    that model); None adapts nothing, for a model whose 0-d parameters keep it from transformers' sharded loading."""
    adapt = adapt or (lambda model: model)
    # Checkpoints are not refused (`distributed_config`'s save_steps): the trainers of these recipes write them with
    # `ShardedCheckpointsMixin`.
    parallelism = distributed_config(fsdp, ep, ep_implementation=ep_implementation)
    if parallelism is not None:  # before any weight is read, as `load_for_training` checks a sharded load
        check_shardable(model_class, model_class.config_class.from_pretrained(folder), ep, replicated_scalars=True)
    model = load_for_training(model_class, folder, **kwargs)
    if parallelism is None:
        return adapt(model)
    return shard_adapted(model, adapt, parallelism, root_held, kept_whole)


def shard_adapted(model: PreTrainedModel, adapt: Callable[[PreTrainedModel], nn.Module],
                  parallelism: DistributedConfig, root_held: tuple[str, ...] = (),
                  kept_whole: tuple[str, ...] = ()) -> nn.Module:  # fmt: skip
    """
    Steps 1-3 of the module docstring on `model`, loaded whole on every process. Marks the model as transformers'
    `maybe_distribute_model` does, so that the Trainer neither wraps it in DDP nor shards it again.

    `root_held` names modules that not every process runs at every forward, e.g. a vision tower on a batch of texts:
    FSDP2 units of their own would gather and reduce on some processes only, and the collectives of the processes
    would no longer match. They are left to the root unit instead, which gathers them at every forward whether they
    run or not; `with_every_trainable_parameter` then gives their parameters a gradient on every process.

    `kept_whole` names modules (a component of their qualified names, e.g. "efficiency_head") whose parameters stay
    whole on every process, outside FSDP2, as 0-d parameters do (`parameters_set_aside`): parameters whose gradients
    reach them by another way than their FSDP2 unit's output (MoEMB's GRPO efficiency heads, read through the gates'
    record of log-probabilities), which FSDP2, whose backward hooks sit on its units' inputs and outputs, would never
    reduce. The Trainer averages their gradients over the processes after every backward instead, which needs them to
    have a gradient on every process at every backward.
    """
    parallelism, _, mesh = type(model).prepare_distribute_model(parallelism)
    model.config.distributed_config = parallelism
    model._mesh_manager = mesh
    model._device_mesh = mesh.get_mesh(("pp", "fsdp", "tp"))
    model._is_distributed_loading_by_transformers = True
    model._tp_size, model._fsdp_size = parallelism.tp_size, parallelism.fsdp_size
    _, ep_plan, fsdp_plan = model._resolve_parallel_plans(parallelism)
    fsdp_plan = {
        name: style
        for name, style in fsdp_plan.items()
        if not any(name == held or name.startswith(f"{held}.") for held in root_held)
    }
    if parallelism.ep_size > 1:
        apply_expert_parallelism(model, mesh.get_mesh("ep"), mesh.get_mesh("tp"), ep_plan,
                                 ep_implementation=parallelism.ep_implementation)  # fmt: skip
    adapted = adapt(model)
    dense_mesh = mesh.get_mesh("fsdp")
    for name, style in ep_plan.items():
        if style != "ep_dispatch_experts":
            continue
        experts = model.get_submodule(name)
        for module in experts.modules():
            own = list(module.parameters(recurse=False))
            # not the experts' own (split) weights, wherever a parametrization moved them
            added = module is not experts and not any(isinstance(parameter, DTensor) for parameter in own)
            if added and any(parameter.requires_grad for parameter in own):
                fully_shard(module, mesh=dense_mesh, reshard_after_forward=True)
    whole = [name for name, parameter in model.named_parameters()
             if parameter.dim() == 0 or any(part in kept_whole for part in name.split("."))]  # fmt: skip
    with parameters_set_aside(model, whole):
        apply_fully_sharded_data_parallelism(model, mesh, fsdp_plan, ep_plan)
    return adapted


@contextmanager
def parameters_set_aside(model: nn.Module, names: list[str]):
    """
    The parameters `names` of `model` taken out of their modules for the duration, then put back: FSDP2's
    `fully_shard` shards every parameter on dim 0 and refuses 0-d ones (MoE-ViE's `logit_scale`). Its
    `ignored_params` would leave them out, but transformers' FSDP2 pass takes none, and their names are part of the
    checkpoint format. Set aside while that pass runs, they stay whole on every process, outside FSDP2, as PEFT
    adapters attached after sharding do; the Trainer broadcasts such parameters at the start and averages their
    gradients over the processes (`Trainer._sync_replicated_trainable_parameters`).
    """
    owners = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in names]
    parameters = [module._parameters.pop(attribute) for module, attribute in owners]
    try:
        yield
    finally:
        for (module, attribute), parameter in zip(owners, parameters):
            module._parameters[attribute] = parameter


def unsharded_copy(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` (the unsharded model of the same recipe: loaded and adapted again) holding the weights of the
    sharded `model`, on every process. A collective: every process calls it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    copy = build()
    copy.load_state_dict(state)
    return copy


def with_every_trainable_parameter(loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """`loss`, plus zero times every trainable parameter that the root FSDP2 unit of a sharded `model` holds (see
    `shard_adapted`'s `root_held`), so that each has a gradient on every process and FSDP2 reduces the same tensors
    everywhere, even where a module did not run. The value and the other gradients are unchanged. Between the
    forward and the backward the root unit's parameters are gathered (plain tensors) and those of the other units
    are shards (DTensors), which are left alone. `loss` as it is for an unsharded model."""
    if not getattr(model, "is_distributed_loading_by_transformers", False):
        return loss
    held = [parameter for parameter in model.parameters()
            if parameter.requires_grad and not isinstance(parameter, DTensor)]  # fmt: skip
    return loss + 0 * sum(parameter.sum() for parameter in held)
