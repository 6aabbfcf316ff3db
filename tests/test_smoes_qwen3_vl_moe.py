"""SMoES on Qwen3-VL-MoE against transformers' own `Qwen3VLMoeForConditionalGeneration` with the same weights (spec
smoes.md §1.3, §5 E1-E4, §8), on the spec's tiny Qwen3-VL-MoE (§4) with layer 2 made dense (`mlp_only_layers`): 4
softmax-attention layers, 3 of them MoE with 8 experts top-2, DeepStack from both blocks of a 2-block vision tower.
Then the conversion from a checkpoint in Qwen's layout (`moezoo convert --to smoes`) and a short `moezoo train smoes`.
The inputs (two image-text prompts, one left-padded) and helpers are tests/test_smoes_model.py's."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.cli import main
from moezoo.configuration.smoes import SmoesQwen3VLMoeConfig, SmoesQwen3VLMoeTextConfig
from moezoo.conversion.smoes_common import synthetic_image_text_batch
from moezoo.conversion.smoes_qwen3_vl_moe import convert_qwen3_vl_moe_to_smoes
from moezoo.modeling.moe.smoes import VISION, contiguous_bins, one_hot_scores, smoes_export_bin_aligned
from moezoo.modeling.smoes import SmoesQwen3VLMoeForConditionalGeneration
from moezoo.presets.smoes import TINY_SMOES_QWEN3_VL_MOE
from moezoo.training import smoes as smoes_training
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

from test_smoes_model import SETTINGS, buffers_of, inputs, recorded_scores  # noqa: F401  (inputs: a fixture)


SMOES_FIELDS = ("smoes_num_bins", "smoes_ep_devices", "smoes_mi_coef", "smoes_bal_coef")
TEXT_CONFIG = {key: value for key, value in TINY_SMOES_QWEN3_VL_MOE["text_config"].items() if key not in SMOES_FIELDS}
TEXT_CONFIG["mlp_only_layers"] = [2]  # a dense layer between MoE layers: no SMoES state, the scores still advance
# Experts of 2 I = 32 != H = 64 rows: transformers recognises the transposed checkpoint layout by shape alone.
TEXT_CONFIG["moe_intermediate_size"] = 16
VISION_CONFIG = TINY_SMOES_QWEN3_VL_MOE["vision_config"]
TOKEN_IDS = {key: value for key, value in TINY_SMOES_QWEN3_VL_MOE.items() if key.endswith("token_id")}
TINY_SMOES = dict(smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=1.0, smoes_bal_coef=0.01)
MOE_LAYERS = (0, 1, 3)


def smoes_config(**smoes_fields) -> SmoesQwen3VLMoeConfig:
    return SmoesQwen3VLMoeConfig(
        text_config={**TEXT_CONFIG, **TINY_SMOES, **smoes_fields}, vision_config=VISION_CONFIG, **TOKEN_IDS
    )


@pytest.fixture(scope="module")
def base():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(
        Qwen3VLMoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **TOKEN_IDS)
    )
    model.set_experts_implementation("eager")
    return model.eval()


def smoes_from(base, **smoes_fields) -> SmoesQwen3VLMoeForConditionalGeneration:
    """The SMoES model with the base's weights; only its SMoES buffers are new."""
    model = SmoesQwen3VLMoeForConditionalGeneration(smoes_config(**smoes_fields))
    model.set_experts_implementation("eager")
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and all(".smoes." in key or key.endswith("smoes_step") for key in missing)
    return model.eval()


def routers(model) -> list[torch.nn.Parameter]:
    return [model.model.language_model.layers[index].mlp.gate.weight for index in MOE_LAYERS]


# --- the host -----------------------------------------------------------------------------------------------------


def test_only_moe_layers_hold_smoes_state_and_attention_scores_are_the_default(base):
    model = smoes_from(base)
    language_model = model.model.language_model
    assert list(language_model.moe_blocks) == list(MOE_LAYERS) and len(language_model.smoes_states) == 3
    assert not hasattr(language_model.layers[2].mlp, "smoes")
    assert model.config.text_config.smoes_score_type == "attention"


# --- E1: the forward is the base's --------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_and_generation_equal_the_base_for_every_setting(base, inputs, setting):
    model = smoes_from(base, **SETTINGS[setting])
    base_model = copy.deepcopy(base)
    model.train()
    base_model.train()
    for _ in range(2):  # training forwards run the bookkeeping and update the buffers
        trained = model(**inputs, labels=inputs["input_ids"])
        assert torch.equal(trained.logits, base_model(**inputs).logits)
    assert model.model.language_model.smoes_step.item() == 2 and trained.smoes_mi.shape == (3,)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, base(**inputs).logits)
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, base.generate(**inputs, max_new_tokens=4, do_sample=False))


# --- E2, E3: the losses --------------------------------------------------------------------------------------------


def test_disabled_smoes_trains_with_the_base_loss_exactly(base, inputs):
    model = smoes_from(base, smoes_enabled=False).train()
    base_model = copy.deepcopy(base).train()
    output = model(**inputs, labels=inputs["input_ids"], output_router_logits=True)
    reference = base_model(**inputs, labels=inputs["input_ids"], output_router_logits=True)
    assert torch.equal(output.loss, reference.loss) and torch.equal(output.aux_loss, reference.aux_loss)
    assert output.smoes_mi_loss is None and model.model.language_model.smoes_step.item() == 0


def test_without_mi_the_loss_is_task_plus_bin_balance_by_the_reference_formula(base, inputs):
    """L = L_task + alpha_bal * sum_l N_B sum_k sum_{e in B_k} f_e P_e over the MoE layers, with f_e the fraction of
    valid tokens whose top-k holds e and P_e the mean softmax gate (spec §2.4), from the base's own router logits."""
    model = smoes_from(base, smoes_mi_coef=0.0, smoes_bal_coef=0.01).train()
    output = model(**inputs, labels=inputs["input_ids"])
    base_model = copy.deepcopy(base).train()
    reference = base_model(**inputs, labels=inputs["input_ids"], output_router_logits=True)
    task_loss = base_model(**inputs, labels=inputs["input_ids"]).loss  # without the base's auxiliary loss
    valid = inputs["attention_mask"].reshape(-1).bool()
    assert len(reference.router_logits) == 3
    balance = 0.0
    for logits in reference.router_logits:
        gates = torch.softmax(logits.float(), dim=-1)[valid]
        dispatch = torch.zeros(8).index_add_(0, gates.topk(2).indices.reshape(-1), torch.ones(valid.sum() * 2))
        balance = balance + 4 * (dispatch / valid.sum() * gates.mean(dim=0)).sum()  # N_B = 8 experts / 2 bins
    torch.testing.assert_close(output.smoes_bal_loss, balance)
    torch.testing.assert_close(output.loss, task_loss + 0.01 * balance)
    assert output.smoes_mi_loss.item() <= 0.0
    assert torch.equal(torch.stack(output.smoes_bins), contiguous_bins(8, 2).expand(3, -1))


# --- training-time bookkeeping ---------------------------------------------------------------------------------------


def test_attention_scores_mix_at_every_layer_the_dense_one_included(base, inputs, monkeypatch):
    model = smoes_from(base)
    recorded = recorded_scores(model, inputs, monkeypatch)
    valid = inputs["attention_mask"].bool()
    hard = one_hot_scores((inputs["mm_token_type_ids"] > 0).long())
    assert not any(scores.requires_grad for scores in recorded.values())
    assert not torch.allclose(recorded[0][valid], hard[valid])  # layer 0's attention already mixes
    for scores in recorded.values():
        torch.testing.assert_close(scores[valid].sum(-1), torch.ones(int(valid.sum())))
    image_tokens = (inputs["mm_token_type_ids"] > 0) & valid
    vision_means = [recorded[position][image_tokens][:, VISION].mean() for position in range(3)]
    assert vision_means[2] < vision_means[1] < vision_means[0] < 1.0
    assert torch.equal(recorded[2][0, :3, VISION], torch.zeros(3))  # causal: the text before the image never sees it



def test_the_dense_layer_advances_the_attention_scores_too(base, inputs, monkeypatch):
    """Every decoder layer, the dense one (2) included, mixes the scores once per training forward: layer 3's router
    sees M^(4), not M^(3)."""
    model = smoes_from(base)
    runtime = model.model.language_model.smoes_runtime
    advanced = []

    def advance(mixer_output):
        advance_attention_scores(mixer_output)
        advanced.append(runtime.attention_scores)

    advance_attention_scores = runtime.advance_attention_scores
    monkeypatch.setattr(runtime, "advance_attention_scores", advance)
    recorded = recorded_scores(model, inputs, monkeypatch)
    assert len(advanced) == 4
    assert torch.equal(recorded[0], advanced[0]) and torch.equal(recorded[1], advanced[1])
    assert torch.equal(recorded[2], advanced[3]) and not torch.equal(advanced[3], advanced[1])


def test_mi_loss_alone_trains_every_router_and_nothing_else_of_smoes(base, inputs):
    model = smoes_from(base, smoes_bal_coef=0.0).train()
    output = model(**inputs)  # no labels: the loss is the SMoES term itself
    assert output.loss is None
    output.aux_loss.backward()
    for gradient in (weight.grad for weight in routers(model)):
        assert gradient is not None and torch.isfinite(gradient).all() and gradient.abs().sum() > 0
    assert not any(buffer.requires_grad for buffer in buffers_of(model).values())


def test_gradient_checkpointing_gives_the_same_gradients_and_counts_once(base, inputs):
    gradients, buffers = [], []
    for checkpointing in (False, True):
        model = smoes_from(base).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        gradients.append(torch.stack([weight.grad for weight in routers(model)]))
        buffers.append(buffers_of(model))
    torch.testing.assert_close(gradients[1], gradients[0])
    assert buffers[1]["model.language_model.smoes_step"].item() == 1
    for name, buffer in buffers[0].items():
        torch.testing.assert_close(buffers[1][name], buffer)


def test_frozen_routers_are_refused_in_training(base, inputs):
    model = smoes_from(base).train()
    routers(model)[1].requires_grad_(False)
    with pytest.raises(ValueError, match=r"train the routers, but 1 router weights are frozen \(.*layers\.1\.mlp"):
        model(**inputs, labels=inputs["input_ids"])


# --- E4: the bin-aligned export ------------------------------------------------------------------------------------


def test_export_permutation_keeps_the_logits_and_transformers_reads_it(base, inputs, tmp_path):
    model = smoes_from(base, smoes_num_bins=4, smoes_ep_devices=2)
    generator = torch.Generator().manual_seed(0)
    for state in model.model.language_model.smoes_states:  # bins scattered over the index range
        state.expert_counts_ema.copy_(torch.rand(state.expert_counts_ema.shape, generator=generator))
        state.reassign_bins()
    assert any(not torch.equal(state.bins, contiguous_bins(8, 4)) for state in model.model.language_model.smoes_states)
    with torch.no_grad():
        logits = model(**inputs).logits
        smoes_export_bin_aligned(model)
        assert all(torch.equal(s.bins, contiguous_bins(8, 4)) for s in model.model.language_model.smoes_states)
        torch.testing.assert_close(model(**inputs).logits, logits, atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path)
    plain = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tmp_path, config=base.config, experts_implementation="eager"
    )
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(**inputs).logits, logits, atol=1e-6, rtol=0)


# --- checkpoints and configuration -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_folder(base, tmp_path_factory):
    """The base saved as Qwen's own Qwen3-VL-MoE checkpoints are (Qwen/Qwen3-VL-30B-A3B-Instruct): fused experts
    transposed, gate_up_proj (E, H, 2I) and down_proj (E, I, H). transformers 5.24 saves them untransposed and loads
    both layouts (its `Transpose(1, 2, check_dims=True)` conversion of `qwen3_vl_moe`)."""
    folder = tmp_path_factory.mktemp("smoes-qwen3-vl-moe") / "qwen3_vl_moe"
    base.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_qwen3_vl_moe_checkpoint_loads_with_only_the_smoes_buffers_new(base, base_folder, inputs, tmp_path):
    stored = load_file(base_folder / "model.safetensors")
    assert stored["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 32)
    model = SmoesQwen3VLMoeForConditionalGeneration.from_pretrained(base_folder, config=smoes_config())
    model.set_experts_implementation("eager")
    assert model.model.language_model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 64)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in base.state_dict().items())
    with torch.no_grad():  # another load path can change the CPU kernels' summation order, not the weights
        torch.testing.assert_close(model.eval()(**inputs).logits, base(**inputs).logits, atol=1e-6, rtol=0)

    model.train()(**inputs, labels=inputs["input_ids"])
    model.save_pretrained(tmp_path)
    reloaded = SmoesQwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path)
    assert isinstance(reloaded.config.text_config, SmoesQwen3VLMoeTextConfig)
    assert reloaded.config.text_config.mlp_only_layers == [2] and reloaded.config.text_config.num_experts == 8
    saved = buffers_of(model)
    assert saved["model.language_model.smoes_step"].item() == 1
    assert buffers_of(reloaded).keys() == saved.keys()
    assert all(torch.equal(buffer, saved[name]) for name, buffer in buffers_of(reloaded).items())
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in base.state_dict().items())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(smoes_num_bins=3), r"SmoesQwen3VLMoeTextConfig.smoes_num_bins=3 does not divide num_experts=8"),
        (dict(smoes_ep_devices=4), r"smoes_ep_devices=4 does not divide smoes_num_bins=2"),
        (dict(smoes_score_type="js"), r"SmoesQwen3VLMoeTextConfig.smoes_score_type='js' is not one of"),
    ],
)
def test_bad_fields_fail_at_construction_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        smoes_config(**fields)


def test_a_qwen3_vl_moe_config_with_smoes_fields_is_an_smoes_config():
    base_config = Qwen3VLMoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **TOKEN_IDS).to_dict()
    base_config["text_config"].update(TINY_SMOES)
    fields = {key: value for key, value in base_config.items() if key not in ("model_type", "transformers_version")}
    config = SmoesQwen3VLMoeConfig(**fields)
    assert config.text_config.model_type == "smoes_qwen3_vl_moe_text"
    assert config.text_config.smoes_num_bins == 2 and config.text_config.smoes_score_type == "attention"


# --- conversion ----------------------------------------------------------------------------------------------------


def test_conversion_copies_every_tensor_and_keeps_logits_and_generation(base, base_folder):
    model, report = convert_qwen3_vl_moe_to_smoes(base_folder, num_bins=4)
    model = model.load()
    state, source_state = model.state_dict(), base.state_dict()
    assert all(torch.equal(state[key], tensor) and state[key].dtype == tensor.dtype
               for key, tensor in source_state.items())  # fmt: skip
    new = sorted(set(state) - set(source_state))
    assert len(new) == 3 * 5 + 1 and all(".mlp.smoes." in key or key.endswith("smoes_step") for key in new)
    source_tensors = len(load_file(base_folder / "model.safetensors"))
    assert report["accounting"] == {"copied": source_tensors, "smoes_buffers": len(new), "dropped": []}
    assert report["smoes"] == {"num_bins": 4, "score_type": "attention", "ep_devices": 4}
    assert report["max_abs_diff"] == 0.0
    model.set_experts_implementation("eager")
    batch = synthetic_image_text_batch(model.config, seed=3)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base(**batch).logits)
        generation = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(**batch, **generation), base.generate(**batch, **generation))


def test_conversion_refuses_an_incomplete_checkpoint(base_folder, tmp_path):
    folder = tmp_path / "incomplete"
    folder.mkdir()
    (folder / "config.json").write_text((base_folder / "config.json").read_text())
    tensors = load_file(base_folder / "model.safetensors")
    del tensors["model.language_model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not a complete Qwen3-VL-MoE checkpoint.*layers\.1\.mlp\.experts\.down_proj"):
        convert_qwen3_vl_moe_to_smoes(folder)


def test_command_picks_the_qwen3_vl_moe_host_from_the_source(base_folder, tmp_path):
    out = tmp_path / "converted"
    # the command's entry point in this process: a fresh interpreter adds seconds of imports and checks nothing more
    assert main(["convert", "--to", "smoes", "--from", str(base_folder), "--out", str(out), "--num-bins", "2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "smoes_qwen3_vl_moe"
    assert config["text_config"]["smoes_score_type"] == "attention" and config["text_config"]["smoes_num_bins"] == 2
    assert json.loads((out / "moezoo.json").read_text())["converter"] == "smoes-qwen3_vl_moe"
    assert (out / "processor_config.json").is_file()


# --- training ------------------------------------------------------------------------------------------------------


def test_train_smoes_runs_on_the_qwen3_vl_moe_host(tmp_path):
    model = create_from_preset("tiny-smoes-qwen3-vl-moe", tmp_path / "model")
    data = write_shape_captions(tmp_path / "data", 4)
    options = smoes_training.SmoesTrainingOptions(steps=2, batch_size=2, learning_rate=1e-3, logging_steps=1)
    smoes_training.train_smoes(model, data, tmp_path / "trained", options)
    trained = load_file(tmp_path / "trained" / "model.safetensors")
    assert int(trained["model.language_model.smoes_step"]) == 2
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["model_type"] == "smoes_qwen3_vl_moe"
    msi = json.loads((tmp_path / "trained" / "smoes_msi.json").read_text())
    assert len(msi["msi_per_layer"]) == 4
