"""What every `moezoo train` command shares: its Trainer options on the command line, the `TrainingArguments` they
become, the checkpoints folder that lets an interrupted run resume (with the PEFT model whose checkpoints keep the
parameters trained beside the adapters), and the loss summary of a run's logs."""

from __future__ import annotations

import argparse
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from rich.markup import escape
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainingArguments
from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.trainer_utils import get_last_checkpoint

from ..hub.folders import atomic_output_dir
from ..modeling.moe import expert_parallel  # noqa: F401 (registers moezoo's "dedup" EP implementation)
from ..terminal import error_console
from . import deepspeed_zero


def checkpoints_dir(out: str | Path) -> Path:
    """Where a run writing `out` keeps its Trainer checkpoints: `<out>.checkpoints`, beside `out` rather than in the
    staging folder of `atomic_output_dir`, which a failed run deletes."""
    out = Path(out)
    return out.with_name(f"{out.name}.checkpoints")


def checkpoint_to_resume(out: str | Path, options) -> str | None:
    """
    Checks `options.save_steps` and `options.resume` against the checkpoints folder of `out`, before the (long)
    loading of model and data, and returns the latest checkpoint to resume from (None for a fresh run).

    A fresh run refuses a folder that holds checkpoints: they belong to an interrupted run that `--resume` continues,
    and new checkpoints mixed into them would make `--resume` pick the wrong one.
    """
    if options.save_steps < 0:
        raise ValueError(f"save_steps must be 0 (no checkpoints) or a number of steps, got {options.save_steps}")
    folder = checkpoints_dir(out)
    last = get_last_checkpoint(folder) if folder.is_dir() else None
    if options.resume and last is None:
        raise FileNotFoundError(
            f"--resume found no checkpoint in {folder}: only a run started with --save-steps N writes checkpoints "
            "there (one every N optimizer steps)"
        )
    if not options.resume and last is not None:
        raise FileExistsError(
            f"{folder} holds the checkpoints of an earlier run of --out {out}: continue it with --resume, or delete "
            "that folder to start again"
        )
    return last


@contextmanager
def training_output_dir(out: str | Path, overwrite: bool = False):
    """
    `atomic_output_dir` for a training run, which also looks after the checkpoints folder (`checkpoints_dir`): it is
    removed once `out` is complete, and kept when the run fails or is interrupted and left a checkpoint, with a
    message saying how to resume.
    """
    checkpoints = checkpoints_dir(out)
    try:
        with atomic_output_dir(out, overwrite=overwrite) as staging:
            yield staging
    except BaseException:  # KeyboardInterrupt too: that is how a long run is usually stopped
        last = get_last_checkpoint(checkpoints) if checkpoints.is_dir() else None
        if last is None:
            # Nothing to resume from, at most the empty folder the Trainer creates even when it saves no checkpoint.
            shutil.rmtree(checkpoints, ignore_errors=True)
        else:
            error_console.print(escape(  # the paths are the user's: "[...]" in them is not markup
                f"training stopped; its checkpoints are kept in {checkpoints}: run the same command again with "
                f"--resume (Python: resume=True) to continue from {Path(last).name}"
            ), soft_wrap=True)  # not wrapped at 80 columns when piped: the paths stay whole for copy-paste
        raise
    shutil.rmtree(checkpoints, ignore_errors=True)


def training_arguments(out: str | Path, options, **overrides) -> TrainingArguments:
    """
    Trainer arguments for a run writing `out`, from a command's options (`steps`, `batch_size`,
    `gradient_accumulation_steps`, `gradient_checkpointing`, `learning_rate`, `weight_decay`, `warmup_steps`,
    `logging_steps`, `save_steps`, `seed`, `deepspeed`): a cosine schedule, a checkpoint in `checkpoints_dir(out)`
    every `save_steps` optimizer steps (none for 0; only the latest is kept, all resuming needs), no reporting (the
    commands save the model themselves), every data column kept for the collators, the GPU when there is one, the
    DeepSpeed config `deepspeed` names (`deepspeed_zero.training_config`). `overrides` change or add any argument.
    """
    if options.save_steps:
        checkpoints = dict(save_strategy="steps", save_steps=options.save_steps, save_total_limit=1)
    else:
        checkpoints = dict(save_strategy="no")
    arguments = dict(
        output_dir=str(checkpoints_dir(out)),
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        activation_checkpointing=options.gradient_checkpointing,
        learning_rate=options.learning_rate,
        weight_decay=options.weight_decay,
        warmup_steps=options.warmup_steps,
        lr_scheduler_type="cosine",
        logging_steps=min(options.logging_steps, options.steps),
        **checkpoints,
        report_to="none",
        seed=options.seed,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    if options.deepspeed is not None:
        arguments["deepspeed"] = deepspeed_zero.training_config(options.deepspeed)
    return TrainingArguments(**(arguments | overrides))


class PeftModelWithTrainedBase(PeftModel):
    """
    A PEFT model whose recipe also trains some parameters of the base model in full, beside the adapters (MoTE's
    experts, MoEMB's routers with `--train-router`); subclasses name them in `trained_base_parameters`. PEFT's adapter
    files hold the adapters only, so the Trainer's checkpoints would lose those parameters and a resumed run would
    silently restart them from the base model: `save_pretrained` writes them to `trained_base_parameters.safetensors`
    beside PEFT's files, and `load_adapter` (what the Trainer's `resume_from_checkpoint` and `from_pretrained` call)
    copies them back into the base model.
    """

    TRAINED_BASE_FILE = "trained_base_parameters.safetensors"

    def trained_base_parameters(self) -> dict[str, nn.Parameter | torch.Tensor]:
        """The parameters of `self.get_base_model()` trained in full, by name: none unless a subclass names them. A
        subclass may name buffers too: training state that the base model keeps (OmniMoE-VL's routing step)."""
        return {}

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs) -> None:
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        tensors = {name: parameter.detach().contiguous() for name, parameter in self.trained_base_parameters().items()}
        if tensors and is_main_process:
            save_file(tensors, str(Path(save_directory) / self.TRAINED_BASE_FILE))

    def load_adapter(self, model_id, adapter_name: str, is_trainable: bool = False, **kwargs):
        result = super().load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        path = Path(model_id) / self.TRAINED_BASE_FILE
        if path.is_file():
            base = self.get_base_model()
            parameters = dict(base.named_parameters()) | dict(base.named_buffers())
            with torch.no_grad():
                for name, tensor in load_file(str(path)).items():
                    if name not in parameters:
                        raise ValueError(f"{path} holds {name}, which is no parameter of this model")
                    parameters[name].copy_(tensor)
        return result


def loss_summary(log_history: list[dict]) -> dict[str, float]:
    """
    The first and last logged training losses (each a mean over its logging window) and the mean over the run, from
    `trainer.state.log_history`, which a resumed run restores from its checkpoint: the summary covers the whole run.
    With `LogAtCheckpointsAndEnd` the windows cover every step, so the mean is exactly the mean loss per step.
    """
    logs = [log for log in log_history if "loss" in log]
    window_ends = [log["step"] for log in logs]
    window_lengths = [end - start for start, end in zip([0, *window_ends], window_ends)]
    total = sum(log["loss"] * length for log, length in zip(logs, window_lengths))
    return {
        "initial_loss": round(logs[0]["loss"], 4),
        "final_loss": round(logs[-1]["loss"], 4),
        "mean_loss": round(total / window_ends[-1], 4),
    }


@dataclass
class TrainerOptions:
    """The options every train command takes (`add_trainer_arguments`); each architecture's options dataclass extends
    it, redeclaring the defaults it changes."""

    steps: int = 200
    batch_size: int = 8
    learning_rate: float | None = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    seed: int = 0
    logging_steps: int = 10
    save_steps: int = 0  # a checkpoint every this many optimizer steps (0: none), for `resume`
    resume: bool = False  # continue from the latest checkpoint of an earlier run with the same `out`
    fsdp: int = 1  # FSDP2 over this many processes (the launch's), see `moezoo.training.distributed`
    ep: int = 1  # expert parallelism over this many processes
    ep_implementation: str = "auto"  # how tokens reach the experts under `ep` (transformers' EPImplementationInterface)
    deepspeed: str | None = None  # DeepSpeed ZeRO: a preset name or config file, see `moezoo.training.deepspeed_zero`

    def __post_init__(self):
        deepspeed_zero.check_deepspeed(self.deepspeed, self.fsdp, self.ep)


def add_trainer_arguments(parser: argparse.ArgumentParser, defaults, helps: dict[str, str] | None = None) -> None:
    """The Trainer options every train command takes, with the defaults of its options dataclass (`defaults`);
    `helps` gives some of them a help text (keyed by option name without dashes, e.g. `"lr"`)."""
    helps = {
        "save_steps": "write a Trainer checkpoint to OUT.checkpoints every SAVE_STEPS optimizer steps (0: none); it "
                      "is deleted once OUT is written, and kept when the run fails or is interrupted, for --resume",
    } | (helps or {})  # fmt: skip
    for flag, kind, default in (
        ("--steps", int, defaults.steps),
        ("--batch-size", int, defaults.batch_size),
        ("--lr", float, defaults.learning_rate),
        ("--weight-decay", float, defaults.weight_decay),
        ("--warmup-steps", int, defaults.warmup_steps),
        ("--gradient-accumulation-steps", int, defaults.gradient_accumulation_steps),
        ("--seed", int, defaults.seed),
        ("--logging-steps", int, defaults.logging_steps),
        ("--save-steps", int, defaults.save_steps),
    ):
        parser.add_argument(flag, type=kind, default=default, help=helps.get(flag[2:].replace("-", "_")))
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run of this command (same options and --out) from its latest "
                             "checkpoint in OUT.checkpoints")  # fmt: skip
    parser.add_argument("--fsdp", type=int, default=defaults.fsdp, metavar="N",
                        help="shard parameters, gradients and optimizer state over N processes with FSDP2 (N: the "
                             "number of processes of the launch); without it a distributed launch runs DDP")  # fmt: skip
    parser.add_argument("--ep", type=int, default=defaults.ep, metavar="N",
                        help="expert parallelism: each of N processes holds a contiguous range of every MoE layer's "
                             "routed experts, tokens reach them by all-to-all (implies --fsdp WORLD_SIZE)")  # fmt: skip
    parser.add_argument("--ep-implementation", default=defaults.ep_implementation,
                        choices=EPImplementationInterface().valid_keys(),
                        help="with --ep: how tokens reach the experts, a name registered in transformers' "
                             "EPImplementationInterface (dedup: moezoo's, one copy of a token per rank that holds "
                             "any of its experts; all_to_all: one per (token, expert) pair; auto: all_to_all while "
                             "training)")  # fmt: skip
    parser.add_argument("--deepspeed", default=defaults.deepspeed, metavar="CONFIG",
                        help="train with DeepSpeed ZeRO on the processes of the launch: a DeepSpeed config file "
                             f"(JSON) or a preset ({', '.join(deepspeed_zero.PRESETS)}: ZeRO-3, parameters, gradients "
                             "and optimizer state sharded); not with --fsdp / --ep; needs "
                             f"`{deepspeed_zero.INSTALL}`")  # fmt: skip


def trainer_options(args: argparse.Namespace) -> dict:
    """The options of `add_trainer_arguments` as keyword arguments of an options dataclass."""
    return dict(
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing, seed=args.seed, logging_steps=args.logging_steps,
        save_steps=args.save_steps, resume=args.resume, fsdp=args.fsdp, ep=args.ep,
        ep_implementation=args.ep_implementation, deepspeed=args.deepspeed,
    )
