"""`moezoo convert --to smoes` (spec smoes.md §5) against transformers' own Qwen3.5-MoE on a tiny checkpoint saved with
its native `save_pretrained` (per-expert tensors on disk): every tensor accounted for and bit-exact, logits and greedy
generation equal (E1), calibration, atomic output and errors naming the option."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.conversion.smoes_qwen3_5_moe import convert_qwen3_5_moe_to_smoes, synthetic_image_text_batch
from moezoo.modeling.smoes.qwen3_5_moe import SmoesQwen3_5MoeForConditionalGeneration
from moezoo.presets.smoes import TINY_SMOES

from conftest import run_moezoo_in_this_process


SMOES_FIELDS = ("smoes_num_bins", "smoes_ep_devices", "smoes_mi_coef", "smoes_bal_coef")


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """transformers' tiny Qwen3.5-MoE VLM (spec §4), saved natively."""
    torch.set_num_threads(1)
    text_config = {key: value for key, value in TINY_SMOES["text_config"].items() if key not in SMOES_FIELDS}
    config = Qwen3_5MoeConfig(**TINY_SMOES | {"text_config": text_config})
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("smoes-conversion") / "qwen3_5_moe"
    Qwen3_5MoeForConditionalGeneration(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(base_folder):
    return Qwen3_5MoeForConditionalGeneration.from_pretrained(base_folder).eval()


@pytest.fixture(scope="module")
def converted(base_folder):
    model, report = convert_qwen3_5_moe_to_smoes(base_folder, num_bins=2, score_type="attention")
    return model.load(), report


def test_the_source_checkpoint_holds_per_expert_tensors(base_folder):
    keys = set(load_file(base_folder / "model.safetensors"))
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert not any(key.endswith("experts.gate_up_proj") for key in keys)


def test_every_tensor_is_copied_bit_exactly(base, base_folder, converted):
    model, report = converted
    state, source_state = model.state_dict(), base.state_dict()
    assert all(torch.equal(state[key], tensor) and state[key].dtype == tensor.dtype
               for key, tensor in source_state.items())  # fmt: skip
    new = sorted(set(state) - set(source_state))
    assert new and all(".mlp.smoes." in key or key.endswith("smoes_step") for key in new)
    source_tensors = len(load_file(base_folder / "model.safetensors"))  # per-expert: more than the state dict has
    assert report["accounting"] == {"copied": source_tensors, "smoes_buffers": len(new), "dropped": []}
    assert model.config.text_config.smoes_num_bins == 2 and model.config.text_config.smoes_score_type == "attention"
    assert model.config.text_config.num_experts == base.config.text_config.num_experts
    assert report["max_abs_diff"] == 0.0


def test_logits_and_greedy_generation_equal_the_source(base, converted):
    model, _ = converted
    batch = synthetic_image_text_batch(model.config, seed=3)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base(**batch).logits)
    generation = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(**batch, **generation), base.generate(**batch, **generation))


def test_calibration_initialises_the_statistics_and_leaves_the_step_at_zero(base_folder):
    model, report = convert_qwen3_5_moe_to_smoes(base_folder, num_bins=4, calibrate=2, verify=False)
    states = model.model.language_model.smoes_states
    assert all(bool(state.gauss_initialized.all()) and bool(state.expert_counts_ema.sum() > 0) for state in states)
    assert int(model.model.language_model.smoes_step) == 0
    assert report["calibration_batches"] == 2 and report["max_abs_diff"] is None


def test_command_writes_a_folder_that_loads_with_the_buffers(base_folder, base, tmp_path, capfd):
    out = tmp_path / "smoes"
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "smoes", "--from", base_folder, "--out", out,
                                        "--num-bins", "2", "--calibrate", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "smoes_qwen3_5_moe"
    provenance = json.loads((out / "moezoo.json").read_text())
    assert provenance["converter"] == "smoes-qwen3_5_moe" and provenance["max_abs_diff"] == 0.0
    stored = load_file(out / "model.safetensors")
    # Qwen3.5-MoE's layout on disk (per-expert tensors): the SMoES text model shares transformers' conversion.
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in stored
    assert bool(stored["model.language_model.layers.1.mlp.smoes.gauss_initialized"].all())  # calibrated

    model = SmoesQwen3_5MoeForConditionalGeneration.from_pretrained(out).eval()
    state = model.state_dict()
    assert all(torch.equal(state[key], tensor) for key, tensor in base.state_dict().items())
    assert all(torch.equal(state[key], tensor) for key, tensor in stored.items() if ".smoes." in key)
    batch = synthetic_image_text_batch(model.config, seed=5)
    with torch.no_grad():  # another load path: equal up to CPU summation order (spec §5, E1)
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-6, rtol=0)
    assert (out / "processor_config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--num-bins", "3"], "--num-bins 3 (num_bins=3) must divide the source's 8 experts"),
        (["--num-bins", "4", "--ep-devices", "3"], "--ep-devices 3 (ep_devices=3) must divide --num-bins 4"),
        (["--calibrate", "-1"], "--calibrate -1 (calibrate=-1) must be 0 or a number of batches"),
    ],
)
def test_bad_options_fail_naming_the_option_and_leave_no_folder(base_folder, tmp_path, capfd, options, message):
    out = tmp_path / "smoes"
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "smoes", "--from", base_folder, "--out", out,
                                        *options)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_source_that_is_not_a_qwen3_5_moe_vlm_is_refused(tmp_path, capfd):
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "smoes", "--from", tmp_path / "dense", "--out",
                                        tmp_path / "out")
    assert result.returncode == 2 and "no smoes converter takes a source of type 'qwen3_5'" in result.stderr
    with pytest.raises(ValueError, match="not a Qwen3.5-MoE vision-language checkpoint"):
        convert_qwen3_5_moe_to_smoes(tmp_path / "dense")


def test_the_paper_preset_counts_eight_of_256_experts_as_active():
    from moezoo.registry import get_preset
    from moezoo.zoo import preset_parameters

    counts, _, _ = preset_parameters(get_preset("smoes-qwen3.5-35b-a3b"))
    per_expert = 3 * 2048 * 512  # gate, up and down projections of one routed expert
    assert counts.total - counts.active == 40 * (256 - 8) * per_expert
    assert 35.0e9 < counts.total < 35.2e9


def test_a_bfloat16_checkpoint_keeps_its_dtypes_and_its_logits(base, tmp_path):
    """Qwen3.5 keeps its rotary frequencies in float32 beside bfloat16 weights; a cast of either changes the logits."""
    base_bf16 = Qwen3_5MoeForConditionalGeneration.from_pretrained(base.name_or_path, dtype=torch.bfloat16).eval()
    base_bf16.save_pretrained(tmp_path / "bf16")
    model, report = convert_qwen3_5_moe_to_smoes(tmp_path / "bf16", num_bins=2)
    model = model.load()
    assert report["dtype"] == "bfloat16" and report["max_abs_diff"] == 0.0
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.model.language_model.layers[0].mlp.smoes.gauss_mean.dtype == torch.float32
