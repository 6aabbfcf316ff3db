"""SMoES on Qwen3.5-MoE against transformers' own `Qwen3_5MoeForConditionalGeneration` with the same weights (spec
smoes.md §5 E1-E3, §8), on the spec's tiny VLM (§4): 4 layers (Gated DeltaNet at 0 and 2, softmax attention at 1 and
3), 8 experts top-2, a 2-block vision tower."""

import copy

import pytest
import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

import moezoo.modeling.smoes.common as smoes_common
from moezoo.configuration.smoes import SmoesQwen3_5MoeConfig, SmoesQwen3_5MoeTextConfig
from moezoo.modeling.moe.smoes import TEXT, VISION, contiguous_bins, one_hot_scores
from moezoo.modeling.smoes import SmoesQwen3_5MoeForConditionalGeneration


TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, router_aux_loss_coef=0.001, max_position_embeddings=512, pad_token_id=0,
    eos_token_id=1,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
)  # fmt: skip
VISION_CONFIG = dict(
    depth=2, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
)  # fmt: skip
TOKEN_IDS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
TINY_SMOES = dict(smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=1.0, smoes_bal_coef=0.01)
SETTINGS = {
    "gaussian": dict(smoes_score_type="gaussian"),
    "attention": dict(smoes_score_type="attention"),
    "hard": dict(smoes_score_type="hard"),
    "fixed-intra-bin-mean": dict(smoes_binning="fixed", smoes_bal_mode="intra_bin", smoes_layer_reduction="mean"),
}


def smoes_config(**smoes_fields) -> SmoesQwen3_5MoeConfig:
    return SmoesQwen3_5MoeConfig(
        text_config={**TEXT_CONFIG, **TINY_SMOES, **smoes_fields}, vision_config=VISION_CONFIG, **TOKEN_IDS
    )


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(
        Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **TOKEN_IDS)
    )
    model.set_experts_implementation("eager")
    return model.eval()


def smoes_from(base, **smoes_fields) -> SmoesQwen3_5MoeForConditionalGeneration:
    """The SMoES model with the base's weights; only its SMoES buffers are new."""
    model = SmoesQwen3_5MoeForConditionalGeneration(smoes_config(**smoes_fields))
    model.set_experts_implementation("eager")
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and all(".smoes." in key or key.endswith("smoes_step") for key in missing)
    return model.eval()


@pytest.fixture(scope="module")
def inputs():
    """Two prompts of vision_start + 4 image tokens + vision_end + text; the second left-padded by two tokens."""
    ids = torch.tensor([[1, 2, 3, 502, 500, 500, 500, 500, 503, 4, 5, 6, 7], [0, 0, 9, 502, 500, 500, 500, 500, 503, 8, 7, 6, 5]])
    attention_mask = (torch.arange(13) >= torch.tensor([[0], [2]])).long()
    generator = torch.Generator().manual_seed(1)
    return dict(
        input_ids=ids, attention_mask=attention_mask, mm_token_type_ids=(ids == 500).int(),
        pixel_values=torch.randn(32, 96, generator=generator), image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
    )  # fmt: skip


def buffers_of(model) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "smoes" in name}


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
    assert model.model.language_model.smoes_step.item() == 2
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
    """L = L_task + alpha_bal * sum_l N_B sum_k sum_{e in B_k} f_e P_e, with f_e the fraction of valid tokens whose
    top-k holds e and P_e the mean softmax gate, per layer (spec §2.4), from the base's own router logits."""
    model = smoes_from(base, smoes_mi_coef=0.0, smoes_bal_coef=0.01).train()
    output = model(**inputs, labels=inputs["input_ids"])
    base_model = copy.deepcopy(base).train()
    reference = base_model(**inputs, labels=inputs["input_ids"], output_router_logits=True)
    task_loss = base_model(**inputs, labels=inputs["input_ids"]).loss  # without the base's auxiliary loss
    valid = inputs["attention_mask"].reshape(-1).bool()
    balance = 0.0
    for logits in reference.router_logits:
        gates = torch.softmax(logits.float(), dim=-1)[valid]
        dispatch = torch.zeros(8).index_add_(0, gates.topk(2).indices.reshape(-1), torch.ones(valid.sum() * 2))
        balance = balance + 4 * (dispatch / valid.sum() * gates.mean(dim=0)).sum()  # N_B = 8 experts / 2 bins
    torch.testing.assert_close(output.smoes_bal_loss, balance)
    torch.testing.assert_close(output.loss, task_loss + 0.01 * balance)
    assert output.smoes_mi_loss.item() <= 0.0 and output.smoes_mi.shape == (4,)
    assert torch.equal(torch.stack(output.smoes_bins), contiguous_bins(8, 2).expand(4, -1))


# --- training-time bookkeeping ---------------------------------------------------------------------------------------


def test_buffers_change_only_in_training_forwards(base, inputs):
    model = smoes_from(base, smoes_score_type="gaussian")
    initial = buffers_of(model)
    with torch.no_grad():
        model(**inputs, labels=inputs["input_ids"])
    assert all(torch.equal(initial[name], buffer) for name, buffer in buffers_of(model).items())

    model.train()
    model(**inputs, labels=inputs["input_ids"])
    language_model = model.model.language_model
    assert language_model.smoes_step.item() == 1
    for state in language_model.smoes_states:
        assert state.gauss_initialized.all() and state.expert_counts_ema.sum() > 0
        assert torch.bincount(state.bins, minlength=2).tolist() == [4, 4]
        # Each valid token's scores sum to 1 over the modalities and fill k = 2 slots; padding is not counted.
        assert state.expert_counts_ema.sum().item() == pytest.approx((1 - 0.99) * 2 * int(inputs["attention_mask"].sum()))


def recorded_scores(model, inputs, monkeypatch) -> dict[int, torch.Tensor]:
    """The (B, T, 2) scores each MoE layer's router saw in one training forward, by layer."""
    recorded = {}

    def keep_scores(config, states, runtime, *args, **kwargs):
        recorded.update({position: runtime.layer_scores[state] for position, state in enumerate(states)})
        return apply_smoes(config, states, runtime, *args, **kwargs)

    apply_smoes = smoes_common.apply_smoes
    monkeypatch.setattr(smoes_common, "apply_smoes", keep_scores)
    model.train()(**inputs)
    monkeypatch.undo()
    return recorded


def test_attention_scores_start_from_the_hard_labels_and_are_carried_through_linear_attention(base, inputs, monkeypatch):
    recorded = recorded_scores(smoes_from(base, smoes_score_type="attention"), inputs, monkeypatch)
    valid = inputs["attention_mask"].bool()
    hard = one_hot_scores((inputs["mm_token_type_ids"] > 0).long())
    assert not any(scores.requires_grad for scores in recorded.values())
    assert torch.equal(recorded[0][valid], hard[valid])  # layer 0 is Gated DeltaNet: M^(1) = M^(0)
    assert not torch.allclose(recorded[1][valid], hard[valid])  # softmax attention mixes the modalities
    assert torch.equal(recorded[2], recorded[1])  # Gated DeltaNet again: carried unchanged
    for scores in recorded.values():
        torch.testing.assert_close(scores[valid].sum(-1), torch.ones(int(valid.sum())))
    image_tokens = (inputs["mm_token_type_ids"] > 0) & valid
    assert recorded[3][image_tokens][:, VISION].mean() < recorded[1][image_tokens][:, VISION].mean() < 1.0
    # Causal attention: the text before the image never sees it.
    assert torch.equal(recorded[3][0, :4, VISION], torch.zeros(4))


def test_gaussian_scores_are_the_hard_labels_until_the_first_update(base, inputs, monkeypatch):
    model = smoes_from(base, smoes_score_type="gaussian")
    valid = inputs["attention_mask"].bool()
    hard = one_hot_scores((inputs["mm_token_type_ids"] > 0).long())
    first = recorded_scores(model, inputs, monkeypatch)
    assert all(torch.equal(scores[valid], hard[valid]) for scores in first.values())
    second = recorded_scores(model, inputs, monkeypatch)
    for scores in second.values():
        assert not torch.equal(scores[valid], hard[valid]) and not scores.requires_grad
        torch.testing.assert_close(scores[valid].sum(-1), torch.ones(int(valid.sum())))


def test_text_only_sequences_keep_no_vision_score(base, monkeypatch):
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [4, 3, 2, 1, 8, 7]])
    model = smoes_from(base, smoes_score_type="attention")
    recorded = recorded_scores(model, dict(input_ids=ids, attention_mask=torch.ones_like(ids)), monkeypatch)
    assert all(torch.equal(scores[..., VISION], torch.zeros(2, 6)) for scores in recorded.values())


def test_mi_loss_alone_trains_every_router_and_nothing_else_of_smoes(base, inputs):
    model = smoes_from(base, smoes_bal_coef=0.0).train()
    output = model(**inputs)  # no labels: the loss is the SMoES term itself
    assert output.loss is None
    output.aux_loss.backward()
    for layer in model.model.language_model.layers:
        gradient = layer.mlp.gate.weight.grad
        assert gradient is not None and torch.isfinite(gradient).all() and gradient.abs().sum() > 0
    assert not any(buffer.requires_grad for buffer in buffers_of(model).values())


def test_gradient_checkpointing_gives_the_same_gradients_and_counts_once(base, inputs):
    gradients, buffers = [], []
    for checkpointing in (False, True):
        model = smoes_from(base, smoes_score_type="attention").train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        gradients.append(torch.stack([layer.mlp.gate.weight.grad for layer in model.model.language_model.layers]))
        buffers.append(buffers_of(model))
    torch.testing.assert_close(gradients[1], gradients[0])
    assert buffers[1]["model.language_model.smoes_step"].item() == 1
    for name, buffer in buffers[0].items():
        torch.testing.assert_close(buffers[1][name], buffer)

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant gradient checkpointing"):
        model(**inputs, labels=inputs["input_ids"])


def test_frozen_routers_and_unknown_modalities_are_refused_in_training(base, inputs):
    model = smoes_from(base).train()
    for layer in model.model.language_model.layers:
        layer.mlp.gate.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"smoes_mi_coef=1.0 and smoes_bal_coef=0.01 train the routers"):
        model(**inputs, labels=inputs["input_ids"])
    statistics_only = smoes_from(base, smoes_mi_coef=0.0, smoes_bal_coef=0.0).train()
    for layer in statistics_only.model.language_model.layers:
        layer.mlp.gate.weight.requires_grad_(False)
    statistics_only(**inputs)
    assert statistics_only.model.language_model.smoes_step.item() == 1

    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        smoes_from(base).train()(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])


def test_save_and_load_keep_the_buffers(base, inputs, tmp_path):
    model = smoes_from(base).train()
    model(**inputs, labels=inputs["input_ids"])
    model.save_pretrained(tmp_path)
    reloaded = SmoesQwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path)
    assert isinstance(reloaded.config.text_config, SmoesQwen3_5MoeTextConfig)
    assert reloaded.config.text_config.smoes_num_bins == 2
    saved = buffers_of(model)
    assert saved["model.language_model.smoes_step"].item() == 1
    assert all(torch.equal(buffer, saved[name]) for name, buffer in buffers_of(reloaded).items())


def test_a_qwen3_5_moe_checkpoint_loads_with_only_the_smoes_buffers_new(base, inputs, tmp_path):
    """transformers writes Qwen3.5-MoE experts as per-expert 2D tensors; the SMoES classes load them through the same
    conversion to fused experts, and save in that layout again."""
    base.save_pretrained(tmp_path / "base")
    model = SmoesQwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "base", config=smoes_config())
    model.set_experts_implementation("eager")
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in base.state_dict().items())
    state = model.model.language_model.smoes_states[0]
    assert torch.equal(state.gauss_var, torch.ones(2, 64)) and torch.equal(state.bins, contiguous_bins(8, 2))
    with torch.no_grad():  # another load path can change the CPU kernels' summation order, not the weights
        torch.testing.assert_close(model.eval()(**inputs).logits, base(**inputs).logits, atol=1e-6, rtol=0)


# --- configuration -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(smoes_num_bins=3), r"SmoesQwen3_5MoeTextConfig.smoes_num_bins=3 does not divide num_experts=8"),
        (dict(smoes_ep_devices=4), r"smoes_ep_devices=4 does not divide smoes_num_bins=2"),
        (dict(smoes_score_type="js"), r"smoes_score_type='js' is not one of 'attention', 'gaussian', 'hard'"),
        (dict(smoes_binning="sorted"), r"smoes_binning='sorted'"),
        (dict(smoes_bal_mode="local"), r"smoes_bal_mode='local'"),
        (dict(smoes_layer_reduction="max"), r"smoes_layer_reduction='max'"),
        (dict(smoes_linear_attn_mixing="gated_delta"), r"smoes_linear_attn_mixing='gated_delta'"),
        (dict(smoes_ema_beta=1.0), r"smoes_ema_beta must be a probability"),
        (dict(smoes_mi_coef=-1.0), r"smoes_mi_coef must be a number >= 0"),
        (dict(smoes_gauss_tau_scale=0.0), r"smoes_gauss_tau_scale must be a number > 0"),
        (dict(smoes_rebin_interval=0), r"smoes_rebin_interval must be a positive integer"),
        (dict(smoes_freeze_bins_after=-1), r"smoes_freeze_bins_after must be None or an integer >= 0"),
        (dict(smoes_vision_token_types=[]), r"smoes_vision_token_types must be a non-empty list"),
        (dict(smoes_enabled="false"), r"smoes_enabled must be True or False"),
        (
            dict(smoes_score_type="attention", layer_types=["linear_attention"] * 4),
            r"smoes_score_type='attention' needs a softmax-attention layer",
        ),
    ],
)
def test_bad_fields_fail_at_construction_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        smoes_config(**fields)


def test_host_checks_of_the_reusable_fields():
    """What a host passes to `validate_smoes_fields`: group-limited routing and frozen routers are refused."""
    config = SmoesQwen3_5MoeTextConfig(**TEXT_CONFIG, **TINY_SMOES)
    with pytest.raises(ValueError, match="invariant to permuting the experts.*2 contiguous expert groups"):
        config.validate_smoes_fields("num_experts", softmax_attention_layers=2, expert_groups=2)
    with pytest.raises(ValueError, match="smoes_mi_coef=1.0 and smoes_bal_coef=0.01 train the routers"):
        config.validate_smoes_fields("num_experts", softmax_attention_layers=2, routers_trainable=False)


def test_a_qwen3_5_moe_config_with_smoes_fields_is_an_smoes_config():
    base_config = Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **TOKEN_IDS).to_dict()
    base_config["text_config"].update(TINY_SMOES)
    fields = {key: value for key, value in base_config.items() if key not in ("model_type", "transformers_version")}
    config = SmoesQwen3_5MoeConfig(**fields)
    assert config.text_config.model_type == "smoes_qwen3_5_moe_text"
    assert config.text_config.smoes_num_bins == 2 and config.text_config.smoes_score_type == "gaussian"
