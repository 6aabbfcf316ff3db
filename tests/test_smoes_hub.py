"""`moezoo export` of an SMoES folder whose buffers are not their initial values (after training forwards): the
flattened modeling file keeps what transformers' switches look for (spec §5 step 6), and a fresh process without
moezoo loads the folder with `trust_remote_code=True` with the config's `smoes_*` fields and every buffer, switches the
experts implementation, and generates as the model does with moezoo. (tests/test_architectures_hub.py covers the tiny
preset as created.)"""

import json

import pytest
import torch

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.conversion.smoes_qwen3_5_moe import synthetic_image_text_batch
from moezoo.hub.export import export_folder
from moezoo.modeling.smoes.qwen3_5_moe import SmoesQwen3_5MoeForConditionalGeneration
from moezoo.processors.smoes import SmoesQwen3_5MoeProcessor
from moezoo.zoo import create_from_preset

from conftest import run_python


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tiny-smoes after two training forwards (buffers updated), saved and exported, and its greedy generation."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("smoes-hub")
    created = create_from_preset("tiny-smoes", folder / "created")
    model = SmoesQwen3_5MoeForConditionalGeneration.from_pretrained(created).train()
    for seed in range(2):
        batch = synthetic_image_text_batch(model.config, seed=seed)
        model(**batch, labels=batch["input_ids"]).loss.backward()
    model.save_pretrained(folder / "trained")
    SmoesQwen3_5MoeProcessor.from_pretrained(created).save_pretrained(folder / "trained")
    export_folder(folder / "trained", folder / "exported")
    batch = synthetic_image_text_batch(model.config, seed=7)
    with torch.no_grad():
        expected = model.eval().generate(**batch, max_new_tokens=4, do_sample=False)
    buffers = {name: buffer for name, buffer in model.named_buffers() if "smoes" in name}
    return folder / "exported", buffers, batch, expected


def test_the_flattened_modeling_file_keeps_the_interfaces(exported):
    folder, *_ = exported
    modeling = (folder / "modeling_smoes_qwen3_5_moe.py").read_text()
    assert "@use_experts_implementation" in modeling
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in modeling
    assert "register_checkpoint_conversion_mapping(" in modeling
    assert "from moezoo" not in modeling and "import moezoo" not in modeling
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForImageTextToText"].startswith("modeling_smoes_qwen3_5_moe.")
    assert config["text_config"]["smoes_num_bins"] == 2


def test_loads_without_moezoo_with_buffers_config_and_generation(exported, tmp_path):
    folder, buffers, batch, expected = exported
    torch.save({"buffers": buffers, "batch": batch, "expected": expected}, tmp_path / "expected.pt")
    run_python(f"""
        import torch, transformers
        path, expected = {str(folder)!r}, torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True).eval()
        text_config = model.config.text_config
        assert (text_config.model_type, text_config.smoes_num_bins, text_config.smoes_mi_coef) == (
            "smoes_qwen3_5_moe_text", 2, 0.1)
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
