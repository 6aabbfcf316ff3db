"""Evaluation while training, shared by every `moezoo train` command (`--eval_data FILE`).

- **Options**: `--eval_data` (alias `--eval-data`) names validation data in the format of `--data`, read by the same
  loader. Given alone, it evaluates every `--eval_steps` steps (`--eval_strategy steps`; `eval_steps` defaults to
  `logging_steps`, as in transformers). `check_evaluation_options` refuses, before anything is loaded, evaluation
  flags without `--eval_data`, a metric name the recipe does not compute, and a `--load_best_model_at_end` whose
  checkpoints do not fall on evaluation steps; `check_same_format` refuses evaluation data in another format than
  the training data.
- **Metrics**: `EvaluatesWhileTraining`, a `Trainer` mixin, replaces `evaluate()`: every evaluation batch goes through
  the model once, in eval mode and without gradients; the trainer's `evaluation_values` keeps per-example tensors
  (embeddings, answer-token losses, routing counts), gathered over processes, and its `evaluation_metrics` reduces
  them over the whole evaluation set to the architecture's metrics, which the Trainer logs with the `eval_` prefix
  (`eval/<name>` in TensorBoard and the other trackers) and compares for `--load_best_model_at_end`.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from datasets import Dataset
from torch.nn import functional as F
from transformers.trainer_utils import speed_metrics

from .data import TABLE_FORMATS

# Metric names that stand for one per expert, modality, ...: `<expert>` matches any name.
PLACEHOLDER = re.compile(r"<[a-z]+>")
IGNORE_INDEX = -100


# --- options ------------------------------------------------------------------------------------------------------


def metric_matches(metric: str, names: Sequence[str]) -> bool:
    """Whether `metric` (with or without its `eval_` prefix) is one of `names`, whose `<placeholder>` parts match
    any name (`route_<expert>_loss`)."""
    metric = metric.removeprefix("eval_")
    return any(re.fullmatch(".+".join(map(re.escape, PLACEHOLDER.split(name))), metric) for name in names)


def check_evaluation_options(options) -> None:
    """
    Refuses, in one line naming the flag, the evaluation settings of `options` (a `TrainerOptions`) that cannot work:
    evaluation flags without `eval_data`, `eval_data` where the recipe does not evaluate (`eval_metrics` empty) or with
    `--eval_strategy no`, a `--metric_for_best_model` the recipe does not compute, and `--load_best_model_at_end`
    without a checkpoint at evaluation steps (`--save_steps`, a multiple of `--eval_steps`).
    """
    given = options.training_args
    strategy = given.get("eval_strategy")
    names = type(options).eval_metrics
    if options.eval_data is None:
        for name in ("eval_strategy", "eval_steps", "load_best_model_at_end", "metric_for_best_model"):
            if given.get(name) not in (None, False, "no"):
                raise ValueError(f"--{name} needs evaluation data: give --eval_data FILE (the format of --data)")
        return
    if not names:
        raise ValueError(f"--eval_data: this recipe ({type(options).__name__}) does not evaluate while training; "
                         "evaluate the trained model with `moezoo eval`")  # fmt: skip
    if strategy == "no":
        raise ValueError("--eval_data with --eval_strategy no would never read it: drop one of them")
    metric = given.get("metric_for_best_model")
    if metric is not None and not metric_matches(metric, names):
        raise ValueError(f"--metric_for_best_model {metric}: not a metric of this recipe's evaluation "
                         f"({', '.join(names)})")  # fmt: skip
    if given.get("load_best_model_at_end"):
        if strategy not in (None, "steps"):
            raise ValueError(f"--load_best_model_at_end with --eval_strategy {strategy}: checkpoints are written every "
                             "--save_steps steps, so evaluate at steps too (--eval_strategy steps)")  # fmt: skip
        eval_steps = given.get("eval_steps") or min(options.logging_steps, options.steps)
        if not options.save_steps or options.save_steps % eval_steps:
            raise ValueError(f"--load_best_model_at_end keeps the best checkpoint, so checkpoints must fall on "
                             f"evaluation steps: give --save_steps a multiple of --eval_steps ({eval_steps})")  # fmt: skip


def evaluation_arguments(options) -> dict:
    """The Trainer arguments that make it evaluate `options.eval_data` (none without): every `eval_steps` steps
    (default: `logging_steps`) unless `--eval_strategy` says otherwise, on batches of the training size unless
    `--per_device_eval_batch_size` says otherwise."""
    if options.eval_data is None:
        return {}
    return {"eval_strategy": "steps", "per_device_eval_batch_size": options.batch_size}


def eval_batch_size(options) -> int:
    """The evaluation batch size of a run (per process), as `evaluation_arguments` and the user's flags set it."""
    return options.training_args.get("per_device_eval_batch_size", options.batch_size)


def data_format(source) -> str | None:
    """How the train commands' loaders read `source`, in words; None for what they read whatever its origin (a
    `datasets.Dataset` in memory, a Hub data set's name)."""
    if isinstance(source, Dataset):
        return None
    path = Path(source)
    if any(c in str(source) for c in "*?[") or path.suffix == ".tar" or (path.is_dir() and any(path.glob("*.tar"))):
        return "webdataset .tar shards"
    if path.is_dir():
        return "a folder"
    if path.suffix.lower() in TABLE_FORMATS:
        return f"a {TABLE_FORMATS[path.suffix.lower()].upper()} file"
    return None


def check_same_format(data, eval_data) -> None:
    """Refuses evaluation data in another format than the training data (JSON Lines and JSON are one format)."""
    if eval_data is None:
        return
    train_format, eval_format = data_format(data), data_format(eval_data)
    if train_format is not None and eval_format is not None and train_format != eval_format:
        raise ValueError(f"--eval_data {eval_data} is {eval_format} and --data {data} {train_format}: give the "
                         "evaluation data in the format of the training data")  # fmt: skip


# --- metrics ------------------------------------------------------------------------------------------------------


def answer_token_values(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per example, over its supervised tokens (labels other than -100, each predicted from the position before it):
    the summed negative log-likelihood `answer_nll_sum`, the tokens predicted right `answer_correct` (greedy) and their
    number `answer_tokens`."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:].to(logits.device)
    supervised = labels != IGNORE_INDEX
    nll = F.cross_entropy(logits.transpose(1, 2), labels.masked_fill(~supervised, 0), reduction="none")
    correct = (logits.argmax(-1) == labels) & supervised
    return {
        "answer_nll_sum": (nll * supervised).sum(-1),
        "answer_correct": correct.sum(-1).float(),
        "answer_tokens": supervised.sum(-1).float(),
    }


class EvaluatesWhileTraining:
    """
    A `Trainer` mixin (placed before `Trainer`) whose `evaluate()` computes the architecture's metrics over the whole
    evaluation set. The trainer defines `evaluation_values(model, inputs, outputs)`: per-example tensors of a batch
    (first dimension: its examples) from the outputs of `compute_loss(..., return_outputs=True)`, and extends
    `evaluation_metrics(values)`, which reduces the concatenated values of every batch and process to floats; the
    batch losses are kept as `loss` (each example weighted by its batch), giving `eval_loss`. A trainer whose loss
    forward lacks what its metrics need overrides `evaluation_step` instead (SMoES asks for the router logits).
    """

    def evaluation_step(self, model, inputs: dict) -> dict[str, torch.Tensor]:
        """A batch's per-example values: `evaluation_values` and the batch loss, repeated for each example."""
        loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        values = self.evaluation_values(model, inputs, outputs)
        batch_size = len(next(iter(values.values())))
        return {"loss": loss.detach().float().reshape(1).expand(batch_size)} | values

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """The metrics of the whole evaluation set from its per-example values: here the mean loss."""
        return {"loss": values["loss"].mean().item()}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        # What `Trainer.evaluate` does around its `evaluation_loop` (memory and speed metrics, logging, the callbacks'
        # `on_evaluate`), around one pass that keeps every batch's values rather than the model's logits.
        self._memory_tracker.start()
        dataloader = self.get_eval_dataloader(eval_dataset)
        start_time = time.time()
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        was_training = model.training
        model.eval()
        parts = defaultdict(list)
        # Evaluating leaves the random state of training as it was (an evaluation that draws, as MoE-ViE's video
        # distillation picks frames, would otherwise change what training draws next): a run trains the same with
        # or without evaluation.
        accelerators = [self.args.device] if self.args.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=accelerators):
            for inputs in dataloader:
                for name, value in self.evaluation_step(model, self._prepare_inputs(inputs)).items():
                    parts[name].append(self.accelerator.gather_for_metrics(value.detach()).cpu())
        model.train(was_training)
        values = {name: torch.cat(tensors) for name, tensors in parts.items()}
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in self.evaluation_metrics(values).items()}
        metrics |= speed_metrics(metric_key_prefix, start_time, num_samples=len(next(iter(values.values()))),
                                 num_steps=len(dataloader))  # fmt: skip
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics


def evaluation_summary(trainer, metric_names: Sequence[str]) -> dict[str, float]:
    """For a run's summary, the metrics (`eval_<name>`, the speed metrics left out) of the model it saves: of the last
    evaluation, or with `--load_best_model_at_end` of the best one (whose step is `best_step`); none when the run did
    not evaluate."""
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    if not evaluations:
        return {}
    chosen, best = evaluations[-1], {}
    if trainer.args.load_best_model_at_end and trainer.state.best_global_step:
        chosen = next(log for log in evaluations if log["step"] == trainer.state.best_global_step)
        best = {"best_step": trainer.state.best_global_step}
    return best | {key: round(value, 4) for key, value in chosen.items()
                   if key.startswith("eval_") and metric_matches(key, metric_names)}  # fmt: skip


def evaluation_panels(metric_names: Sequence[str], log_history: list[dict]) -> dict[str, str]:
    """Loss-curve panels (`plot_log_history`) for the evaluation metrics logged in `log_history`, by key."""
    logged = sorted({key for log in log_history for key in log if key.startswith("eval_")})
    return {f"validation {key.removeprefix('eval_')}": key for key in logged if metric_matches(key, metric_names)}
