"""The `TrainingArguments` every `moezoo train` command starts from."""

from __future__ import annotations

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
