"""Trainer callbacks shared by every architecture, and the averages of values its trainers log beside the loss."""

from __future__ import annotations

import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..modeling.moe import SparseMoeBlock, record_routing, update_routing_biases
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


class LogsStepMeans:
    """A `Trainer` mixin (placed before `Trainer`) for values recorded at every training step besides the loss (a loss
    term, the loss of each route): `record_step_value(name, value)`, and every training log adds their means since the
    previous log, so that they are in `trainer.state.log_history`, which checkpoints keep. The means are averaged over
    processes, which must record the same names."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_totals: dict[str, torch.Tensor] = {}
        self._step_counts: dict[str, int] = {}

    def record_step_value(self, name: str, value: torch.Tensor) -> None:
        self._step_totals[name] = self._step_totals.get(name, 0) + value.detach().float()
        self._step_counts[name] = self._step_counts.get(name, 0) + 1

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        names = sorted(self._step_totals)
        if "loss" in logs and names:  # a training log (not evaluation's, nor the summary at the end)
            means = torch.stack([self._step_totals[name] / self._step_counts[name] for name in names])
            means = self.accelerator.reduce(means.to(self.accelerator.device), reduction="mean")
            logs.update(zip(names, means.tolist()))
            self._step_totals, self._step_counts = {}, {}
        super().log(logs, start_time)


class LogsRoutingStatistics(LogsStepMeans):
    """A `Trainer` mixin (placed before `Trainer`) for models built on the MoE core: every training log adds how the
    training forwards since the previous log spread their tokens over the experts, so that the trackers of
    `--report_to` and `trainer.state.log_history` show the balance of the routing while it trains (the routing
    heatmap PNG of MoE-ViE, MoEMB and SMoES at the end of a run shows it per layer and expert):

    - `experts/load_max_over_mean`: the busiest expert's assignments over the mean per expert (1: balanced);
    - `experts/load_entropy`: the entropy of the share of assignments per expert over its largest value, log(E)
      (1: every expert equally loaded, 0: one expert takes every token);
    - `experts/unused_share`: the share of experts that no token reached.

    Each is computed per MoE layer from the assignments of every process, then averaged over the layers: three
    scalars whatever the depth of the model, where a scalar per layer would give hundreds for a deep one. Only the
    forwards of `training_step` are counted (not evaluation's, nor those re-run by gradient checkpointing); the values
    a recipe records at each step (`record_step_value`) are logged beside them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._assignments: dict[str, torch.Tensor] = {}  # per MoE layer: (num_experts,) since the previous log

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.counting_routing(model):
            return super().training_step(model, inputs, num_items_in_batch)

    @contextmanager
    def counting_routing(self, model):
        """Counts the assignments of the forwards inside for the next training log, as `training_step` does: for a
        trainer whose `training_step` does not call this one (MoEMB's GradCache step)."""
        if not any(isinstance(module, SparseMoeBlock) for module in model.modules()):  # a dense configuration
            yield
            return
        with record_routing(model) as statistics:
            yield
        for layer, counts in statistics.counts.items():
            self.count_assignments(layer, counts.sum(dim=0))

    def count_assignments(self, layer: str, counts: torch.Tensor) -> None:
        """Adds one MoE layer's assignments per expert `(num_experts,)` to those of the next log: for the layers that
        are not the core's `SparseMoeBlock`, which `training_step` counts itself (the SMoES hosts' transformers
        blocks)."""
        self._assignments[layer] = self._assignments.get(layer, 0) + counts.detach().cpu()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._assignments:  # a training log (not evaluation's, nor the summary at the end)
            logs.update(self._routing_statistics())
            self._assignments = {}
        super().log(logs, start_time)

    def _routing_statistics(self) -> dict[str, float]:
        layers = list(self._assignments.values())
        # One flat tensor, so that one collective sums every layer's counts (layers may differ in expert count).
        counts = self.accelerator.reduce(torch.cat(layers).to(self.accelerator.device), reduction="sum")
        imbalance, entropy, unused = [], [], []
        for layer in counts.double().split([len(layer) for layer in layers]):
            share = layer / layer.sum().clamp(min=1)
            imbalance.append(layer.max() / layer.mean().clamp(min=1e-12))
            # A layer of one expert has entropy 0, the value of one expert taking every token, which it does.
            entropy.append(torch.special.entr(share).sum() / math.log(max(len(layer), 2)))
            unused.append((layer == 0).double().mean())
        return {
            "experts/load_max_over_mean": torch.stack(imbalance).mean().item(),
            "experts/load_entropy": torch.stack(entropy).mean().item(),
            "experts/unused_share": torch.stack(unused).mean().item(),
        }


class EvaluatesLoss:
    """A `Trainer` mixin (placed before `Trainer`) for losses computed outside the model's forward from several of its
    outputs (a contrastive loss over the batch): the evaluation step computes the batch's loss as `compute_loss` does,
    which `evaluate()` reports as `eval_loss`. The stock step would compute none, the batch having no `labels`, and
    would keep every output as predictions."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


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
    # Trainer adds PrinterCallback, which prints every log dictionary, instead of its tqdm bar when transformers'
    # logging is quieter than warnings (`disable_tqdm` defaults to that), as it is inside `quiet_libraries`.
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(RichProgressCallback())


class TensorBoardRunsIntoOutput(TrainerCallback):
    """Moves the TensorBoard event files of a finished run into its output folder (`write_tensorboard_into`)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def on_train_end(self, args, state, control, **kwargs):
        # Runs after the TensorBoardCallback's own on_train_end, which closes its writer: it was added to the Trainer
        # before this callback. The event files of every part of a resumed run are in the checkpoints' runs/.
        runs = Path(args.output_dir) / "runs"
        if state.is_world_process_zero and runs.is_dir():
            shutil.move(runs, self.folder / "runs")


def write_tensorboard_into(trainer, folder: str | Path) -> None:
    """With `--report_to tensorboard`, the event files end in `folder/runs`, in the run's output folder, kept with
    the trained model. While the run trains they are in transformers' default folder, `runs/` in the Trainer's
    `output_dir`, the checkpoints folder (`OUT.checkpoints/runs`), to watch there; that folder stays with the
    checkpoints of an interrupted run, which `--resume` continues, while the output folder is removed, and a finished
    run deletes it once they are moved. `TENSORBOARD_LOGGING_DIR`, which transformers reads, still chooses another
    folder, where they stay."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            trainer.add_callback(TensorBoardRunsIntoOutput(folder))
