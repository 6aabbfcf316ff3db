"""Trainer callbacks shared by every architecture."""

from __future__ import annotations

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
