"""`moezoo train ARCH --push_to_hub` (moezoo.training.push): a tiny run exported and pushed to the in-memory Hub of
tests/fake_hub.py once it ends, its card holding the command's options and final metrics; and what would fail only
after training refused before anything is loaded, leaving nothing in --out."""

import argparse
import json
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import HfApi, hf_hub_download

from conftest import TESTS, free_port, run_moezoo_in_this_process, run_python
from moezoo.hub.push import check_exported
from moezoo.training import moe_vie
from moezoo.training.arguments import PUSH_FIELDS, parse_train_arguments
from moezoo.training.push import take_push_options
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """`--model --data` of a tiny MoE-ViE model and a few captioned images."""
    root = tmp_path_factory.mktemp("inputs")
    model = create_from_preset("tiny-moe_vie", root / "model", seed=0)
    return ["--model", str(model), "--data", str(write_shape_captions(root / "captions", 8))]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake Hub, with huggingface_hub's constants (read when it is imported) pointing at it, and a token."""
    server = subprocess.Popen([sys.executable, str(TESTS / "fake_hub.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")  # fmt: skip
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
        monkeypatch.setenv("HF_TOKEN", "hf_dummy")
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_run_is_exported_and_pushed_with_its_options_and_final_metrics(inputs, hub, tmp_path, capfd):
    out = tmp_path / "trained"
    result = run_moezoo_in_this_process(capfd, "train", "moe_vie", *inputs, "--out", out, "--steps", "2",
                                        "--batch-size", "4", "--lr_scheduler_type", "constant", "--push_to_hub",
                                        "--hub_model_id", "zoo/trained-moe-vie")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"pushed: {hub}/zoo/trained-moe-vie/commit/" in " ".join(result.stdout.split())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["trained"]  # the scratch export is gone

    pushed = HfApi().list_repo_files("zoo/trained-moe-vie")
    assert {"config.json", "model.safetensors", "moezoo.json", "README.md"} <= set(pushed)
    folder = tmp_path / "downloaded"
    for name in pushed:
        hf_hub_download("zoo/trained-moe-vie", name, local_dir=folder)
    check_exported(folder)  # the flat layout: every auto_map entry's code file, and the card
    training = json.loads((folder / "moezoo.json").read_text())["training"]
    command = "moezoo train moe_vie --per_device_train_batch_size 4 --max_steps 2 --lr_scheduler_type constant"
    assert training == json.loads((out / "moezoo.json").read_text())["training"] | {"command": command}
    card = (folder / "README.md").read_text()
    assert f"| command | {command} |" in card
    assert f"| final_loss | {training['final_loss']} |" in card
    assert "AutoModel.from_pretrained(\"zoo/trained-moe-vie\"" in card
    # The pushed repo loads from the Hub with its own code, where moezoo cannot be imported, with the trained weights.
    run_python(f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel
        model = AutoModel.from_pretrained("zoo/trained-moe-vie", trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        state, trained = model.state_dict(), load_file({str(out / "model.safetensors")!r})
        assert all(torch.equal(state[key], tensor) for key, tensor in trained.items())
    """, env={"HF_ENDPOINT": hub, "HF_TOKEN": "hf_dummy", "HF_HOME": str(tmp_path / "hf_home"),
              "HF_HUB_DISABLE_XET": "1"}, without_moezoo=True)  # fmt: skip


def test_the_repo_defaults_to_the_users_namespace_and_the_out_folders_name(hub, tmp_path):
    parser = argparse.ArgumentParser(prog="moezoo train moe_vie")
    moe_vie.add_train_arguments(parser)
    args = parse_train_arguments(parser, ["--model", "m", "--data", "d", "--out", str(tmp_path / "shapes-run"),
                                          "--push_to_hub", "--hub_token", "hf_secret", "--hub_private_repo", "--bf16",
                                          "--lora-r", "4"])  # fmt: skip
    push = take_push_options(parser, args)
    assert (push.repo_id, push.token, push.private) == ("tester/shapes-run", "hf_secret", True)
    assert push.command == "moezoo train moe_vie --bf16 true --lora-r 4"  # no path, no token
    assert not any(hasattr(args, name) for name in PUSH_FIELDS)  # the recipe's options never see them


@pytest.mark.parametrize(("environment", "flags", "error"), [
    ({"HF_HUB_OFFLINE": "1"}, ["--push_to_hub"], "--push_to_hub: HF_HUB_OFFLINE is set"),
    ({}, ["--push_to_hub"], "--push_to_hub needs a Hub token: log in with `hf auth login`, or set HF_TOKEN"),
    ({"HF_ENDPOINT": "unreachable"}, ["--push_to_hub", "--hub_token", "hf_dummy"],
     "--push_to_hub: cannot reach the Hub at "),
    ({}, ["--hub_model_id", "zoo/x"], "--hub_model_id is for --push_to_hub, which is not given"),
    ({}, ["--hub_strategy", "checkpoint"], "--hub_strategy cannot be set here: --push_to_hub pushes "
                                          "the trained model once, when the run ends"),
])  # fmt: skip
def test_what_would_fail_after_training_is_refused_before_anything_is_loaded(
    environment, flags, error, inputs, tmp_path, monkeypatch, capfd
):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", "HF_HUB_OFFLINE" in environment)
    if "HF_ENDPOINT" in environment:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    loaded = []
    monkeypatch.setattr(moe_vie, "train_moe_vie", lambda *args, **kwargs: loaded.append(args))
    out = tmp_path / "trained"
    result = run_moezoo_in_this_process(capfd, "train", "moe_vie", *inputs, "--out", out, *flags)
    assert result.returncode == 2 and error in " ".join(result.stderr.split()), result.stderr
    assert loaded == [] and not out.exists()

