"""What users see in the terminal: tables and progress bars (rich), and the libraries' own output kept out of them, in
one place."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text


# Piped output (CI logs, `| tee`) gets wide tables instead of rich's 80-column default.
console = Console() if Console().is_terminal else Console(width=160)
error_console = Console(stderr=True)


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    table = Table(title=title, header_style="bold")
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:  # cells as plain text: a path or name with "[...]" in it is not rich markup
        table.add_row(*(Text(format_cell(value)) for value in row))
    console.print(table)


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def progress_bar(transient: bool = False) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=error_console,
        transient=transient,
    )


# `moezoo --verbose` sets it, so that the libraries' output shows in every part of a command, converters included.
VERBOSE_VARIABLE = "MOEZOO_VERBOSE"
# Python warnings the libraries raise about their own code, which moezoo's users cannot act on.
LIBRARY_WARNINGS = (
    # PEFT's get_peft_model reads this deprecated property of the model it wraps (peft/peft_model.py); moezoo calls
    # is_activation_checkpointing.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # Said when HF_HUB_DISABLE_PROGRESS_BARS=0 or HF_DATASETS_DISABLE_PROGRESS_BARS=0 keeps the bars on, as it should.
    (UserWarning, r"Cannot disable progress bars"),
)


def verbose_requested() -> bool:
    return os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """
    Keep the libraries' own output out of moezoo's tables and progress bars for the duration: transformers' and
    datasets' logging below errors (LOAD REPORT tables of keys a converter drops on purpose, the `causal_conv1d` and
    `chunk_gated_delta_rule` fall-back notices of Qwen3.5's Gated DeltaNet layers), the progress bars of transformers
    ("Loading weights", "Writing model shards"), huggingface_hub (downloads) and datasets ("Generating train split",
    "Map", "Filter", "Creating json from Arrow format"), DeepSpeed's logging below errors (`_quiet_deepspeed`), and
    `LIBRARY_WARNINGS`. Errors still show. Every command runs inside it, and converters load their sources inside it
    when called from Python; with `moezoo --verbose` (or `MOEZOO_VERBOSE=1`) it does nothing.
    """
    if verbose_requested():
        yield
        return
    from transformers.utils import logging as transformers_logging

    with ExitStack() as restore:
        restore.enter_context(warnings.catch_warnings())
        for category, message in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        restore.callback(transformers_logging.set_verbosity, transformers_logging.get_verbosity())
        transformers_logging.set_verbosity_error()
        if transformers_logging.is_progress_bar_enabled():
            transformers_logging.disable_progress_bar()  # huggingface_hub's bars too
            restore.callback(transformers_logging.enable_progress_bar)
        restore.enter_context(_quiet_datasets())
        restore.enter_context(_quiet_deepspeed())
        yield


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """
    datasets' part of `quiet_libraries`. Most commands never use datasets, whose import takes about a second, so while
    it is not imported its environment variables are set instead; it reads them when a command imports it, and then
    stays quiet for the rest of the process.
    """
    if "datasets" not in sys.modules:
        quiet = {"DATASETS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        previous = {name: os.environ.get(name) for name in quiet}
        os.environ.update(quiet)
        try:
            yield
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return
    from datasets import utils as datasets_utils

    verbosity, bars_enabled = datasets_utils.logging.get_verbosity(), not datasets_utils.are_progress_bars_disabled()
    datasets_utils.logging.set_verbosity_error()
    datasets_utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets_utils.logging.set_verbosity(verbosity)
        if bars_enabled:
            datasets_utils.enable_progress_bars()


# DeepSpeed's logger, which writes to stdout.
DEEPSPEED_LOGGER = "DeepSpeed"


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """
    DeepSpeed's part of `quiet_libraries`. Where DeepSpeed is installed, accelerate imports it in every
    `save_pretrained` (to unwrap a `DeepSpeedEngine`), not only under `--deepspeed`, and DeepSpeed's import logs which
    accelerator it found ("Setting accelerator to CPU" on a machine without a GPU). A filter rather than a level:
    DeepSpeed sets its logger's level when it is imported, which may be later, inside the command.
    """
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    logger.addFilter(_errors_only)
    try:
        yield
    finally:
        logger.removeFilter(_errors_only)
