"""`moezoo list`, `create` and `convert`, on the toy architecture (and on every registered preset for `list`). `list`
runs in a fresh process, which reads MOEZOO_EXTRA_PRESETS when it imports moezoo; `create` and `convert` run through
the command's entry point in this process, saving an interpreter start each."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_moezoo, run_moezoo_in_this_process


def test_list_json_has_every_preset_with_meta_device_counts():
    result = run_moezoo("list", "--json")
    assert result.returncode == 0, result.stderr
    presets = {row["name"]: row for row in json.loads(result.stdout)}
    toy = presets["tiny-moezoo_toy"]
    assert toy["architecture"] == "moezoo_toy"
    # 2 layers x 4 experts x (16*16 + 16*8) routed weights, top-2 of 4: half of them inactive
    assert toy["total_parameters"] - toy["active_parameters"] == 2 * 2 * (16 * 16 + 16 * 8)
    large = presets["toy-large"]
    assert large["base_checkpoints"] == ["toy-org/toy-dense"] and large["converter"] == "toy-per-expert"
    table = run_moezoo("list")
    assert table.returncode == 0 and "tiny-moezoo_toy" in table.stdout and "toy-per-expert" in table.stdout


def test_a_broken_extra_presets_module_is_left_out_with_a_warning():
    """A module in MOEZOO_EXTRA_PRESETS that does not import is named, and every command still runs without it."""
    result = run_moezoo("list", "--json", env={"MOEZOO_EXTRA_PRESETS": "toy_arch.presets,no_such_presets_module"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "MOEZOO_EXTRA_PRESETS names 'no_such_presets_module', which was left out" in result.stderr
    assert "tiny-moezoo_toy" in {row["name"] for row in json.loads(result.stdout)}


def test_create_is_reproducible_per_seed(toy_registered, tmp_path, capfd):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        result = run_moezoo_in_this_process(capfd, "create", "tiny-moezoo_toy", "--out", tmp_path / name,
                                            "--seed", seed)
        assert result.returncode == 0, result.stderr
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert json.loads((tmp_path / "a" / "moezoo.json").read_text())["seed"] == 1
    assert (tmp_path / "a" / "processor_config.json").is_file()


def test_create_unknown_preset_names_the_known_ones(toy_registered, tmp_path, capfd):
    result = run_moezoo_in_this_process(capfd, "create", "tiny-nothing", "--out", tmp_path / "x")
    assert result.returncode == 2 and "unknown preset 'tiny-nothing'" in result.stderr
    assert "tiny-moezoo_toy" in result.stderr and not (tmp_path / "x").exists()


@pytest.fixture
def per_expert_checkpoint(toy_registered, tmp_path, capfd):
    """A toy checkpoint that stores each expert's gate/up/down separately."""
    created = tmp_path / "created"
    assert run_moezoo_in_this_process(capfd, "create", "tiny-moezoo_toy", "--out", created).returncode == 0
    fused = load_file(created / "model.safetensors")
    per_expert = {}
    for key, tensor in fused.items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, matrix in enumerate(tensor):
                gate, up = matrix.chunk(2)
                per_expert[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                per_expert[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, matrix in enumerate(tensor):
                per_expert[f"{prefix}{e}.down_proj.weight"] = matrix.contiguous()
        else:
            per_expert[key] = tensor
    source = tmp_path / "source"
    source.mkdir()
    save_file(per_expert, source / "weights.safetensors")
    (source / "config.json").write_text(json.dumps({"model_type": "moezoo_toy_per_expert", "hidden_size": 16}))
    return fused, source


def test_convert_picks_the_converter_from_the_source_and_passes_its_options(per_expert_checkpoint, tmp_path, capfd):
    fused, source = per_expert_checkpoint
    listing = run_moezoo_in_this_process(capfd, "convert", "--list")
    assert listing.returncode == 0 and "toy-per-expert" in listing.stdout and "moezoo_toy_per_expert" in listing.stdout
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "moezoo_toy", "--from", source, "--out",
                                        tmp_path / "out", "--num-labels", "5")
    assert result.returncode == 0, result.stderr
    converted = load_file(tmp_path / "out" / "model.safetensors")
    assert converted.keys() == fused.keys() and all(torch.equal(converted[k], fused[k]) for k in fused)
    assert len(json.loads((tmp_path / "out" / "config.json").read_text())["id2label"]) == 5
    provenance = json.loads((tmp_path / "out" / "moezoo.json").read_text())
    assert provenance["converter"] == "toy-per-expert" and provenance["source"] == str(source)


def test_convert_rejects_sources_it_cannot_take(per_expert_checkpoint, tmp_path, capfd):
    _, source = per_expert_checkpoint
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "moezoo_toy", "--from", source, "--out",
                                        tmp_path / "out")
    assert result.returncode == 2
    assert "no moezoo_toy converter takes a source of type 'bert'" in " ".join(result.stderr.split())
    missing = run_moezoo_in_this_process(capfd, "convert", "--to", "moezoo_toy", "--from", tmp_path / "nowhere",
                                         "--out", tmp_path / "o")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
