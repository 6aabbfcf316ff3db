"""`moezoo train ARCH --deepspeed CONFIG`: DeepSpeed ZeRO through transformers' Trainer (`TrainingArguments(
deepspeed=...)`), on the processes of a `torchrun` / `accelerate launch` launch, GPUs or CPUs (gloo).

CONFIG is a DeepSpeed config file (JSON) or the name of a preset of `PRESETS`; `zero3` shards parameters, gradients
and optimizer state over the processes (ZeRO stage 3) and leaves every training setting to the train command's own
options ("auto"): the Trainer's AdamW and learning-rate schedule, batch size, gradient accumulation and clipping.

How a ZeRO-3 run differs from the other modes (`moezoo.training.distributed`):

- Every process loads the whole model and the recipe adapts it (LoRA, new rows or experts) before DeepSpeed
  partitions it, when the Trainer starts: transformers' `zero.Init` loading, which partitions while reading, would
  hand the recipes that read or copy weights after loading (a new expert copied from another, MoEMB's `<emb>` row)
  empty partitions.
- The zoo's sparse MoE blocks are ZeRO-3 leaf modules (`set_moe_blocks_as_leaves`): each block gathers the
  parameters of its router, routed and shared experts in one step when it runs, instead of one hook per submodule
  (except the blocks that carry expert adapters, see there).
- When training ends the parameters are gathered back on every process and DeepSpeed's hooks are removed
  (`DeepSpeedZero3Mixin.train`), so that the commands merge and save the trained model as after a one-process run.
- 0-d parameters, which DeepSpeed cannot broadcast, are one-element vectors for the run (at every ZeRO stage,
  `scalar_parameters_as_vectors`).
- Refused when the Trainer starts: trainers that say why their recipe cannot run (`DeepSpeedZero3Mixin.
  zero3_refusal`: MoEMB, whose vision tower runs on some processes only, `SKIPPED_MODULES`).
- DeepSpeed's optimizer holds each process's partition as one flat tensor: parameters that took no part in a step
  (MoTE's unselected experts) get zero gradients, which Adam's momentum still turns into updates, where a
  one-process run skips them.

On a machine without CUDA DeepSpeed runs on its CPU accelerator with gloo; its shared-memory all-reduce, a C++ op
compiled on first use that serves inference only (`inference_all_reduce`), is not built (`training_config`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..modeling.moe.block import SparseMoeBlock

INSTALL = "pip install 'moezoo[deepspeed]'"

# The preset of `--deepspeed zero3`: ZeRO stage 3 with every training setting taken from the train command ("auto"),
# and the full weights gathered when the Trainer saves a model (its checkpoints' `pytorch_model` and `save_model`).
# No "optimizer" or "scheduler" section: the Trainer's AdamW and schedule, as under DDP and --fsdp.
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}
PRESETS = {"zero3": ZERO3}


def read_config(value: str) -> dict:
    """The DeepSpeed config `--deepspeed value` names: a preset of `PRESETS` or a JSON file."""
    if value in PRESETS:
        return copy.deepcopy(PRESETS[value])
    path = Path(value)
    if not path.is_file():
        raise ValueError(
            f"--deepspeed {value!r} is neither a preset ({', '.join(PRESETS)}) nor a DeepSpeed config file (JSON): "
            "give a preset name or the path of an existing file"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--deepspeed {value}: not a JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed {value}: a DeepSpeed config is a JSON object, got {type(config).__name__}")
    return config


def check_deepspeed(value: str | None, fsdp: int, ep: int) -> None:
    """Refuses, before anything is loaded, `--deepspeed` with `--fsdp` / `--ep` (two ways of sharding the same model),
    without DeepSpeed installed, and a config that is not one."""
    if value is None:
        return
    if fsdp > 1 or ep > 1:
        raise ValueError(
            f"--deepspeed with --fsdp {fsdp} / --ep {ep}: both shard the model over the processes, DeepSpeed ZeRO "
            "through the Trainer and --fsdp / --ep through transformers' loading; choose one of them"
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"--deepspeed needs DeepSpeed, which is not installed: {INSTALL}")
    read_config(value)


def training_config(value: str) -> dict:
    """The config of `--deepspeed value` for `TrainingArguments(deepspeed=...)`, which starts DeepSpeed's
    communication: on a machine without CUDA, DeepSpeed's CPU shared-memory all-reduce is marked unavailable first.
    It serves `inference_all_reduce` only (training collectives go through torch.distributed, gloo), and building it
    compiles C++ on every machine's first run, minutes on two cores."""
    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return read_config(value)


def uses_deepspeed(args) -> bool:
    """Whether the Trainer arguments `args` train with DeepSpeed."""
    return getattr(args, "hf_deepspeed_config", None) is not None


def is_zero3(args) -> bool:
    """Whether the Trainer arguments `args` train with DeepSpeed ZeRO stage 3."""
    return uses_deepspeed(args) and args.hf_deepspeed_config.is_zero3()


# Why a recipe whose model skips a module on some processes cannot run under ZeRO-3 (MoEMB's vision tower).
SKIPPED_MODULES = (
    "ZeRO-3 gathers a module's parameters with a collective of every process when the module runs, and this "
    "model's {module} runs only on the processes whose batch holds {inputs}, so the processes' collectives stop "
    "matching (gloo fails, nccl hangs); train it with --fsdp N (which gathers such modules at every step) or a "
    "DeepSpeed config of ZeRO stage 2 or below"
)


def scalar_parameters_as_vectors(model: nn.Module) -> list[nn.Parameter]:
    """
    The 0-d parameters of `model` (MoE-ViE's `logit_scale`, OmniMoE-VL's `fusion_output_scale`) reshaped to one
    element each, for the run; `scalar_parameters_restored` turns them back. DeepSpeed (0.19) broadcasts every
    parameter as bytes when it starts, at every ZeRO stage (`param.data.view(torch.uint8)`), which a 0-d tensor
    cannot be viewed as. The models use them as factors, which a one-element vector broadcasts as the scalar did; the
    checkpoints of the run (DeepSpeed's) hold them as such, and are resumed by the same code.
    """
    scalars = [parameter for parameter in model.parameters() if parameter.dim() == 0]
    for parameter in scalars:
        parameter.data = parameter.data.reshape(1)
    return scalars


def scalar_parameters_restored(parameters: list[nn.Parameter]) -> None:
    """Undoes `scalar_parameters_as_vectors` on whole (no longer partitioned) parameters: the saved folder holds them
    0-d, as the model defines them."""
    for parameter in parameters:
        parameter.data = parameter.data.reshape(())


def set_moe_blocks_as_leaves(model: nn.Module) -> list[nn.Module]:
    """
    Marks the sparse MoE blocks of `model` (the core's `SparseMoeBlock` and the transformers blocks SMoES hosts,
    `...SparseMoeBlock`) as ZeRO-3 leaf modules; returns them.

    Not the blocks whose experts carry expert adapters (`moezoo.training.expert_lora`, parametrizations of the fused
    weights): DeepSpeed releases a leaf's parameters once the gradient reaches the block's inputs, which autograd may
    do before it accumulates the gradients of the adapters (a branch of their own), and the accumulation then meets a
    released, empty parameter. The adapters are modules called at each access of the weight, so without the leaf
    their own hooks gather them for the forward and the backward.
    """
    from deepspeed.utils import set_z3_leaf_module

    blocks = [
        module for module in model.modules()
        if (isinstance(module, SparseMoeBlock) or type(module).__name__.endswith("SparseMoeBlock"))
        and not any(parametrize.is_parametrized(inner) for inner in module.modules())
    ]  # fmt: skip
    for block in blocks:
        set_z3_leaf_module(block, True)
    return blocks


class DeepSpeedZero3Mixin:
    """A `transformers.Trainer` mixin (placed before `Trainer`) for DeepSpeed runs: 0-d parameters are one-element
    vectors for the run (every stage); under ZeRO-3 the sparse MoE blocks become leaf modules before DeepSpeed wraps
    the model, and `train` ends with the model gathered whole on every process, no longer partitioned (see the module
    docstring). Without DeepSpeed it changes nothing.

    A trainer whose recipe cannot run under ZeRO-3 says why in `zero3_refusal`, and is refused when it starts."""

    zero3_refusal: str | None = None

    def __init__(self, model=None, args=None, *more, **kwargs):  # Trainer's first two parameters
        if model is not None and is_zero3(args):
            if self.zero3_refusal is not None:
                raise ValueError(f"--deepspeed with ZeRO-3: {self.zero3_refusal}")
            set_moe_blocks_as_leaves(model)
        deepspeed = model is not None and uses_deepspeed(args)
        self.scalar_parameters = scalar_parameters_as_vectors(model) if deepspeed else []
        super().__init__(model, args, *more, **kwargs)

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        if self.is_deepspeed_enabled and is_zero3(self.args):
            gather_partitioned_parameters(self.model_wrapped, self.model)
        scalar_parameters_restored(self.scalar_parameters)
        return result


def gather_partitioned_parameters(engine, model: nn.Module) -> None:
    """Makes every ZeRO-3 parameter of `model` a whole tensor again on every process (a collective) and removes
    DeepSpeed's hooks (`engine.destroy()`): afterwards `model` is a plain module holding the trained weights."""
    import deepspeed

    parameters = [parameter for parameter in model.parameters() if hasattr(parameter, "ds_id")]
    with deepspeed.zero.GatheredParameters(parameters):
        whole = [parameter.data.clone() for parameter in parameters]
    engine.destroy()
    for parameter, data in zip(parameters, whole):
        parameter.data = data
