"""Trainer callbacks shared by every architecture, and the averages of values its trainers log beside the loss."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from ..modeling.moe import update_routing_biases
from ..terminal import progress_bar


class RoutingBiasCallback(TrainerCallback):
    """Applies the aux-loss-free balancing update once per optimizer step.

    `on_step_end` runs after `optimizer.step()`, once per optimizer step whatever the gradient accumulation; the
    routers have counted the assignments of every micro-batch since the previous step, and
    `update_routing_biases` sums them over all processes before the update. Frozen routers are skipped.
    """

    def __init__(self):
        self.updated_routers = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            # model.modules() reaches the routers through DDP / PEFT wrappers.
            self.updated_routers = update_routing_biases(model)
        return control


class LogAtCheckpointsAndEnd(TrainerCallback):
    """Logs at every checkpoint and at the last step too, besides every `logging_steps` steps, so that the logged
    losses cover every step of a run once, resumed or not: the Trainer's loss summed since its last log is not part
    of a checkpoint, and the steps after the last multiple of `logging_steps` would never be logged."""

    def on_step_end(self, args, state, control, **kwargs):
        # Runs after the Trainer's own flow callback, which has decided by now whether this step saves.
        if control.should_save or state.global_step >= state.max_steps:
            control.should_log = True
        return control


class StepAverages:
    """Values a trainer records at every training step (a loss term, the loss of each route), to be logged with the
    Trainer's loss as their means since the previous log, so that they are in `trainer.state.log_history`, which
    checkpoints keep. Call `pop_means` from `Trainer.log` on every process: the means are averaged over processes,
    which must have recorded the same names."""

    def __init__(self):
        self.totals: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.totals[name] = self.totals.get(name, 0) + value.detach().float()
        self.counts[name] = self.counts.get(name, 0) + 1

    def pop_means(self, accelerator: Accelerator) -> dict[str, float]:
        names = sorted(self.totals)
        if not names:
            return {}
        means = torch.stack([self.totals[name] / self.counts[name] for name in names]).to(accelerator.device)
        means = accelerator.reduce(means, reduction="mean")
        self.totals, self.counts = {}, {}
        return dict(zip(names, means.tolist()))


class RichProgressCallback(TrainerCallback):
    """One progress bar with the latest loss, in place of Trainer's tqdm bar and its printed log dictionaries.
    `use_rich_progress(trainer)` swaps it in."""

    def __init__(self):
        self.progress = None
        self.task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.progress = progress_bar()
            self.progress.start()
            self.task = self.progress.add_task("training", total=state.max_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is not None and logs and "loss" in logs:
            self.progress.update(self.task, description=f"training (loss {float(logs['loss']):.4g})")

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def use_rich_progress(trainer) -> None:
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(RichProgressCallback())
