"""`moezoo train ARCH --save-steps N` and `--resume`: a run stopped after its checkpoint at step 2 of 4 keeps its
checkpoints beside `--out`, and resumed it ends with the model, summary and curves of an uninterrupted run; the
checkpoints folder is gone after success. Tiny models and data, as in the training tests of each architecture."""

import argparse
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from moezoo.training import moe_vie, moemb, mote
from moezoo.training.arguments import checkpoints_dir, trainer_options
from moezoo.training.moemb_synthetic import ShapeRetrieval

# Fixtures of the training tests: imported, pytest uses them in this module too (hence the noqa: F401 and F811).
from test_moe_vie_training import shapes, tiny  # noqa: F401
from test_mote_training import frame_processor_registered, procedure_videos, videollm_folder  # noqa: F401

STEPS, SAVE_STEPS = 4, 2


def count_training_steps(monkeypatch, trainer_class, stop_at: int | None = None) -> list[int]:
    """Counts the calls of `trainer_class.training_step` (one per optimizer step here); call number `stop_at` raises
    KeyboardInterrupt, as Ctrl-C would."""
    original, calls = trainer_class.training_step, []

    def training_step(self, *args, **kwargs):
        calls.append(len(calls) + 1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(trainer_class, "training_step", training_step)
    return calls


def record_log_histories(monkeypatch, module) -> list[list[dict]]:
    """The log history each run of `module`'s train command plots its curves from, run after run."""
    histories, plot = [], module.plot_log_history

    def recording_plot(log_history, *args, **kwargs):
        histories.append(list(log_history))
        return plot(log_history, *args, **kwargs)

    monkeypatch.setattr(module, "plot_log_history", recording_plot)
    return histories


def check_resume_equals_an_uninterrupted_run(monkeypatch, capsys, tmp_path, module, trainer_class, train, options):
    """`train(out, options)` uninterrupted, then stopped at step 3 and resumed: same weights, summary and curves."""
    histories = record_log_histories(monkeypatch, module)
    expected = train(tmp_path / "uninterrupted", options)

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        count_training_steps(patch, trainer_class, stop_at=SAVE_STEPS + 1)
        with pytest.raises(KeyboardInterrupt):
            train(out, options)
    assert not out.exists() and [p.name for p in checkpoints_dir(out).iterdir()] == [f"checkpoint-{SAVE_STEPS}"]
    assert "run the same command again with --resume" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="holds the checkpoints of an earlier run"):
        train(out, options)  # a fresh run would mix its checkpoints into the interrupted run's

    with monkeypatch.context() as patch:
        steps = count_training_steps(patch, trainer_class)
        resumed = train(out, replace(options, resume=True))
    assert len(steps) == STEPS - SAVE_STEPS  # it did resume, rather than start again
    assert not checkpoints_dir(out).exists() and not checkpoints_dir(tmp_path / "uninterrupted").exists()
    assert resumed == expected
    expected_weights = load_file(tmp_path / "uninterrupted" / "model.safetensors")
    resumed_weights = load_file(out / "model.safetensors")
    assert resumed_weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=1e-6, msg=name)

    expected_losses, resumed_losses = logged_losses(histories[0]), logged_losses(histories[-1])
    assert [log["step"] for log in resumed_losses] == list(range(1, STEPS + 1))  # the curves cover the whole run
    for expected_log, resumed_log in zip(expected_losses, resumed_losses, strict=True):
        assert resumed_log == pytest.approx(expected_log, abs=1e-6)
    return resumed_losses


def logged_losses(log_history: list[dict]) -> list[dict]:
    """The step and losses (the loss, and the distillation or route losses) of every training log."""
    return [{key: value for key, value in log.items() if key == "step" or "loss" in key}
            for log in log_history if "loss" in log]  # fmt: skip


@pytest.mark.parametrize("recipe", ["contrastive", "video_lora"])
def test_moe_vie_resumes_routing_biases_lora_distillation(tiny, recipe, tmp_path, monkeypatch, capsys):  # noqa: F811
    options = moe_vie.MoeVieTrainingOptions(steps=STEPS, batch_size=4, learning_rate=1e-2, logging_steps=1,
                                            save_steps=SAVE_STEPS)  # fmt: skip
    if recipe == "contrastive":
        dataset = shapes().image_text_dataset(16, torch.Generator().manual_seed(0))
    else:  # random frames drawn for distillation, the teacher, LoRA adapters drawn at random
        dataset = shapes().video_text_dataset(16, 3, torch.Generator().manual_seed(0))
        options = replace(options, video=True, num_frames=3, lora_r=2)

    def train(out, options):
        return moe_vie.train_moe_vie(tiny, dataset, out, options)

    logs = check_resume_equals_an_uninterrupted_run(monkeypatch, capsys, tmp_path, moe_vie, moe_vie.MoeVieTrainer,
                                                    train, options)  # fmt: skip
    if recipe == "contrastive":
        biases = [tensor for name, tensor in load_file(tmp_path / "out" / "model.safetensors").items()
                  if "e_score_correction_bias" in name]  # fmt: skip
        assert biases and any(bias.abs().sum() > 0 for bias in biases)  # the balancing update ran, and resumed
    else:
        assert len([log for log in logs if "distillation_loss" in log]) == STEPS


def test_moemb_resumes_with_its_expert_adapters_and_trained_routers(tiny_moemb, tmp_path, monkeypatch, capsys):
    dataset = ShapeRetrieval().training_dataset(16, torch.Generator().manual_seed(0))
    lora = moemb.LoraOptions(rank=2, alpha=4, dropout=0.1, train_router=True)
    options = moemb.MoEmbTrainingOptions(steps=STEPS, batch_size=4, learning_rate=1e-2, warmup_steps=0, logging_steps=1,
                                         save_steps=SAVE_STEPS, lora=lora)  # fmt: skip

    def train(out, options):
        return moemb.train_moemb(tiny_moemb, dataset, out, options)

    check_resume_equals_an_uninterrupted_run(monkeypatch, capsys, tmp_path, moemb, moemb.MoEmbTrainer, train, options)


@pytest.mark.parametrize("recipe", ["lora", "add_expert"])
def test_mote_resumes_joint_lora_training_and_expert_addition(
    videollm_folder, procedure_videos, recipe, tmp_path, monkeypatch, capsys  # noqa: F811
):
    data = procedure_videos.dataset({"step": 4, "next": 4, "proc": 4}, torch.Generator().manual_seed(0))
    options = mote.MoteTrainingOptions(steps=STEPS, batch_size=2, learning_rate=1e-2, logging_steps=1,
                                       save_steps=SAVE_STEPS)  # fmt: skip
    if recipe == "lora":
        options = replace(options, lora_r=2, tasks=("step", "next"))
    else:
        options = replace(options, add_expert="proc", init_from="next")

    def train(out, options):
        return mote.train_mote(videollm_folder, data, out, options)

    logs = check_resume_equals_an_uninterrupted_run(monkeypatch, capsys, tmp_path, mote, mote.MoteTrainer, train,
                                                    options)  # fmt: skip
    routes = {key for log in logs for key in log if key.startswith("loss/")}
    assert routes == ({"loss/step", "loss/next"} if recipe == "lora" else {"loss/proc"})


def test_resume_without_checkpoints_and_negative_save_steps_are_errors(tiny, tmp_path):  # noqa: F811
    dataset = shapes().image_text_dataset(4, torch.Generator().manual_seed(0))
    options = moe_vie.MoeVieTrainingOptions(steps=1, batch_size=4, resume=True)
    with pytest.raises(FileNotFoundError, match=r"found no checkpoint in .*out\.checkpoints: .*--save-steps"):
        moe_vie.train_moe_vie(tiny, dataset, tmp_path / "out", options)
    with pytest.raises(ValueError, match="save_steps must be 0"):
        moe_vie.train_moe_vie(tiny, dataset, tmp_path / "out", replace(options, resume=False, save_steps=-1))
    assert not (tmp_path / "out").exists() and not checkpoints_dir(tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("module", "options_class"),
    [(moe_vie, moe_vie.MoeVieTrainingOptions), (moemb, moemb.MoEmbTrainingOptions), (mote, mote.MoteTrainingOptions)],
)
def test_save_steps_and_resume_flags_reach_the_options(module, options_class):
    parser = argparse.ArgumentParser()
    module.add_train_arguments(parser)
    required = ["--model", "m", "--data", "d", "--out", "o"]
    options = options_class(**trainer_options(parser.parse_args([*required, "--save-steps", "50", "--resume"])))
    assert (options.save_steps, options.resume) == (50, True)
    options = options_class(**trainer_options(parser.parse_args(required)))
    assert (options.save_steps, options.resume) == (0, False)
