"""What every `moezoo train` command shares: its Trainer options on the command line, and the `TrainingArguments`
they become."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import TrainingArguments


def training_arguments(output_dir: str | Path, options, **overrides) -> TrainingArguments:
    """
    Trainer arguments from a command's options (`steps`, `batch_size`, `gradient_accumulation_steps`,
    `gradient_checkpointing`, `learning_rate`, `weight_decay`, `warmup_steps`, `logging_steps`, `seed`): a cosine
    schedule, no checkpoints and no reporting (the commands save the model themselves), every data column kept for the
    collators, the GPU when there is one. `overrides` change or add any argument.
    """
    arguments = dict(
        output_dir=str(output_dir),
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        activation_checkpointing=options.gradient_checkpointing,
        learning_rate=options.learning_rate,
        weight_decay=options.weight_decay,
        warmup_steps=options.warmup_steps,
        lr_scheduler_type="cosine",
        logging_steps=min(options.logging_steps, options.steps),
        save_strategy="no",
        report_to="none",
        seed=options.seed,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    return TrainingArguments(**(arguments | overrides))


def add_trainer_arguments(parser: argparse.ArgumentParser, defaults, helps: dict[str, str] | None = None) -> None:
    """The Trainer options every train command takes, with the defaults of its options dataclass (`defaults`);
    `helps` gives some of them a help text (keyed by option name without dashes, e.g. `"lr"`)."""
    helps = helps or {}
    for flag, kind, default in (
        ("--steps", int, defaults.steps),
        ("--batch-size", int, defaults.batch_size),
        ("--lr", float, defaults.learning_rate),
        ("--weight-decay", float, defaults.weight_decay),
        ("--warmup-steps", int, defaults.warmup_steps),
        ("--gradient-accumulation-steps", int, defaults.gradient_accumulation_steps),
        ("--seed", int, defaults.seed),
        ("--logging-steps", int, defaults.logging_steps),
    ):
        parser.add_argument(flag, type=kind, default=default, help=helps.get(flag[2:].replace("-", "_")))
    parser.add_argument("--gradient-checkpointing", action="store_true")


def trainer_options(args: argparse.Namespace) -> dict:
    """The options of `add_trainer_arguments` as keyword arguments of an options dataclass."""
    return dict(
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing, seed=args.seed, logging_steps=args.logging_steps,
    )
