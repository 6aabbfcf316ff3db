"""Low-rank adapters of the fused routed experts, as parametrizations of their 3D weights.

PEFT's `LoraConfig(target_parameters=...)` adapts a fused expert weight with one update built for all E experts, which
cannot act on the weight that expert parallelism (`--ep`) splits over processes as a DTensor. `GroupedExpertLoRA` is
a parametrization of the fused weight instead: one (A, B) pair per group of consecutive experts (per expert with E
groups, what `target_parameters` does; one shared by all experts with one group, Megatron's LoRA on grouped experts),
and under `--ep` each process adds the deltas of its own expert range to its local shard. The same adapters run on
one process, so an `--ep` run equals the one-process run.

PEFT does not know these parametrizations: `ExpertLoraModel` (a `PeftModel`) writes them to
`expert_lora.safetensors` beside PEFT's files and reads them back in `load_adapter` (what `from_pretrained` and the
Trainer's `resume_from_checkpoint` call), registering them on a fresh base model too. `merge_lora` folds PEFT's
adapters, then the expert adapters, into the weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from peft.utils.constants import DUMMY_TARGET_MODULES
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

from ..modeling.moe.experts import GeluExperts, SwiGLUExperts
from .arguments import PeftModelWithTrainedBase

EXPERT_LORA_FILE = "expert_lora.safetensors"
# The adapted weights of each fused experts class (transformers' Qwen experts: the SMoES hosts'), all `(E, out, in)`;
# the GELU experts' biases stay untouched.
EXPERT_WEIGHTS = {
    SwiGLUExperts: ("gate_up_proj", "down_proj"),
    GeluExperts: ("up_proj", "down_proj"),
    Qwen3_5MoeExperts: ("gate_up_proj", "down_proj"),
    Qwen3VLMoeTextExperts: ("gate_up_proj", "down_proj"),
}


class GroupedExpertLoRA(nn.Module):
    """A parametrization of fused expert weights `W (E, out, in)`: `W_e + (alpha / r) B_g A_g` for every expert `e`
    of group `g` (`num_groups` runs of consecutive experts). With one group, a single adapter serves all experts of
    the layer, as Megatron's LoRA on grouped experts does (spec A-3). `A` starts Kaiming-uniform and `B` at zero, as
    PEFT's, so the model is unchanged at initialisation; every experts implementation reads the adapted weight."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: int, num_groups: int):
        super().__init__()
        num_experts, out_features, in_features = weight.shape
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"expert LoRA groups must divide the {num_experts} experts, got {num_groups}")
        self.num_groups = num_groups
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(num_groups, rank, in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(
            torch.zeros(num_groups, out_features, rank, dtype=weight.dtype, device=weight.device)
        )
        for matrix in self.lora_A:
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        delta = self.scaling * (self.lora_B @ self.lora_A)  # (G, out, in)
        if isinstance(weight, DTensor):
            # Expert parallelism (`--ep`): this process holds a contiguous range of the experts, whose groups' deltas
            # it adds to its own shard; the experts run on that shard.
            (mesh_dim,) = [dim for dim, placement in enumerate(weight.placements) if placement.is_shard(0)]
            rank, num_experts = weight.device_mesh.get_local_rank(mesh_dim), weight.shape[0]
            local = weight.to_local()
            experts = torch.arange(rank * len(local), (rank + 1) * len(local), device=local.device)
            return local + delta[experts * self.num_groups // num_experts]
        # Broadcast over the experts of each group without copying the delta per expert.
        return (weight.unflatten(0, (self.num_groups, -1)) + delta[:, None]).flatten(0, 1)


def adapted_weights(module: nn.Module) -> tuple[str, ...]:
    """The weights of `module` that expert adapters adapt: none unless it is a fused experts class (a parametrized
    module is an instance of a subclass of its class)."""
    return next((names for cls, names in EXPERT_WEIGHTS.items() if isinstance(module, cls)), ())


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules of a model (those `EXPERT_WEIGHTS` names), by module name."""
    return {name: module for name, module in model.named_modules() if adapted_weights(module)}


def add_expert_adapters(
    model: nn.Module, rank: int, alpha: int, groups: int | None = None, weights: list[str] | None = None
) -> dict[str, GroupedExpertLoRA]:
    """Register a `GroupedExpertLoRA` on the fused expert `weights` of `model` (parameter names,
    `<experts module>.<weight name>`; default: every adapted weight of its fused experts), `groups` per weight
    (default: one per expert). Register them after PEFT has wrapped the model: PEFT would otherwise take their
    `lora_` parameters for its own when merging. Returns them by name."""
    experts = fused_experts(model)
    if weights is None:
        weights = [f"{module_name}.{name}" for module_name, module in experts.items()
                   for name in adapted_weights(module)]  # fmt: skip
    adapters = {}
    for key in weights:
        module_name, _, name = key.rpartition(".")
        module = experts.get(module_name)
        if module is None or name not in adapted_weights(module):
            raise ValueError(f"{key} is no fused expert weight of {type(model).__name__} that expert LoRA adapts")
        weight = getattr(module, name)
        # the number of experts of the layer, not of this process under --ep (a DTensor's shape is the whole one)
        adapters[key] = GroupedExpertLoRA(weight, rank, alpha, weight.shape[0] if groups is None else groups)
        # under --ep the adapted weight is this process's shard (`GroupedExpertLoRA.forward`)
        parametrize.register_parametrization(module, name, adapters[key], unsafe=isinstance(weight, DTensor))
    return adapters


def expert_adapters(model: nn.Module) -> dict[str, GroupedExpertLoRA]:
    """The expert adapters of a model, by `<experts module>.<weight name>`."""
    return {
        f"{module_name}.{name}": module.parametrizations[name][0]
        for module_name, module in model.named_modules()
        if parametrize.is_parametrized(module)
        for name in module.parametrizations
        if isinstance(module.parametrizations[name][0], GroupedExpertLoRA)
    }


def peft_target_modules(modules: list[str]) -> list[str] | str:
    """PEFT's `target_modules` for a recipe whose PEFT adapters may be none (its LoRA all on the experts, as
    OmniMoE-VL's Stages II and III): PEFT refuses to wrap a model where nothing matches, except with its dummy target
    (X-LoRA's), which wraps the model with no PEFT layer; the expert adapters are added after."""
    return modules or DUMMY_TARGET_MODULES


def load_expert_adapters(model: nn.Module, tensors: dict[str, torch.Tensor], alpha: int, trainable: bool) -> None:
    """Set the expert adapters of `model` to `tensors` (`<experts module>.<weight name>.lora_A` / `.lora_B`),
    registering them first on a model that has none (their rank and groups are the tensors' shapes)."""
    adapters = expert_adapters(model)
    saved = sorted({key.rsplit(".", 1)[0] for key in tensors})
    if adapters and sorted(adapters) != saved:
        raise ValueError(
            f"the saved expert adapters ({len(saved)}) are not those of the model ({len(adapters)}): the adapter was "
            "trained with other expert LoRA options or on another model"
        )
    for key in saved:
        if key not in adapters:
            groups, rank, _ = tensors[f"{key}.lora_A"].shape
            adapters |= add_expert_adapters(model, rank, alpha, groups, weights=[key])
        adapters[key].load_state_dict({"lora_A": tensors[f"{key}.lora_A"], "lora_B": tensors[f"{key}.lora_B"]})
        adapters[key].requires_grad_(trainable)


class ExpertLoraModel(PeftModelWithTrainedBase):
    """A PEFT model whose base model also holds expert adapters (`add_expert_adapters`): PEFT's
    `save_pretrained` leaves them out of the adapter (and so of the Trainer's checkpoints), and a reloaded or resumed
    model would silently lose them. `save_pretrained` writes them to `expert_lora.safetensors` beside PEFT's files;
    `load_adapter` (what `from_pretrained` and the Trainer's `resume_from_checkpoint` call) reads them back, onto a
    fresh base model too, with the scaling of PEFT's `lora_alpha`. One adapter ("default") at a time."""

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs) -> None:
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        tensors = {
            f"{key}.{name}": parameter.detach().contiguous()
            for key, adapter in expert_adapters(self.get_base_model()).items()
            for name, parameter in adapter.named_parameters()
        }
        if tensors and is_main_process:
            save_file(tensors, str(Path(save_directory) / EXPERT_LORA_FILE))

    def load_adapter(self, model_id, adapter_name: str, is_trainable: bool = False, **kwargs):
        result = super().load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        path = Path(model_id) / EXPERT_LORA_FILE
        if path.is_file():
            tensors = load_file(str(path), device=str(self.get_base_model().device))
            load_expert_adapters(self.get_base_model(), tensors, self.peft_config[adapter_name].lora_alpha,
                                 is_trainable)  # fmt: skip
        return result


def merge_lora(peft_model) -> nn.Module:
    """The model with every adapter folded into its weights: PEFT's, then the expert parametrizations."""
    model = peft_model.merge_and_unload()
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return model
