"""Evaluation while training on every `moezoo train` command (`moezoo.training.evaluation`, issue 27 item 3):
`--eval_data FILE` evaluates every `--eval_steps` steps with the architecture's own metrics, logged as `eval_<name>`
and kept in the run's summary; `--load_best_model_at_end --metric_for_best_model NAME` ends on the best checkpoint;
and what cannot work is refused in one line before anything is loaded, leaving nothing in `--out`."""

import json
import math
import re

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from torch import nn
from transformers import Trainer, TrainingArguments

from conftest import run_moezoo_in_this_process
from moezoo.hub.folders import read_provenance
from moezoo.training import moe_vie, moemb, moemb_grpo, mote, omnimoe_vl, smoes
from moezoo.training.evaluation import EvaluatesWhileTraining, check_same_format, metric_matches
from moezoo.training.moemb_synthetic import ShapeRetrieval
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

# Each train command: its tiny preset, and the evaluation metrics a run of it logs (`<expert>`: one per route).
COMMANDS = {
    "moe_vie": ("tiny-moe_vie", ["loss", "retrieval_image_to_text_recall_at_1", "retrieval_text_to_image_recall_at_1"]),
    "moemb": ("tiny-moemb", ["loss", "hit_at_1", "recall_at_5"]),
    "mote": ("tiny-mote-glm-ocr", ["loss", "task_accuracy", "route_<expert>_loss"]),
    "omnimoe_vl": ("tiny-omnimoe_vl", ["loss", "answer_nll", "depth_utilisation"]),
    "smoes": ("tiny-smoes", ["loss", "msi"]),
}
OPTIONS = {"moe_vie": moe_vie.MoeVieTrainingOptions, "moemb": moemb.MoEmbTrainingOptions,
           "mote": mote.MoteTrainingOptions, "omnimoe_vl": omnimoe_vl.OmniMoeVlTrainingOptions,
           "smoes": smoes.SmoesTrainingOptions}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, dict]:
    """Per command, a tiny model, its training data (4 examples) and evaluation data (4 others) in the format it
    reads, and the names of its routes (MoTE's experts)."""
    root = tmp_path_factory.mktemp("inputs")
    captions = write_shape_captions(root / "captions", 8)
    rows = [json.loads(line) for line in captions.read_text().splitlines()]

    def split(name: str, records: list[dict]) -> tuple:
        files = captions.with_name(f"{name}-train.jsonl"), captions.with_name(f"{name}-eval.jsonl")
        for path, part in zip(files, (records[:4], records[4:])):
            path.write_text("".join(json.dumps(record) + "\n" for record in part))
        return files

    models = {name: create_from_preset(preset, root / name) for name, (preset, _) in COMMANDS.items()}
    experts = json.loads((models["mote"] / "config.json").read_text())["text_config"]["mote_expert_names"]
    pairs = ShapeRetrieval().write_mmeb_training(root / "pairs", 8, torch.Generator().manual_seed(0))
    pair_rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    captions_split = split("captions", rows)
    data = {
        "moe_vie": captions_split,
        "smoes": captions_split,
        "omnimoe_vl": split("vqa", [{"image": row["image"], "question": "what is it?", "answer": row["text"]}
                                    for row in rows]),
        "mote": split("tasks", [{"task": experts[i % len(experts)], "prompt": "read", "answer": row["text"],
                                 "image": row["image"]} for i, row in enumerate(rows)]),
    }  # fmt: skip
    moemb_train, moemb_eval = pairs.with_name("train.jsonl"), pairs.with_name("eval.jsonl")
    moemb_train.write_text("".join(json.dumps(row) + "\n" for row in pair_rows[:4]))
    moemb_eval.write_text("".join(json.dumps(row) + "\n" for row in pair_rows[4:]))
    data["moemb"] = moemb_train, moemb_eval
    return {name: {"model": models[name], "data": data[name][0], "eval_data": data[name][1], "experts": experts}
            for name in COMMANDS}  # fmt: skip


def train(capfd, command: str, inputs: dict, out, *flags):
    """`moezoo train COMMAND` for 2 steps of batch 2 on the tiny model and data of `inputs`."""
    return run_moezoo_in_this_process(capfd, "train", command, "--model", inputs["model"], "--data", inputs["data"],
                                      "--out", out, "--steps", "2", "--batch-size", "2", *flags)  # fmt: skip


@pytest.fixture
def evaluations(monkeypatch) -> list[dict]:
    """The metrics of every evaluation of the runs of a test, as the Trainer logs them (its `log_history`), each with
    the trained parameters it measured under `"weights"`."""
    recorded, evaluate = [], EvaluatesWhileTraining.evaluate

    def recording(self, *args, **kwargs):
        weights = {name: parameter.detach().clone() for name, parameter in self.model.named_parameters()
                   if parameter.requires_grad}  # fmt: skip
        recorded.append(evaluate(self, *args, **kwargs) | {"step": self.state.global_step, "weights": weights})
        return recorded[-1]

    monkeypatch.setattr(EvaluatesWhileTraining, "evaluate", recording)
    return recorded


def assert_logged_and_summarised(command: str, evaluations: list[dict], summary: dict) -> None:
    """Every metric of `command` is finite in every evaluation and in the run's summary (`<expert>`: any route)."""
    for name in COMMANDS[command][1]:
        for metrics in (*evaluations, summary):
            values = [value for key, value in metrics.items() if key.startswith("eval_") and metric_matches(key, [name])]
            assert values and all(math.isfinite(value) for value in values), (name, metrics)
    assert all(metric_matches(name, OPTIONS[command].eval_metrics) for name in COMMANDS[command][1])


# SMoES's metrics are checked by the run of test_load_best_model_at_end_saves_the_best_checkpoint.
@pytest.mark.parametrize("command", [command for command in COMMANDS if command != "smoes"])
def test_every_train_command_logs_its_metrics_and_summarises_them(command, inputs, evaluations, tmp_path, capfd):
    run = inputs[command]
    result = train(capfd, command, run, tmp_path / "out", "--eval_data", run["eval_data"], "--eval_strategy", "steps",
                   "--eval_steps", "1", "--logging_steps", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [metrics["step"] for metrics in evaluations] == [1, 2]
    summary = read_provenance(tmp_path / "out")["training"]
    assert_logged_and_summarised(command, evaluations, summary)
    assert summary["eval_loss"] == round(evaluations[-1]["eval_loss"], 4) and "best_step" not in summary


def test_load_best_model_at_end_saves_the_best_checkpoint(inputs, evaluations, tmp_path, capfd):
    """SMoES trained in full at a learning rate that overshoots: the saved weights are those of the evaluation with
    the lowest eval_loss, not the last one, and the summary holds that evaluation's metrics."""
    run = inputs["smoes"]
    result = train(capfd, "smoes", run, tmp_path / "out", "--eval_data", run["eval_data"], "--eval_steps", "1",
                   "--save_steps", "1", "--logging_steps", "1", "--learning_rate", "0.05",
                   "--load_best_model_at_end", "--metric_for_best_model", "loss")  # fmt: skip
    assert result.returncode == 0, result.stderr
    losses = [metrics["eval_loss"] for metrics in evaluations]
    best = losses.index(min(losses))
    assert best != len(losses) - 1, losses
    summary = read_provenance(tmp_path / "out")["training"]
    assert_logged_and_summarised("smoes", evaluations, summary)
    assert summary["best_step"] == best + 1 and summary["eval_loss"] == round(losses[best], 4)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    compared = [name for name in evaluations[best]["weights"] if name in saved]
    assert compared
    for name in compared:
        torch.testing.assert_close(saved[name], evaluations[best]["weights"][name], rtol=0, atol=0)
    assert any(not torch.equal(saved[name], evaluations[-1]["weights"][name]) for name in compared)
    assert not (tmp_path / "out.checkpoints").exists()


@pytest.mark.parametrize(("flags", "error"), [
    (["--eval_strategy", "steps"], r"--eval_strategy needs evaluation data: give --eval_data FILE"),
    (["--load_best_model_at_end"], r"--load_best_model_at_end needs evaluation data: give --eval_data FILE"),
    (["--eval_data", "{eval}", "--metric_for_best_model", "accuracy"],
     r"--metric_for_best_model accuracy: not a metric of this recipe's evaluation \(loss, hit_at_1, recall_at_5\)"),
    (["--eval_data", "{eval}", "--load_best_model_at_end"],
     r"--load_best_model_at_end keeps the best checkpoint.*give --save_steps a multiple of --eval_steps \(2\)"),
    (["--eval_data", "{eval}", "--eval_strategy", "no"], r"--eval_data with --eval_strategy no would never read it"),
    (["--eval_data", "{eval}", "--eval_strategy", "epoch", "--load_best_model_at_end"],
     r"--load_best_model_at_end with --eval_strategy epoch: checkpoints are written every --save_steps steps"),
    (["--eval_data", "{folder}"], r"--eval_data .* is a folder and --data .* a JSON file: give the evaluation data in"),
])  # fmt: skip
def test_what_cannot_work_is_refused_before_loading(flags, error, inputs, tmp_path, capfd):
    run = inputs["moemb"]
    flags = [flag.format(eval=run["eval_data"], folder=run["eval_data"].parent) for flag in flags]
    result = train(capfd, "moemb", run, tmp_path / "out", *flags)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert re.search(error, result.stderr), result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.checkpoints").exists()


def test_grpo_does_not_evaluate_and_says_so(inputs, tmp_path, capfd):
    run = inputs["moemb"]
    result = run_moezoo_in_this_process(capfd, "train", "moemb", "--grpo", "--model", run["model"], "--data",
                                        run["data"], "--out", tmp_path / "out", "--eval_data", run["eval_data"])
    assert result.returncode != 0 and not (tmp_path / "out").exists()
    assert re.fullmatch(r"error: --eval_data: this recipe \(GrpoOptions\) does not evaluate while training; evaluate "
                        r"the trained model with `moezoo eval`\n", result.stderr), result.stderr
    with pytest.raises(ValueError, match=r"--eval_data: this recipe \(GrpoOptions\)"):
        moemb_grpo.GrpoOptions(eval_data=run["eval_data"])


def test_evaluation_data_is_compared_by_how_the_loaders_read_it(tmp_path):
    """JSON and JSON Lines are one format (datasets' json builder), a CSV file or a folder another; data in memory
    (`datasets.Dataset`) is read whatever the other side's format."""
    folder = tmp_path / "images"
    folder.mkdir()
    check_same_format(tmp_path / "train.jsonl", tmp_path / "eval.JSON")
    check_same_format(Dataset.from_dict({"text": ["a"]}), tmp_path / "eval.csv")
    with pytest.raises(ValueError, match=r"--eval_data .*eval\.csv is a CSV file and --data .*train\.jsonl a JSON file"):
        check_same_format(tmp_path / "train.jsonl", tmp_path / "eval.csv")
    with pytest.raises(ValueError, match=r"--eval_data .*images is a folder and --data .*train\.parquet a PARQUET file"):
        check_same_format(tmp_path / "train.parquet", folder)


def test_evaluating_leaves_the_random_state_of_training_as_it_was(tmp_path):
    """An evaluation that draws random numbers (as MoE-ViE's video distillation does) does not change what training
    draws next: a run trains the same with or without evaluation."""

    class DrawingTrainer(EvaluatesWhileTraining, Trainer):
        def evaluation_step(self, model, inputs):
            return {"loss": torch.rand(len(inputs["x"]))}

    model = nn.Linear(2, 1)
    model.forward = lambda x: {"loss": model.weight.sum() * x.sum()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none", use_cpu=True)
    trainer = DrawingTrainer(model=model, args=args, eval_dataset=Dataset.from_dict({"x": [[1.0, 2.0]] * 4}))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    metrics = trainer.evaluate()
    assert 0 < metrics["eval_loss"] < 1
    assert torch.equal(torch.get_rng_state(), state)
