"""Checkpoints, hence `--resume`, for runs sharded with `--fsdp` / `--ep`.

transformers' Trainer refuses to checkpoint a model sharded at load (`DistributedConfig`) unless it writes the model
alone (`save_only_model`), which cannot be resumed: the optimizer state is lost, and the model it would write is
gathered through `save_pretrained` (PEFT's, for an adapted model, cannot gather shards). `ShardedCheckpointsMixin`
lets the Trainer write what it writes with `save_only_model` (the Trainer state, the callbacks' state, the rotation
of old checkpoints) and adds, in the same `checkpoint-N` folder:

- the model and optimizer state as a distributed checkpoint (`torch.distributed.checkpoint`, the format FSDP2 and
  transformers' own `save_pretrained(distributed_checkpoint=True)` use): every process writes its own shards, with
  the fully qualified parameter names of `get_state_dict`, so the layout does not depend on the sharding;
- the learning-rate schedule, and the random state of every process (the Trainer's own files).

`--resume` reads them back into the model and optimizer of the same launch, sharded as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .deepspeed_zero import DeepSpeedZero3Mixin

DISTRIBUTED_CHECKPOINT = "distributed_checkpoint"


class ShardedCheckpointsMixin(DeepSpeedZero3Mixin):
    """A `transformers.Trainer` mixin (placed before `Trainer`) that checkpoints and resumes a model sharded with
    `--fsdp` / `--ep` (see the module docstring); a model that is not sharded checkpoints as the Trainer does. Every
    train command's trainer takes it, so it also brings the preparation of `--deepspeed` ZeRO-3 runs
    (`DeepSpeedZero3Mixin`), whose checkpoints are DeepSpeed's own, written and resumed by the Trainer."""

    def __init__(self, model=None, args=None, *more, **kwargs):  # Trainer's first two parameters
        self.sharded = getattr(model, "is_distributed_loading_by_transformers", False)
        if self.sharded and args is not None:
            # What the Trainer requires of a model sharded at load; the rest of the checkpoint is written here.
            args.save_only_model = True
        super().__init__(model, args, *more, **kwargs)

    def _unwrapped_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's AcceleratedOptimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.sharded and _internal_call:
            # a checkpoint's weights are in its distributed checkpoint (`_save_checkpoint`): only its folder here
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            return
        super().save_model(output_dir, _internal_call)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if not self.sharded:
            return
        output_dir = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        model_state, optimizer_state = get_state_dict(self.model, self._unwrapped_optimizer())
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.save(state, checkpoint_id=output_dir / DISTRIBUTED_CHECKPOINT)
        self._save_rng_state(str(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), output_dir / SCHEDULER_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self.sharded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=os.path.join(resume_from_checkpoint, DISTRIBUTED_CHECKPOINT))
        set_model_state_dict(self.model, state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.sharded or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer, path = self._unwrapped_optimizer(), os.path.join(checkpoint, DISTRIBUTED_CHECKPOINT)
        _, optimizer_state = get_state_dict(self.model, optimizer)
        # `get_state_dict` gives every parameter a state; those without one in the checkpoint (not trained yet then,
        # e.g. MoTE's experts of routes not drawn yet) get none, as in the uninterrupted run, where Adam starts
        # their state (and step count) at their first update.
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        optimizer_state["state"] = {
            name: state
            for name, state in optimizer_state["state"].items()
            if all(f"optimizer.state.{name}.{key}" in saved for key in state)
        }
        dcp.load({"optimizer": optimizer_state}, checkpoint_id=path)
        set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=StateDictOptions(strict=False))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
