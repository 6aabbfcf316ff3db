"""Training on several processes: the collectives of contrastive training, and how a `moezoo train` command loads its
model under `torchrun` / `accelerate launch`.

Three modes, one launch:

    torchrun --nproc_per_node 2 -m moezoo train ARCH ...                  DDP: every process holds the whole model
    torchrun --nproc_per_node 2 -m moezoo train ARCH ... --fsdp 2         FSDP2: parameters sharded over 2 processes
    torchrun --nproc_per_node 2 -m moezoo train ARCH ... --fsdp 2 --ep 2  + EP: each process holds whole experts

`--fsdp` and `--ep` become transformers' `DistributedConfig(fsdp_size, ep_size)` at `from_pretrained`, which shards
the model through its `_fsdp_plan` / `_ep_plan` before the weights are read (the Trainer sees an already distributed
model and does not wrap it again). Without them the Trainer wraps the model in DDP itself. `--batch-size` stays the
batch of one process, as in `TrainingArguments.per_device_train_batch_size`: the global batch is world size × batch.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.distributed.expert_parallel import EPImplementationInterface

from .arguments import training_output_dir


def world() -> tuple[int, int]:
    """(rank, world size), (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every process concatenated along dim 0 (rank order). The backward sums the gradients that all
    processes computed for each slice and hands every process the gradient of its own slice, so a loss over the
    global batch trains each process's local embeddings (OpenCLIP's gather_with_grad)."""
    _, world_size = world()
    if world_size == 1:
        return tensor
    return torch.cat(torch.distributed.nn.functional.all_gather(tensor), dim=0)


def launched_world_size() -> int:
    """The number of processes `torchrun` / `accelerate launch` started (1 for a plain launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_config(fsdp: int, ep: int, save_steps: int = 0,
                       ep_implementation: str = "auto") -> DistributedConfig | None:
    """
    The `DistributedConfig` of `--fsdp` / `--ep` / `--ep-implementation` (None for a single process or DDP), checked
    against the launch: sharding needs a distributed launch, and both sizes must use every process (`--ep` alone
    shards the dense parameters with FSDP2 over all processes, as transformers lays them out). The Trainer cannot
    checkpoint the optimizer state of a model sharded at load, so `--save-steps` (for `--resume`) is refused with them.
    """
    implementations = EPImplementationInterface().valid_keys()
    if ep_implementation not in implementations:
        raise ValueError(f"--ep-implementation {ep_implementation!r} is not one of the EP implementations registered "
                         f"in transformers' EPImplementationInterface: {', '.join(implementations)}")  # fmt: skip
    if ep_implementation != "auto" and ep == 1:
        raise ValueError(
            f"--ep-implementation {ep_implementation} chooses how tokens reach the experts under expert parallelism, "
            "which this run does not use: add --ep N (N processes sharing the experts), or drop --ep-implementation"
        )
    world_size = launched_world_size()
    for flag, size in (("--fsdp", fsdp), ("--ep", ep)):
        if size < 1:
            raise ValueError(f"{flag} must be a number of processes (1 or more), got {size}")
        if size > 1 and world_size == 1:
            raise ValueError(
                f"{flag} {size} shards the model over {size} processes, but this is a single process: launch the "
                f"command with `torchrun --nproc_per_node {size} -m moezoo train ...` (or `accelerate launch -m "
                "moezoo train ...`)"
            )
    if fsdp == ep == 1:
        return None
    if save_steps:
        raise ValueError(
            f"--save-steps {save_steps} with --fsdp / --ep: transformers' Trainer cannot checkpoint the optimizer state "
            "of a model sharded while loading, so such a run cannot be resumed; drop --save-steps, or checkpoint a "
            "DDP run (the same launch without --fsdp / --ep)"
        )
    if fsdp not in (1, world_size) or world_size % ep:
        raise ValueError(
            f"--fsdp {fsdp} --ep {ep} does not fit the {world_size} processes of this launch: --fsdp must equal the "
            f"number of processes ({world_size}) and --ep must divide it"
        )
    if ep == 1:
        return DistributedConfig(fsdp_size=fsdp)
    return DistributedConfig(fsdp_size=world_size, ep_size=ep, ep_implementation=ep_implementation)


def check_shardable(model_class: type[PreTrainedModel], config: PreTrainedConfig, ep: int,
                    replicated_scalars: bool = False) -> None:  # fmt: skip
    """
    Refuses, before any weight is read, what transformers and FSDP2 would fail on half-way through loading: a 0-d
    parameter (`fully_shard` shards every parameter on dim 0; unless `replicated_scalars`: the sharding of
    `adapted_sharding` keeps them whole), and with `ep > 1` a model without routed experts or with a layer whose
    experts do not split evenly over `ep` processes. The model is built on the meta device to read its parameters
    and EP plan.
    """
    with torch.device("meta"):
        model = model_class._from_config(config)
    scalars = [name for name, parameter in model.named_parameters() if parameter.dim() == 0]
    if scalars and not replicated_scalars:
        raise ValueError(
            f"--fsdp / --ep: {model_class.__name__} holds 0-d parameters ({', '.join(scalars)}), which FSDP2 cannot "
            "shard; train it with plain DDP (a distributed launch without --fsdp / --ep)"
        )
    if ep == 1:
        return
    plan = model._expand_parallel_plan(model.ep_plan)
    experts = {
        name.rpartition(".")[0]: parameter.shape[0]
        for name, parameter in model.named_parameters()
        if plan.get(name) == "grouped_gemm"
    }
    if not experts:
        raise ValueError(
            f"--ep {ep}: {model_class.__name__} has no routed experts to distribute (its `_ep_plan` names no expert "
            "weights); train it with --fsdp or plain DDP instead"
        )
    uneven = {name: count for name, count in experts.items() if count % ep}
    if uneven:
        raise ValueError(
            f"--ep {ep}: the routed experts of {', '.join(f'{name} ({count})' for name, count in uneven.items())} "
            f"do not split evenly over {ep} processes; choose an --ep that divides every layer's number of experts"
        )


def check_same_dtype_everywhere(dtype: torch.dtype) -> None:
    """Every process must train in the same dtype (DDP's gradient all-reduce and FSDP2's flat buffers assume it):
    a mismatch, e.g. `--bf16` given to some processes only, fails here instead of in a collective."""
    if launched_world_size() == 1:
        return
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dtypes = [None] * dist.get_world_size()
    dist.all_gather_object(dtypes, str(dtype))
    if len(set(dtypes)) > 1:
        raise ValueError(
            f"the processes of this launch load the model in different dtypes ({', '.join(dtypes)}, by rank): give "
            "every process the same options"
        )


def load_for_training(model_class: type[PreTrainedModel], folder: str | Path, fsdp: int = 1, ep: int = 1,
                      save_steps: int = 0, ep_implementation: str = "auto", **kwargs) -> PreTrainedModel:
    """`model_class.from_pretrained(folder, **kwargs)`, sharded as `--fsdp` / `--ep` / `--ep-implementation` ask once
    the launch (and `--save-steps`, see `distributed_config`), the dtype of every process and the model's parameters
    (`check_shardable`) have been checked."""
    parallelism = distributed_config(fsdp, ep, save_steps, ep_implementation)
    config = model_class.config_class.from_pretrained(folder)
    check_same_dtype_everywhere(kwargs.get("dtype") or config.dtype or torch.get_default_dtype())
    if parallelism is None:
        return model_class.from_pretrained(folder, **kwargs)
    check_shardable(model_class, config, ep)
    return model_class.from_pretrained(folder, distributed_config=parallelism, **kwargs)


def check_enough_examples(num_examples: int, batch_size: int, name: str = "data set") -> None:
    """The data set must fill one global batch: `batch_size` examples on each process of the launch."""
    world_size = launched_world_size()
    if num_examples < batch_size * world_size:
        on_processes = f" on each of {world_size} processes" if world_size > 1 else ""
        raise ValueError(f"the {name} has {num_examples} examples, fewer than one batch of {batch_size}{on_processes}")


@contextmanager
def main_process_output_dir(out: str | Path, overwrite: bool = False):
    """
    `training_output_dir(out)` on the main process; a scratch folder, deleted afterwards, on the others. Every process
    runs the same saving code (FSDP2 and EP gather the sharded weights with collectives in `save_pretrained`, which
    writes on rank 0 only), but only the main process fills and publishes `out`. The other processes wait until it
    has, so that `out` is complete when any of them returns.
    """
    rank, world_size = world()
    if rank == 0:
        with training_output_dir(out, overwrite=overwrite) as staging:
            yield staging
    else:
        with tempfile.TemporaryDirectory(prefix="moezoo-rank-") as scratch:
            yield Path(scratch)
    if world_size > 1:
        dist.barrier()
