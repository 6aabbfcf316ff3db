"""Commands show moezoo's own progress and results; the progress bars, logging and warnings of transformers, datasets
and huggingface_hub only with `moezoo --verbose` (issue 17, item 8)."""

import json
import logging
import sys
import warnings

import pytest
import torch
from transformers.utils import logging as transformers_logging

from conftest import run_moezoo
from moezoo.terminal import DEEPSPEED_LOGGER, VERBOSE_VARIABLE, quiet_libraries
from moezoo.training.synthetic import ColouredShapes
from moezoo.zoo import create_from_preset

# What the libraries print during `moezoo train moe_vie`: transformers' and datasets' progress bars, and the
# FutureWarning PEFT's get_peft_model triggers.
LIBRARY_LINES = ("Loading weights", "Generating train split", "Map", "Writing model shards", "FutureWarning",
                 "is_gradient_checkpointing")  # fmt: skip


@pytest.fixture(scope="module")
def training_run(tmp_path_factory):
    """A tiny MoE-ViE and 12 image-caption pairs: the cheapest command that loads, trains on a data file and saves."""
    root = tmp_path_factory.mktemp("quiet")
    create_from_preset("tiny-moe_vie", root / "model", seed=0)
    rows = []
    shapes = ColouredShapes(image_size=16, colours=("red", "blue"), held_out=())
    for index, example in enumerate(shapes.sample(12, torch.Generator().manual_seed(0))):
        example.image.save(root / f"{index}.png")
        rows.append({"image": f"{index}.png", "text": example.caption})
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def train(root, name: str, *global_options: str):
    # Bars on, as in a terminal (the tests' default turns huggingface_hub's off), and a datasets cache of the run's
    # own, so that datasets generates its split instead of finding it cached by an earlier run.
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "0", "HF_DATASETS_CACHE": str(root / f"datasets-{name}")}
    result = run_moezoo(*global_options, "train", "moe_vie", "--model", root / "model", "--data", root / "pairs.jsonl",
                        "--out", root / name, "--steps", "2", "--batch-size", "4", "--lora-r", "2", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_commands_show_their_own_progress_and_not_the_libraries(training_run):
    output = train(training_run, "quiet")
    assert "training" in output and "final_loss" in output  # moezoo's own bar and table
    assert [line for line in LIBRARY_LINES if line in output] == []
    assert "train_runtime" not in output and "'loss'" not in output  # nor Trainer's log dictionaries


def test_verbose_shows_the_libraries_output_too(training_run):
    output = train(training_run, "verbose", "--verbose")
    assert [line for line in LIBRARY_LINES if line not in output] == []


ALL_KINDS = ["transformers logging", "datasets logging", "DeepSpeed logging", "a transformers bar", "a datasets bar",
             "FutureWarning"]


def library_output(capfd, caught: list) -> list[str]:
    """Which kinds of the library output `quiet_libraries` hides show now: warnings logged by transformers, datasets
    and DeepSpeed, their progress bars, and PEFT's FutureWarning (`caught` records the warnings)."""
    from datasets.utils import logging as datasets_logging
    from datasets.utils.tqdm import tqdm as datasets_tqdm

    caught.clear()
    warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    for bar in (transformers_logging.tqdm, datasets_tqdm):
        for _ in bar(range(2), desc=f"a {bar.__module__.split('.')[0]} bar"):
            pass
    loggers = {"transformers logging": transformers_logging.get_logger("transformers.modeling_utils"),
               "datasets logging": datasets_logging.get_logger("datasets.builder")}  # fmt: skip
    shown = capfd.readouterr().err
    shown += " ".join(kind for kind, logger in loggers.items() if logger.isEnabledFor(logging.WARNING))
    # DeepSpeed's is filtered (it sets its own level when imported), whether DeepSpeed is imported yet or not.
    warning = logging.LogRecord(DEEPSPEED_LOGGER, logging.WARNING, __file__, 0, "Setting accelerator to CPU", None, None)
    shown += " DeepSpeed logging" if logging.getLogger(DEEPSPEED_LOGGER).filter(warning) else ""
    shown += " FutureWarning" if caught else ""
    return [kind for kind in ALL_KINDS if kind in shown]


@pytest.fixture
def libraries_as_in_a_terminal(monkeypatch):
    """The libraries' defaults in a terminal: progress bars on, warnings logged and shown."""
    import datasets.utils.tqdm  # noqa: F401 (the module, which the class `datasets.utils.tqdm` hides)

    monkeypatch.delenv(VERBOSE_VARIABLE, raising=False)
    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)
    monkeypatch.setattr(sys.modules["datasets.utils.tqdm"], "_hf_datasets_progress_bars_disabled", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_quiet_libraries_hides_logging_bars_and_warnings_and_restores_them(libraries_as_in_a_terminal, capfd):
    with quiet_libraries():
        assert library_output(capfd, libraries_as_in_a_terminal) == []
    assert library_output(capfd, libraries_as_in_a_terminal) == ALL_KINDS


def test_quiet_libraries_does_nothing_when_verbose_is_asked(libraries_as_in_a_terminal, capfd, monkeypatch):
    monkeypatch.setenv(VERBOSE_VARIABLE, "1")
    with quiet_libraries():
        assert library_output(capfd, libraries_as_in_a_terminal) == ALL_KINDS
