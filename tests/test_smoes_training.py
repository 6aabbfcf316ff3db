"""`moezoo train smoes` on tiny-smoes and captioned shapes: the SMoES terms are logged and finite, curves, the
per-modality routing heatmap and the MSI json are written, the SMoES buffers advance once per training forward, a run
interrupted after its checkpoint resumes to the same model (LoRA adapters, routers and SMoES buffers), and frozen
routers with SMoES losses are refused."""

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.training import smoes
from moezoo.training.arguments import checkpoints_dir
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

from conftest import run_moezoo
from test_train_resume import record_log_histories


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("smoes-training")
    return create_from_preset("tiny-smoes", folder / "model"), write_shape_captions(folder / "data", 8)


def smoes_state(folder) -> dict[str, torch.Tensor]:
    return {key: value for key, value in load_file(folder / "model.safetensors").items() if "smoes" in key}


def test_command_logs_the_smoes_terms_and_writes_curves_heatmap_and_msi(tiny, tmp_path):
    model, data = tiny
    out = tmp_path / "trained"
    result = run_moezoo("train", "smoes", "--model", model, "--data", data, "--out", out, "--steps", "3",
                        "--batch-size", "4", "--lr", "1e-3", "--logging-steps", "1", "--gradient-checkpointing")  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in ("training_curves.png", "routing_by_modality.png", "model.safetensors", "processor_config.json"):
        assert (out / name).stat().st_size > 0, name
    msi = json.loads((out / "smoes_msi.json").read_text())
    assert len(msi["msi_per_layer"]) == 4 and all(0 <= value <= 1 for value in msi["msi_per_layer"])
    assert msi["msi"] == pytest.approx(sum(msi["msi_per_layer"]) / 4, abs=1e-4)
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["smoes_step"] == 3 and training["steps"] == 3  # one buffer update per training forward
    created, trained = smoes_state(model), smoes_state(out)
    assert int(trained["model.language_model.smoes_step"]) == 3
    assert not torch.equal(created["model.language_model.layers.0.mlp.smoes.expert_counts_ema"],
                           trained["model.language_model.layers.0.mlp.smoes.expert_counts_ema"])  # fmt: skip


def test_lora_trains_the_routers_and_logs_finite_terms(tiny, tmp_path, monkeypatch):
    model, data = tiny
    histories = record_log_histories(monkeypatch, smoes)
    options = smoes.SmoesTrainingOptions(steps=2, batch_size=4, learning_rate=1e-2, lora_r=2, logging_steps=1)
    smoes.train_smoes(model, data, tmp_path / "lora", options)
    logs = [log for log in histories[-1] if "loss" in log]
    names = ["aux_loss", "smoes_bal_loss", "smoes_mi_loss", *(f"smoes/mi_layer_{layer}" for layer in range(4))]
    assert len(logs) == 2 and all(math.isfinite(log[name]) for log in logs for name in names)
    before, after = load_file(model / "model.safetensors"), load_file(tmp_path / "lora" / "model.safetensors")
    router = "model.language_model.layers.1.mlp.gate.weight"
    assert not torch.equal(before[router], after[router])
    assert torch.equal(before["model.visual.blocks.0.mlp.linear_fc1.weight"],
                       after["model.visual.blocks.0.mlp.linear_fc1.weight"])  # the vision tower is frozen  # fmt: skip


def test_an_interrupted_lora_run_resumes_to_the_uninterrupted_model(tiny, tmp_path, monkeypatch):
    model, data = tiny
    options = smoes.SmoesTrainingOptions(steps=4, batch_size=4, learning_rate=1e-2, lora_r=2, save_steps=2,
                                         logging_steps=1)  # fmt: skip
    smoes.train_smoes(model, data, tmp_path / "whole", options)

    original, calls = smoes.SmoesTrainer.training_step, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(smoes.SmoesTrainer, "training_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smoes.train_smoes(model, data, tmp_path / "resumed", options)
    assert (checkpoints_dir(tmp_path / "resumed") / "checkpoint-2" / "smoes_buffers.safetensors").is_file()
    monkeypatch.setattr(smoes.SmoesTrainer, "training_step", original)
    smoes.train_smoes(model, data, tmp_path / "resumed", replace(options, resume=True))

    whole = load_file(tmp_path / "whole" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.allclose(whole[key].float(), resumed[key].float(), atol=1e-6) for key in whole)
    assert int(resumed["model.language_model.smoes_step"]) == 4
    assert not checkpoints_dir(tmp_path / "resumed").exists()


def test_frozen_routers_with_smoes_losses_are_refused(tiny, tmp_path):
    model, data = tiny
    options = smoes.SmoesTrainingOptions(steps=1, batch_size=2, freeze_routers=True)
    with pytest.raises(ValueError, match=r"smoes_mi_coef=0.1 and smoes_bal_coef=0.01 train the routers, but 4 router"):
        smoes.train_smoes(model, data, tmp_path / "frozen", options)
    assert not (tmp_path / "frozen").exists()
