"""`moezoo export` of an SMoES folder of each host whose buffers are not their initial values (after training
forwards): the flattened modeling file keeps what transformers' switches look for (spec §5 step 6), and a fresh process
without moezoo loads the folder with `trust_remote_code=True` with the config's `smoes_*` fields and every buffer,
switches the experts implementation, and generates as the model does with moezoo; with moezoo, the folder loads
without remote code into moezoo's classes. (tests/test_architectures_hub.py covers the tiny presets as created.)"""

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.conversion.smoes_common import synthetic_image_text_batch
from moezoo.hub.export import export_folder
from moezoo.zoo import create_from_preset

from conftest import run_python


# preset -> (model_type, flattened modeling file)
HOSTS = {
    "tiny-smoes": ("smoes_qwen3_5_moe", "modeling_smoes_qwen3_5_moe"),
    "tiny-smoes-qwen3-vl-moe": ("smoes_qwen3_vl_moe", "modeling_smoes_qwen3_vl_moe"),
}


@pytest.fixture(scope="module", params=list(HOSTS))
def exported(request, tmp_path_factory):
    """The tiny preset after two training forwards (buffers updated), saved and exported, and its greedy generation."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("smoes-hub")
    created = create_from_preset(request.param, folder / "created")
    model = AutoModelForImageTextToText.from_pretrained(created).train()
    for seed in range(2):
        batch = synthetic_image_text_batch(model.config, seed=seed)
        model(**batch, labels=batch["input_ids"]).loss.backward()
    model.save_pretrained(folder / "trained")
    AutoProcessor.from_pretrained(created).save_pretrained(folder / "trained")
    export_folder(folder / "trained", folder / "exported")
    batch = synthetic_image_text_batch(model.config, seed=7)
    with torch.no_grad():
        expected = model.eval().generate(**batch, max_new_tokens=4, do_sample=False)
    buffers = {name: buffer for name, buffer in model.named_buffers() if "smoes" in name}
    return request.param, folder / "exported", model, buffers, batch, expected


def test_the_flattened_modeling_file_keeps_the_interfaces(exported):
    preset, folder, *_ = exported
    model_type, modeling_file = HOSTS[preset]
    modeling = (folder / f"{modeling_file}.py").read_text()
    assert "@use_experts_implementation" in modeling
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in modeling
    assert "register_checkpoint_conversion_mapping(" in modeling
    assert "from moezoo" not in modeling and "import moezoo" not in modeling
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["auto_map"]["AutoModelForImageTextToText"].startswith(f"{modeling_file}.")
    assert config["text_config"]["smoes_num_bins"] == 2


def test_loads_with_moezoo_without_remote_code(exported):
    _, folder, model, buffers, batch, expected = exported
    loaded = AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert type(loaded) is type(model) and loaded.config.text_config.to_dict() == model.config.text_config.to_dict()
    assert all(torch.equal(dict(loaded.named_buffers())[name], buffer) for name, buffer in buffers.items())
    with torch.no_grad():
        assert torch.equal(loaded.generate(**batch, max_new_tokens=4, do_sample=False), expected)


def test_loads_without_moezoo_with_buffers_config_and_generation(exported, tmp_path):
    preset, folder, _, buffers, batch, expected = exported
    model_type, _ = HOSTS[preset]
    torch.save({"buffers": buffers, "batch": batch, "expected": expected}, tmp_path / "expected.pt")
    run_python(f"""
        import torch, transformers
        path, expected = {str(folder)!r}, torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True).eval()
        text_config = model.config.text_config
        assert (text_config.model_type, text_config.smoes_num_bins, text_config.smoes_mi_coef) == (
            {model_type + "_text"!r}, 2, 0.1)
        loaded = dict(model.named_buffers())
        assert int(loaded["model.language_model.smoes_step"]) == 2
        assert all(torch.equal(loaded[name], buffer) for name, buffer in expected["buffers"].items())
        model.set_experts_implementation("eager")
        with torch.no_grad():
            generated = model.generate(**expected["batch"], max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, expected["expected"]), (generated, expected["expected"])
        processor = transformers.AutoProcessor.from_pretrained(path, trust_remote_code=True)
        assert type(processor).__name__ == "SmoesQwen3_5MoeProcessor"
    """, without_moezoo=True)
