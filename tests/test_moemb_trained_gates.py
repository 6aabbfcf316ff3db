"""MoEMB's trained efficiency gates (spec moemb.md §3.0 decision head, §3.1 pruner, §3.4 skip gate, §3.7 AdaMoE,
§3.10 layer skip, §3.12 combined budgets; §10 D-18/21/23): each gate at its initialisation equals the base model
where the spec says it must, its gradients reach only its own parameters, a few optimizer steps move its realised
rate toward its target, every decision is per sample, the masked pruner mixers equal the stock ones at keep 1, the
GRPO-facing API replays its actions, the saved config round-trips, the FLOPs report follows the realised actions,
and bad options are named."""

import argparse
import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.configuration.moemb_gates import GateModules
from moezoo.evaluation.moemb import add_eval_arguments, run_eval
from moezoo.hub.export import export_folder
from moezoo.modeling.moemb import MoEmbForEmbedding, controlled_gates
from moezoo.modeling.moemb_adaptive.gates import GateControl, attach_gate_modules, null_expert_slots
from moezoo.modeling.moemb_adaptive.trained import masked_attention, masked_gated_delta_net
from moezoo.modeling.moemb_flops import TokenDecisions, TokenLayerFlops, logical_flops
from moezoo.processors.moemb import MoEmbProcessor
from moezoo.training.moemb import MoEmbTrainer, add_train_arguments, run_train
from moezoo.training.moemb_adaptive import (
    RECIPES,
    AdaptiveRecipeOptions,
    GateRecipeTrainer,
    GateTraining,
    recipe_trainer,
)
from moezoo.training.moemb_synthetic import ShapeRetrieval

import test_moemb_adaptive as adaptive_tests
from conftest import exported_moemb_outputs
from test_moemb_adaptive import batch, item


LAYERS = TINY_MOEMB["text_config"]["num_hidden_layers"]
ALL_GATES = dict(efficiency_head="grpo", null_experts=8, layer_skip=True, token_pruner=True)
MASKED = {"execution": "masked"}


def make_model(gates: dict | None = None) -> MoEmbForEmbedding:
    """The adaptive tests' tiny model (decisive routers); `gates` added as a training recipe adds them."""
    model = adaptive_tests.make_model()
    if gates:
        model.config.gates = model.config.text_config.gates = GateModules.from_dict(gates).to_dict()
        attach_gate_modules(model.model.language_model, model.config.text_config)
    return model


ITEMS = (item(14, (2, 10), 0), item(11, (1, 6), 1), item(9, (1, 7), 2))


@pytest.fixture(scope="module")
def base():
    return make_model()


@pytest.fixture(scope="module")
def inputs():
    return batch(*ITEMS)


@pytest.fixture(scope="module")
def randomised():
    """Every gate with random weights, so that every decision goes both ways somewhere."""
    model = make_model(ALL_GATES)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(key in name for key in ("efficiency_head", "null_router", "skip_gate", "token_pruner")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2.0)
    pruner = model.model.language_model.token_pruner  # centred on these inputs, so that it keeps about half
    scores = []
    hook = pruner.register_forward_hook(lambda module, args, output: scores.append(output[..., 0] - output[..., 1]))
    with torch.no_grad():
        model(**batch(*ITEMS), adaptive={"token_pruning": "learned"})
        pruner[2].bias[0] -= scores[0].median()
    hook.remove()
    return model


# --- step 0 ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gates, settings", [
    (dict(null_experts=8), dict(top_k="null_experts")),  # W_null = 0, b = -8: no null expert is selected
    (dict(efficiency_head="skip_gate"), dict(expert_skip="learned")),  # p_skip ≈ 0.018 < 0.5
    (dict(efficiency_head="grpo"), dict(efficiency_policy="greedy")),  # ROUTE is the most likely action
    (dict(layer_skip=True), dict(layer_skip="learned")),  # q = σ(-4) < 0.5
])  # fmt: skip
def test_each_trained_action_equals_the_base_model_at_its_initialisation(base, inputs, gates, settings):
    model = make_model(gates)
    full = base(**inputs, adaptive=MASKED | {"top_k": "uniform", "experts_per_token": 4}).embeddings
    out = model(**inputs, adaptive=MASKED | settings)
    torch.testing.assert_close(out.embeddings, full, atol=1e-6, rtol=0)
    assert out.adaptive.flops_saving == pytest.approx(0.0, abs=1e-12)


def test_soft_fade_at_initialisation_stays_within_tolerance_and_null_bias_minus_inf_is_exact(base, inputs):
    model = make_model(dict(efficiency_head="skip_gate"))
    full = base(**inputs).embeddings
    with controlled_gates(model, GateControl(train=True)) as control:
        faded = model(**inputs, adaptive=MASKED | {"expert_skip": "learned"}).embeddings
    p_skip = torch.cat([p[c] for p, c in zip(control.record.skip_probability, control.record.skip_candidates)])
    torch.testing.assert_close(p_skip, torch.full_like(p_skip, torch.sigmoid(torch.tensor(-4.0)).item()))
    assert (faded * full).sum(-1).min() > 0.99  # the routed experts scaled by 1 - 0.018
    null = make_model(dict(null_experts=8, null_bias=-1e30))
    torch.testing.assert_close(null(**inputs, adaptive=MASKED | {"top_k": "null_experts"}).embeddings, full,
                               atol=1e-6, rtol=0)  # fmt: skip


def test_null_experts_take_the_lowest_physical_slots_of_the_joint_top_k():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    index = torch.tensor([[0, 1, 2, 3]])
    kept = null_expert_slots(logits, index, torch.tensor([[2.5, -9.0]]))
    assert kept.tolist() == [[True, True, True, False]]  # joint top-4: 4, 3, the null 2.5, 2
    assert null_expert_slots(logits, index, torch.tensor([[-9.0, -9.0]])).all()


# --- masked pruner semantics -----------------------------------------------------------------------------------------


def test_masked_mixers_at_keep_one_equal_the_stock_layers_and_a_zero_key_is_a_removed_key(base, inputs):
    text = base.model.language_model
    hidden = torch.randn(3, 14, 64, generator=torch.Generator().manual_seed(0))
    padding = inputs["attention_mask"]
    positions = text.rotary_emb(hidden, torch.arange(14)[None].expand(3, 3, -1))
    attention = text.layers[3].self_attn
    mask = text.layer_masks(hidden, padding, None)["full_attention"]
    stock, _ = attention(hidden, position_embeddings=positions, attention_mask=mask)
    ones = torch.ones(3, 14)
    real = padding.bool()
    torch.testing.assert_close(masked_attention(attention, hidden, positions, padding, ones)[real], stock[real],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    gdn = text.layers[0].linear_attn
    stock = gdn(hidden, attention_mask=padding)
    torch.testing.assert_close(masked_gated_delta_net(gdn, hidden, padding, ones)[real], stock[real], atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    keep = ones.clone()
    keep[0, 4] = 0  # key 4 of row 0 removed
    kept = [i for i in range(14) if i != 4]
    short = (hidden[:1, kept], tuple(part[:1, kept] for part in positions))
    removed = masked_attention(attention, *short, None, torch.ones(1, 13))
    torch.testing.assert_close(masked_attention(attention, hidden, positions, padding, keep)[0, kept], removed[0],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


# --- gradients and learning ------------------------------------------------------------------------------------------


def recipe_model(recipe: str, **options):
    torch.manual_seed(0)
    model = make_model()
    training = GateTraining(AdaptiveRecipeOptions(recipe=recipe, budget_warmup=0.0, budget_ramp=0.0, **options))
    training.add_gates(model)
    model.requires_grad_(False)
    training.set_trainable(model)
    return model, training


GATE_MARKERS = {"token_pruner": "token_pruner", "skip_gate": "efficiency_head", "adamoe": "null_router",
                "layer_skip": "skip_gate"}  # fmt: skip


@pytest.mark.parametrize("recipe", list(GATE_MARKERS))
def test_gradients_reach_only_the_recipe_gates(recipe, inputs):
    model, training = recipe_model(recipe)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(GATE_MARKERS[recipe] in name for name in trainable), trainable
    embeddings, record = training.embed(model.train(), inputs, step=1, total=2)
    rates = training.rates([record])
    loss = embeddings.sum() + training.budget_loss([record], rates, step=1, total=2, active=RECIPES[recipe].actions)
    loss.backward()
    gradients = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert gradients == trainable, trainable - gradients  # every gate parameter, and nothing else
    assert all(p.grad is None for name, p in model.named_parameters() if "mlp.gate." in name)  # physical rows frozen


@pytest.mark.parametrize("recipe, key, options, moves", [
    ("token_pruner", "soft/keep", dict(keep_target=0.1), lambda before, after: after < before - 0.05),
    ("skip_gate", "soft/skip", dict(budget_weight=1.0), lambda before, after: after > before + 0.05),
    ("layer_skip", "soft/layer", dict(layer_skip_target=0.5), lambda before, after: after > before + 0.2),
    ("adamoe", "rate/physical_experts", dict(load_balance_weights=(1.0, 1.0)), lambda before, after: after < before),
])  # fmt: skip
def test_a_few_steps_on_the_budget_move_the_rate_toward_its_target(recipe, key, options, moves, inputs):
    model, training = recipe_model(recipe, **options)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=0.3 if recipe != "adamoe" else 1.0)
    history = []
    for step in range(12):
        _, record = training.embed(model.train(), inputs, step=step, total=12)
        rates = training.rates([record])
        history.append(float(rates[key]))
        optimizer.zero_grad()
        training.budget_loss([record], rates, step=0, total=12, active=RECIPES[recipe].actions).backward()
        optimizer.step()
    assert moves(history[0], history[-1]), history


# --- per-sample decisions, export, FLOPs -----------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [
    dict(token_pruning="learned"),
    dict(token_pruning="learned", pruner_decision="budget", keep_ratio=0.5),
    dict(expert_skip="learned"),
    dict(top_k="null_experts"),
    dict(layer_skip="learned"),
    dict(efficiency_policy="greedy"),
    dict(efficiency_policy="greedy", top_k="null_experts", layer_skip="learned", token_pruning="learned"),
])  # fmt: skip
def test_every_decision_is_per_sample(randomised, settings):
    together = randomised(**batch(*ITEMS), adaptive=settings)
    assert together.adaptive.flops_saving > 0, settings  # the gates do decide something
    masked = randomised(**batch(*ITEMS), adaptive=settings | MASKED)  # packed execution (the default) equals it
    torch.testing.assert_close(masked.embeddings, together.embeddings, atol=2e-5, rtol=0)
    assert masked.adaptive.flops_saving == pytest.approx(together.adaptive.flops_saving, abs=1e-9)
    for row, entry in enumerate(ITEMS):
        alone = randomised(**batch(entry), adaptive=settings)
        torch.testing.assert_close(alone.embeddings[0], together.embeddings[row], atol=2e-5, rtol=0)
        assert float(alone.adaptive.sample_flops_saving[0]) == pytest.approx(
            float(together.adaptive.sample_flops_saving[row]), abs=1e-9
        )


SKIP_BLOCKS = (3, 4, 5)  # attention, then two Gated DeltaNet blocks (4: GDN-β's pruning block)


@pytest.fixture(scope="module")
def skipping(inputs):
    """Layer-skip gates whose decisions split the items: at block 3 and 5 one item skips, at block 4 two do."""
    model = make_model(dict(layer_skip=True, layer_skip_blocks=list(SKIP_BLOCKS)))
    layers = model.model.language_model.layers
    generator = torch.Generator().manual_seed(3)
    logits = {}
    for block, skipping_items in zip(SKIP_BLOCKS, (1, 2, 1)):
        gate = layers[block].skip_gate
        hook = gate.register_forward_hook(lambda module, args, output: logits.__setitem__("gate", output[:, 0]))
        with torch.no_grad():
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=generator))
            model(**inputs, adaptive={"layer_skip": "learned"})
            ranked = logits["gate"].sort().values
            cut = len(ITEMS) - skipping_items
            gate.bias -= (ranked[cut - 1] + ranked[cut]) / 2
        hook.remove()
    return model


def block_rows(model, call) -> tuple[object, dict]:
    """`call()`'s result and the rows (tokens) each decoder block received."""
    rows = {}
    layers = model.model.language_model.layers
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, index=index: rows.__setitem__(index, args[0].shape[:2]))
        for index, layer in enumerate(layers)
    ]
    try:
        return call(), rows
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("settings", [
    {},
    dict(token_pruning="gdn_beta", keep_ratio=0.5),  # decides at block 4, which two items bypass
    dict(expert_skip="beta_rank", skip_fraction=0.3, top_k="uniform", experts_per_token=2),
])  # fmt: skip
def test_packed_layer_skip_leaves_the_bypassing_samples_out_of_the_block(skipping, inputs, settings):
    settings = {"layer_skip": "learned"} | settings
    packed, rows = block_rows(skipping, lambda: skipping(**inputs, adaptive=settings))
    # The reference: masked execution computes every block on the whole batch and discards the bypassers' result.
    masked, masked_rows = block_rows(skipping, lambda: skipping(**inputs, adaptive=settings | MASKED))
    skipped = packed.adaptive.layer_skipped
    assert skipped[:, list(SKIP_BLOCKS)].sum(0).tolist() == [1.0, 2.0, 1.0]
    torch.testing.assert_close(packed.embeddings, masked.embeddings, atol=1e-5, rtol=0)
    assert packed.adaptive.flops_saving == pytest.approx(masked.adaptive.flops_saving, abs=1e-9)
    assert torch.equal(packed.adaptive.layer_skipped, masked.adaptive.layer_skipped)
    assert all(masked_rows[block] == inputs["input_ids"].shape for block in SKIP_BLOCKS)
    if settings.get("token_pruning"):
        return  # tokens left after block 4: the counts below hold before the pruning
    lengths = inputs["attention_mask"].sum(1)
    for block in range(LAYERS):
        running = skipped[:, block] == 0
        assert rows[block] == (1, int(lengths[running].sum())), block


def test_saved_gates_and_settings_round_trip_and_are_honoured(randomised, inputs, tmp_path):
    model = copy.deepcopy(randomised)
    model.config.adaptive = {"efficiency_policy": "greedy", "layer_skip": "learned"}
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["gates"] == GateModules.from_dict(ALL_GATES).to_dict() and saved["adaptive"] == model.config.adaptive
    loaded = MoEmbForEmbedding.from_pretrained(tmp_path).eval()
    out, expected = loaded(**inputs), model(**inputs)
    torch.testing.assert_close(out.embeddings, expected.embeddings)
    assert out.adaptive is not None and out.adaptive.flops_saving == pytest.approx(expected.adaptive.flops_saving)
    assert not torch.equal(loaded(**inputs, adaptive={}).embeddings, out.embeddings)


def test_flops_count_the_blocks_each_sample_bypasses(inputs):
    model = make_model(dict(layer_skip=True, layer_skip_blocks=[3, 5]))
    with torch.no_grad():
        model.model.language_model.layers[3].skip_gate.bias.fill_(8.0)  # every sample skips block 3
    out = model(**inputs, adaptive=MASKED | {"layer_skip": "learned"})
    assert out.adaptive.layer_skipped[:, 3].tolist() == [1.0, 1.0, 1.0] and out.adaptive.layer_skipped[:, 5].sum() == 0
    costs = TokenLayerFlops.from_config(model.config)
    report = out.adaptive
    lengths = inputs["attention_mask"].sum(1).double()
    mixer = costs.attention_projections  # block 3 is a full-attention layer
    block = mixer + costs.shared_expert + costs.experts_per_token * costs.routed_expert + costs.router
    context = (costs.attention_per_key * lengths * (lengths + 1) / 2).sum()
    saved = block * lengths.sum() + context
    assert report.full_flops.total - report.flops.total == pytest.approx(float(saved), rel=1e-9)
    assert bool((report.sample_flops_saving > 0).all())
    greedy = make_model(dict(efficiency_head="grpo"))
    with torch.no_grad():
        for layer in greedy.model.language_model.layers:
            layer.mlp.efficiency_head.bias.copy_(torch.tensor([0.0, 5.0, -9.0]))  # every token SKIPs
    skipped = greedy(**inputs, adaptive=MASKED | {"efficiency_policy": "greedy"}).adaptive
    decisions = inputs["attention_mask"].sum() - inputs["attention_mask"].shape[0]  # all but the pooled tokens
    assert skipped.decisions.skip.sum() == decisions * LAYERS and skipped.flops_saving > 0


# --- the API GRPO builds on ------------------------------------------------------------------------------------------


def test_sampled_actions_replay_with_the_same_log_probabilities(randomised, inputs):
    sample = GateControl(policy="sample", generator=torch.Generator().manual_seed(0))
    with controlled_gates(randomised, sample):
        first = randomised(**inputs, adaptive=MASKED)
    record = sample.record
    assert set(record.actions.unique().tolist()) <= {-1, 0, 1, 2} and (record.actions == 2).any()
    assert record.decisions.sum() == (record.actions >= 0).sum()
    replay = GateControl(policy="forced", actions=record.actions)
    heads = [p for name, p in randomised.named_parameters() if "efficiency_head" in name]
    randomised.requires_grad_(False)  # GRPO trains the heads only
    for parameter in heads:
        parameter.requires_grad_(True)
    with controlled_gates(randomised, replay):
        second = randomised(**inputs, adaptive=MASKED)
    randomised.requires_grad_(True)
    torch.testing.assert_close(second.embeddings, first.embeddings)
    torch.testing.assert_close(replay.record.log_prob_sum, record.log_prob_sum)
    assert torch.equal(replay.record.actions, record.actions)
    replay.record.log_prob_sum.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads)
    randomised.zero_grad(set_to_none=True)
    pooled = inputs["attention_mask"].sum(1) - 1
    assert (record.actions[torch.arange(3), pooled] == -1).all()  # the pooled token takes no decision


# --- the command, bad options ----------------------------------------------------------------------------------------


def test_train_command_runs_a_combined_recipe_and_writes_its_rates(tiny_moemb, tmp_path):
    data = ShapeRetrieval().write_mmeb_training(tmp_path / "mmeb", 8, torch.Generator().manual_seed(3))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args([
        "--model", str(tiny_moemb), "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "2",
        "--batch-size", "4", "--lora-r", "2", "--lora-alpha", "4", "--logging-steps", "1",
        "--adaptive-recipe", "combined_simultaneous", "--drop-target", "0.5",
    ])  # fmt: skip
    assert run_train(args) == 0
    out = tmp_path / "out"
    assert (out / "adaptive_rates.png").is_file()
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["adaptive_recipe"] == "combined_simultaneous" and "rate/token_drop" in training
    model = MoEmbForEmbedding.from_pretrained(out)
    assert model.config.adaptive == RECIPES["combined_simultaneous"].inference
    assert model.model.language_model.token_pruner is not None


@pytest.mark.parametrize("options, message", [
    (dict(keep_target=1.0), "keep_target=1.0 must lie in \\[0, 1\\)"),
    (dict(flops_budget=-0.1), "flops_budget=-0.1 must lie in \\[0, 1\\)"),
    (dict(recipe="early_exit"), "--adaptive-recipe 'early_exit' is not one of"),
    (dict(null_experts=0), "null_experts=0 must be a positive integer"),
])  # fmt: skip
def test_bad_recipe_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveRecipeOptions(**options)


def test_bad_gates_and_missing_modules_name_the_option(base, inputs):
    config = copy.deepcopy(TINY_MOEMB)
    with pytest.raises(ValueError, match="gates.pruner_layer=7 must be a block from 0 to 6"):
        MoEmbConfig(**config, gates={"token_pruner": True, "pruner_layer": 7})
    with pytest.raises(ValueError, match="gates.efficiency_head='fast'"):
        MoEmbConfig(**config, gates={"efficiency_head": "fast"})
    with pytest.raises(ValueError, match="unknown fields \\['early_exit'\\]"):
        MoEmbConfig(**config, gates={"early_exit": True})
    with pytest.raises(ValueError, match="adaptive.expert_skip='learned' needs the trained module gates.efficiency_head"):
        MoEmbConfig(**config, adaptive={"expert_skip": "learned"})
    with pytest.raises(ValueError, match="model\\(adaptive=...\\): adaptive.layer_skip='learned' needs"):
        base(**inputs, adaptive={"layer_skip": "learned"})
    with pytest.raises(ValueError, match="skip_threshold=1.5 must lie in \\[0, 1\\)"):
        MoEmbConfig(**config, gates={"efficiency_head": "skip_gate"},
                    adaptive={"expert_skip": "learned", "skip_threshold": 1.5})  # fmt: skip
    with pytest.raises(ValueError, match="moe_variant='modality' .* no efficiency_head"):
        GateModules(efficiency_head="grpo").validate(LAYERS, "modality")
    with pytest.raises(ValueError, match="gates.layer_skip: a model of 4 blocks has no block from 3 to L-2"):
        GateModules(layer_skip=True).validate(4, "native")
    with pytest.raises(ValueError, match="gates.layer_skip_blocks=\\[7\\] must list distinct blocks from 0 to 6"):
        GateModules(layer_skip=True, layer_skip_blocks=[7]).validate(LAYERS, "native")
    model = make_model(dict(token_pruner=True))
    with pytest.raises(ValueError, match="training the token pruner runs masked"):
        with controlled_gates(model, GateControl(train=True)):
            model(**inputs, adaptive={"token_pruning": "learned", "execution": "packed"})


def test_an_exported_folder_with_trained_gates_honours_them_without_moezoo(randomised, tiny_moemb, tmp_path):
    created, exported = tmp_path / "created", tmp_path / "exported"
    model = copy.deepcopy(randomised)
    model.config.adaptive = {"efficiency_policy": "greedy", "top_k": "null_experts", "layer_skip": "learned",
                             "token_pruning": "learned"}  # fmt: skip
    model.save_pretrained(created)
    MoEmbProcessor.from_pretrained(tiny_moemb).save_pretrained(created)
    export_folder(created, exported)
    inputs = batch(*ITEMS)
    with torch.no_grad():
        expected = model(**inputs)
    assert expected.adaptive.flops_saving > 0
    embeddings, flops_saving = exported_moemb_outputs(exported, inputs, tmp_path)
    torch.testing.assert_close(embeddings, expected.embeddings, atol=1e-6, rtol=0)
    assert round(flops_saving, 9) == round(float(expected.adaptive.flops_saving), 9)


def test_expected_flops_of_the_global_budget_follow_the_flops_model(inputs):
    """The differentiable E[FLOPs] / FLOPs_full of `combined_global` equals the logical FLOPs model (attention's
    context term aside) on the same skip and layer-skip probabilities."""
    model, training = recipe_model("combined_global")
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.mlp.efficiency_head.bias.copy_(torch.tensor([0.0, 0.3, float("-inf")]))
        model.model.language_model.layers[4].skip_gate.bias.fill_(0.5)
    _, record = training.embed(model.train(), inputs, step=0, total=1)
    record.keep_probability = torch.ones_like(record.keep_probability)  # the pruner aside: its own test above
    ratio = training.expected_flops_ratio(record)
    skip = torch.stack(record.skip_probability).t().detach()
    bypassed = torch.zeros_like(skip)
    for layer, q in record.layer_skip_probability.items():
        bypassed[:, layer] = q.detach()[record.token_segments]
    cu_seqlens = torch.nn.functional.pad(inputs["attention_mask"].sum(1).cumsum(0), (1, 0))
    adaptive = logical_flops(model.config, cu_seqlens, TokenDecisions(skip=skip.double(), layer_skip=bypassed.double()))
    full = logical_flops(model.config, cu_seqlens)
    expected = (adaptive.total - adaptive.attention_context) / (full.total - full.attention_context)
    assert 0 < float(ratio) < 1 and float(ratio) == pytest.approx(expected, rel=1e-5)


def test_alternating_and_sequential_schedules_pick_the_gate_that_trains():
    training = GateTraining(AdaptiveRecipeOptions(recipe="combined_sequential", drop_target=0.5, skip_target=0.2))
    trainer = SimpleNamespace(gate_training=training, sequential_stage=0, state=SimpleNamespace(global_step=4))
    assert GateRecipeTrainer.active_actions(trainer) == ("drop",)
    GateRecipeTrainer.advance_sequence(trainer, {"rate/token_drop": 0.4})
    assert GateRecipeTrainer.active_actions(trainer) == ("drop",)
    GateRecipeTrainer.advance_sequence(trainer, {"rate/token_drop": 0.55})
    assert GateRecipeTrainer.active_actions(trainer) == ("skip",)
    GateRecipeTrainer.advance_sequence(trainer, {"rate/expert_skip": 0.25})
    assert GateRecipeTrainer.active_actions(trainer) == ("layer",)
    trainer.gate_training = GateTraining(AdaptiveRecipeOptions(recipe="combined_alternating"))
    steps = [GateRecipeTrainer.active_actions(SimpleNamespace(gate_training=trainer.gate_training,
                                                               state=SimpleNamespace(global_step=step)))
             for step in range(4)]  # fmt: skip
    assert steps == [("drop",), ("skip",), ("layer",), ("drop",)]


def test_eval_command_takes_the_trained_actions(randomised, tiny_moemb, tmp_path, capsys):
    folder = tmp_path / "gated"
    randomised.save_pretrained(folder)
    MoEmbProcessor.from_pretrained(tiny_moemb).save_pretrained(folder)
    task = ShapeRetrieval().mmeb_eval_task("image_to_text", 3, 4, torch.Generator().manual_seed(0),
                                           tmp_path / "data" / "images")  # fmt: skip
    task.to_json(tmp_path / "data" / "image_to_text.jsonl")
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    common = ["--benchmark", "mmeb", "--data", str(tmp_path / "data"), "--json"]
    arguments = ["--model", str(folder), *common, "--action", "learned-prune", "--action", "layer-skip",
                 "greedy-policy", "null-experts", "--execution", "masked"]  # fmt: skip
    assert run_eval(parser.parse_args(arguments)) == 0
    rows = json.loads(capsys.readouterr().out)["table"]
    assert [row["actions"] for row in rows] == [
        "full compute", "learned-prune", "layer-skip + greedy-policy + null-experts"
    ]
    assert rows[1]["flops_saving"] > 0 and rows[2]["flops_saving"] > 0
    with pytest.raises(ValueError, match="--action: adaptive.expert_skip='learned' needs the trained module"):
        run_eval(parser.parse_args(["--model", str(tiny_moemb), *common, "--action", "learned-skip"]))


def test_the_pruner_gets_forty_times_the_learning_rate(tmp_path):
    model, training = recipe_model("token_pruner")
    args = TrainingArguments(tmp_path, learning_rate=1e-3, report_to=[], use_cpu=True)
    trainer = recipe_trainer(MoEmbTrainer)(model=model, args=args, gate_training=training, logit_scale=50.0)
    groups = {group["lr"]: len(group["params"]) for group in trainer.create_optimizer().param_groups}
    assert groups == {1e-3: 0, 4e-2: 4}  # the pruner's two linear layers (weights and biases) at 40x
