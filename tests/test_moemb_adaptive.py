"""MoEMB's inference-time adaptive computation (spec moemb.md §3.3, §3.5-3.9, §3.12, §10 D-17/19/20, E-26): each
action's choice of tokens and slots against a hand computation, the settings that keep everything being exact,
batch independence, the MoDES frontier search against brute force, Otsu against a direct computation, the FLOPs
report against the realised rates, the export, and bad options."""

import copy
import itertools
import json
import math

import pytest
import torch

from moezoo.cli import main
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.modeling.moemb_adaptive import calibrate_modes, frontier_search
from moezoo.modeling.moemb_adaptive.routing import modes_slots, threshold_slots, uniform_top_k
from moezoo.modeling.moemb_adaptive.selection import keep_highest, lowest_fraction, otsu_split, otsu_threshold
from moezoo.modeling.moemb_flops import logical_flops

from conftest import exported_moemb_outputs


EMB = TINY_MOEMB["emb_token_id"]
LAYERS = TINY_MOEMB["text_config"]["num_hidden_layers"]
TOP_K = TINY_MOEMB["text_config"]["num_experts_per_tok"]
MODES = dict(top_k="modes", modes_thresholds={"text": 0.2, "visual": 0.3}, modes_layer_scales=[[1.0, 1.2]] * LAYERS)
ACTIONS = {
    "gdn-prune": dict(token_pruning="gdn_beta", keep_ratio=0.5),
    "beta-rank": dict(expert_skip="beta_rank", skip_fraction=0.3),
    "beta-threshold": dict(expert_skip="beta_threshold", beta_threshold=0.5),
    "otsu-beta": dict(expert_skip="otsu_beta", otsu_min_cv=0.0),
    "otsu-logit": dict(expert_skip="otsu_router_logit"),
    "top-k": dict(top_k="uniform", experts_per_token=2),
    "modes": MODES,
    "threshold": dict(top_k="threshold", score_threshold=0.3, min_experts_per_token=1),
    "modes+gdn-prune": dict(MODES, token_pruning="gdn_beta", keep_ratio=0.5),
}


def make_model(**overrides) -> MoEmbForEmbedding:
    torch.manual_seed(0)
    model = MoEmbForEmbedding(MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | overrides))).eval()
    with torch.no_grad():  # decisive routers (the initial std of 0.02 routes almost uniformly)
        for layer in model.model.language_model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def model():
    return make_model()


def item(length: int, visual: tuple[int, int], seed: int) -> dict:
    """One item: random text ids ending in <emb>, the tokens `visual[0]:visual[1]` typed as image tokens."""
    ids = torch.randint(1, 120, (length,), generator=torch.Generator().manual_seed(seed))
    ids[-1] = EMB
    types = torch.zeros(length, dtype=torch.long)
    types[visual[0] : visual[1]] = 1
    return {"input_ids": ids, "mm_token_type_ids": types}


def batch(*items: dict, left_padding: bool = False) -> dict:
    length = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, entry in enumerate(items):
        n = len(entry["input_ids"])
        where = slice(length - n, length) if left_padding else slice(0, n)
        ids[row, where], types[row, where], mask[row, where] = entry["input_ids"], entry["mm_token_type_ids"], 1
    return {"input_ids": ids, "mm_token_type_ids": types, "attention_mask": mask}


@pytest.fixture(scope="module")
def inputs():
    return batch(item(14, (2, 10), 0), item(11, (1, 6), 1), left_padding=True)


# --- selection rules against hand computations -------------------------------------------------------------------


def test_slot_rules_keep_the_slots_a_hand_computation_keeps():
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.3, 0.2]])
    assert uniform_top_k(weights, 2).tolist() == [[True, True, False, False], [True, False, True, False]]
    # MoDES: text row scaled by 1, visual row by 2, thresholds 0.25 (text) and 0.5 (visual)
    kept = modes_slots(weights, torch.tensor([False, True]), (1.0, 2.0), (0.25, 0.5))
    assert kept.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert threshold_slots(weights, 0.35, 0).tolist() == [[True, False, False, False], [False] * 4]
    assert threshold_slots(weights, 0.35, 1).tolist() == [[True, False, False, False], [False, False, True, False]]


def test_per_segment_budgets_are_counted_in_each_segment():
    scores = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.2, 0.3, 0.8, 0.6])
    segments = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    candidates = torch.tensor([True, True, True, False, True, True, True, True])
    # segment 0: 3 candidates, ⌈0.5·3⌉ = 2 kept (0.9, 0.5); segment 1: 4 candidates, 2 kept (0.8, 0.6)
    assert keep_highest(scores, segments, candidates, 0.5).nonzero().flatten().tolist() == [0, 2, 6, 7]
    # ⌊0.5·3⌋ = 1 lowest (0.1) and ⌊0.5·4⌋ = 2 lowest (0.2, 0.3)
    assert lowest_fraction(scores, segments, candidates, 0.5).nonzero().flatten().tolist() == [1, 4, 5]


def test_otsu_threshold_maximises_the_between_class_variance():
    low = torch.rand(40, generator=torch.Generator().manual_seed(0)) * 0.3
    scores = torch.cat([low, torch.tensor([0.8, 0.9, 1.0])])
    bins = 16
    edges = torch.linspace(float(scores.min()), float(scores.max()), bins + 1, dtype=torch.float64)[1:-1]

    def between(theta):
        low, high = scores.double()[scores < theta], scores.double()[scores >= theta]
        if not len(low) or not len(high):
            return -1.0
        return len(low) * len(high) / len(scores) ** 2 * float(low.mean() - high.mean()) ** 2

    best = max(edges.tolist(), key=between)  # the first maximiser, as max() returns
    assert otsu_threshold(scores, bins) == pytest.approx(best, abs=1e-12)


def test_otsu_split_respects_the_cv_gate_and_the_cap():
    segments = torch.zeros(10, dtype=torch.long)
    everyone = torch.ones(10, dtype=torch.bool)
    flat = torch.full((10,), 0.5) + torch.arange(10) * 1e-3  # CV ≈ 0.006
    assert not otsu_split(flat, segments, everyone, min_cv=0.1, max_share=0.7, bins=256).any()
    # 9 low scores and one high: Otsu sends the 9 below, the cap keeps ⌊0.5·10⌋ = 5 of them, the lowest
    scores = torch.tensor([0.10, 0.19, 0.12, 0.18, 0.11, 0.17, 0.13, 0.16, 0.14, 0.90])
    skipped = otsu_split(scores, segments, everyone, min_cv=0.1, max_share=0.5, bins=256)
    assert skipped.nonzero().flatten().tolist() == [0, 2, 4, 6, 8]


def test_frontier_search_finds_the_brute_force_optimum_in_n_plus_m_evaluations():
    grid_text, grid_visual = [0.0, 0.1, 0.2, 0.4, 0.8], [0.0, 0.05, 0.1, 0.3, 0.6, 0.9]
    calls = []

    def skip_ratio(t, v):  # non-decreasing in both
        calls.append((t, v))
        return 0.6 * min(t / 0.8, 1) + 0.4 * min(v / 0.9, 1)

    def distortion(t, v):  # text costs more than visual; non-decreasing in both
        return 3 * t**2 + v

    for target in (0.2, 0.45, 0.7):
        calls.clear()
        found = frontier_search(grid_text, grid_visual, skip_ratio, distortion, target)
        searched = list(calls)
        feasible = [(t, v) for t, v in itertools.product(grid_text, grid_visual) if skip_ratio(t, v) >= target]
        assert found == min(feasible, key=lambda point: distortion(*point))
        assert len(searched) == len(set(searched)) <= len(grid_text) + len(grid_visual)  # each point once: O(N + M)
    with pytest.raises(ValueError, match="target_skip=0.99 is not reached"):
        frontier_search([0.0], [0.0], skip_ratio, distortion, 0.99)


# --- the model ------------------------------------------------------------------------------------------------------


def test_settings_that_keep_everything_are_exact(model, inputs):
    with torch.no_grad():
        full = model(**inputs)
        assert full.adaptive is None and torch.equal(model(**inputs, adaptive={}).embeddings, full.embeddings)
        for keep_all in (
            dict(token_pruning="gdn_beta", keep_ratio=1.0),
            dict(expert_skip="beta_rank", skip_fraction=0.0),
            dict(top_k="uniform", experts_per_token=TOP_K),
            dict(top_k="threshold", score_threshold=0.0),
            dict(MODES, modes_thresholds={"text": 0.0, "visual": 0.0}),
        ):
            out = model(**inputs, adaptive=dict(keep_all, execution="masked"))
            assert torch.equal(out.last_hidden_state, full.last_hidden_state), keep_all
            assert out.adaptive.flops_saving == 0.0 and out.adaptive.slot_skip_ratio == 0.0
            packed = model(**inputs, adaptive=keep_all)  # the default: the same to float rounding (one row)
            torch.testing.assert_close(packed.embeddings, full.embeddings, atol=1e-6, rtol=0)
            assert packed.adaptive.flops_saving == 0.0


def test_modes_with_infinite_thresholds_skips_every_routed_expert(model, inputs):
    with torch.no_grad():
        out = model(**inputs, adaptive=dict(MODES, modes_thresholds={"text": 1e9, "visual": 1e9}))
    assert out.adaptive.slot_skip_ratio == 1.0
    assert out.adaptive.flops.routed_experts == 0.0 and out.adaptive.flops.routers == out.adaptive.full_flops.routers


def test_uniform_top_k_renormalised_equals_a_native_smaller_top_k(inputs):
    model, native = make_model(), make_model()
    for layer in native.model.language_model.layers:
        layer.mlp.gate.top_k = 2  # renormalised over its own 2 slots
    with torch.no_grad():
        pruned = model(**inputs, adaptive=dict(top_k="uniform", experts_per_token=2, renormalize=True))
        torch.testing.assert_close(pruned.embeddings, native(**inputs).embeddings, atol=1e-6, rtol=0)


def test_gdn_pruning_keeps_the_highest_beta_visual_tokens_of_each_sample(model, inputs):
    layer = model.model.language_model.layers[4].linear_attn
    captured = {}
    handle = layer.in_proj_b.register_forward_hook(lambda m, i, o: captured.update(beta=torch.sigmoid(o).mean(-1)))
    with torch.no_grad():
        # masked: β captured in the (B, S) layout; packed execution decides the same (tests/test_moemb_packed.py)
        out = model(**inputs, adaptive=dict(token_pruning="gdn_beta", keep_ratio=0.5, execution="masked"))
    handle.remove()
    real = inputs["attention_mask"].bool()
    dropped = torch.zeros(real.shape, dtype=torch.bool)
    dropped[real] = out.adaptive.decisions.drop[:, 4].bool()
    assert not out.adaptive.decisions.drop[:, [0, 1, 2, 3, 5, 6, 7]].any()  # one shot, at block 4
    for row in range(2):
        visual = (inputs["mm_token_type_ids"][row] == 1).nonzero().flatten()
        keep = math.ceil(0.5 * len(visual))
        expected = visual[torch.sort(captured["beta"][row, visual], descending=True, stable=True).indices[keep:]]
        assert sorted(dropped[row].nonzero().flatten().tolist()) == sorted(expected.tolist())
    assert not dropped[inputs["mm_token_type_ids"] == 0].any()  # text and the pooled token stay
    assert out.last_hidden_state.shape == (*inputs["input_ids"].shape, 64)  # the input layout


def test_beta_rank_skips_the_lowest_fraction_of_each_sample_but_never_the_pooled_token(model, inputs):
    with torch.no_grad():
        out = model(**inputs, adaptive=dict(expert_skip="beta_rank", skip_fraction=0.3))
    skip = out.adaptive.decisions.skip
    lengths = inputs["attention_mask"].sum(1).tolist()
    for row, (start, end) in enumerate([(0, lengths[0]), (lengths[0], sum(lengths))]):
        per_layer = skip[start:end].sum(0)
        # layers 0-2 use their own β, layer 3 (full attention) layer 2's: ⌊0.3·(n - 1)⌋ tokens, pooled excluded
        assert per_layer.tolist() == [math.floor(0.3 * (end - start - 1))] * LAYERS
        assert not skip[end - 1].any()  # the <emb> token, last of its item


@pytest.mark.parametrize("action", list(ACTIONS))
def test_an_item_embeds_the_same_alone_and_beside_other_items(model, action):
    alone = item(13, (2, 9), 5)
    neighbours = [item(9, (1, 5), 6), item(16, (3, 12), 7)]
    with torch.no_grad():
        single = model(**batch(alone), adaptive=ACTIONS[action]).embeddings
        for left_padding in (False, True):
            together = model(**batch(neighbours[0], alone, neighbours[1], left_padding=left_padding),
                             adaptive=ACTIONS[action]).embeddings  # fmt: skip
            torch.testing.assert_close(together[1], single[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("action", list(ACTIONS))
def test_flops_saving_follows_the_realised_rates(model, inputs, action):
    with torch.no_grad():
        report = model(**inputs, adaptive=ACTIONS[action]).adaptive
    lengths = inputs["attention_mask"].sum(1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    assert report.flops == logical_flops(model.config, cu_seqlens, report.decisions)
    assert report.full_flops == logical_flops(model.config, cu_seqlens)
    assert 0 < report.flops_saving < 1
    assert report.flops_saving == pytest.approx(1 - report.flops.total / report.full_flops.total)
    if "token_pruning" not in ACTIONS[action]:  # every token reaches every layer
        executed = report.flops.routed_experts / report.full_flops.routed_experts
        assert executed == pytest.approx(1 - report.slot_skip_ratio, abs=1e-12)
    if action == "top-k":  # (k - k') / k of the routed-expert FLOPs, at every layer and modality
        assert torch.allclose(report.slot_skip_rate[:, :2], torch.tensor(0.5, dtype=torch.float64))
        assert report.slot_skip_rate[:, 2].isnan().all()  # no video token


def test_config_settings_are_used_and_the_keyword_overrides_them(inputs, tmp_path):
    settings = ACTIONS["modes+gdn-prune"]
    configured = make_model(adaptive=settings)
    with torch.no_grad():
        from_config = configured(**inputs)
        assert torch.equal(from_config.embeddings, configured(**inputs, adaptive=settings).embeddings)
        assert torch.equal(configured(**inputs, adaptive={}).embeddings, make_model()(**inputs).embeddings)
    configured.config.save_pretrained(tmp_path)
    assert MoEmbConfig.from_pretrained(tmp_path).adaptive == settings


def test_modes_calibration_returns_scales_of_mean_one_and_reaches_the_target(model):
    batches = [batch(item(12, (2, 8), seed), item(10, (1, 6), seed + 10)) for seed in range(2)]
    settings = calibrate_modes(model, batches, target_skip=0.4, grid_points=8)
    scales = torch.tensor(settings["modes_layer_scales"])
    torch.testing.assert_close(scales.sum(0), torch.full((2,), float(LAYERS), dtype=torch.float32))
    with torch.no_grad():
        skipped = [model(**b, adaptive=settings).adaptive.slot_skip_ratio for b in batches]
    assert sum(skipped) / 2 >= 0.4 - 0.05  # both batches have the same token count: the mean is the calibration's
    text_only = [batch(item(12, (0, 0), 0))]
    with pytest.raises(ValueError, match="calibration_inputs hold text only"):
        calibrate_modes(model, text_only, target_skip=0.4, grid_points=4)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(token_pruning="gdn_beta", keep_ratio=0.0), r"adaptive.keep_ratio=0.0 must lie in \(0, 1\]"),
        (dict(expert_skip="beta_rank", skip_fraction=1.0), r"adaptive.skip_fraction=1.0 must lie in \[0, 1\)"),
        (dict(expert_skip="beta_rank", skip_fraction=-0.1), r"adaptive.skip_fraction=-0.1 must lie in \[0, 1\)"),
        (dict(top_k="uniform", experts_per_token=TOP_K + 1), "adaptive.experts_per_token=5 .k'. must be"),
        (dict(token_pruning="gdn_beta", prune_after_layer=3), "adaptive.prune_after_layer=3 must be a Gated DeltaNet"),
        (dict(top_k="modes"), "adaptive.modes_thresholds=None must map"),
        (dict(top_k="top4"), "adaptive.top_k='top4' is not one of"),
        (dict(keep_ration=0.5), r"unknown adaptive options \['keep_ration'\]"),
    ],
)
def test_bad_options_name_the_option(settings, message, model, inputs):
    with pytest.raises(ValueError, match="MoEmbConfig." + message):
        MoEmbConfig(**copy.deepcopy(TINY_MOEMB), adaptive=settings)
    with pytest.raises(ValueError, match=r"model\(adaptive=...\): " + message):
        model(**inputs, adaptive=settings)


def test_beta_actions_need_gated_deltanet_layers_and_packed_batches_take_the_actions(model):
    """Packed batches take every action, budgets per segment (token pruning: tests/test_moemb_packed.py)."""
    config = copy.deepcopy(TINY_MOEMB)
    config["text_config"]["layer_types"] = ["full_attention"] * LAYERS
    with pytest.raises(ValueError, match="β of Gated DeltaNet layers, and this model has none"):
        MoEmbConfig(**config, adaptive=dict(expert_skip="beta_rank"))
    attention_only = MoEmbForEmbedding(MoEmbConfig(**config)).eval()  # the same check for one call
    with pytest.raises(ValueError, match=r"model\(adaptive=...\): adaptive token_pruning='gdn_beta' .* has none"):
        attention_only(**batch(item(4, (1, 2), 0)), adaptive={"token_pruning": "gdn_beta"})
    first, second = item(4, (1, 2), 0), item(6, (1, 4), 1)
    packed = {key: torch.cat([first[key], second[key]])[None] for key in first}
    with torch.no_grad():  # the actions on experts run on packed batches, per segment
        packed_out = model(**packed, cu_seqlens=torch.tensor([0, 4, 10]), adaptive=ACTIONS["beta-rank"])
        padded_out = model(**batch(first, second), adaptive=ACTIONS["beta-rank"])
    torch.testing.assert_close(packed_out.embeddings, padded_out.embeddings, atol=1e-6, rtol=0)


def test_an_exported_folder_honours_its_adaptive_settings_without_moezoo(tmp_path):
    created, exported = tmp_path / "created", tmp_path / "exported"
    assert main(["create", "tiny-moemb", "--out", str(created)]) == 0  # the commands in this process: no fresh imports
    config = json.loads((created / "config.json").read_text())
    config["adaptive"] = ACTIONS["modes+gdn-prune"]
    (created / "config.json").write_text(json.dumps(config))
    assert main(["export", str(created), "--out", str(exported)]) == 0
    inputs = batch(item(12, (2, 8), 0), item(9, (1, 5), 1))
    loaded = MoEmbForEmbedding.from_pretrained(created).eval()
    with torch.no_grad():
        expected, full = loaded(**inputs).embeddings, loaded(**inputs, adaptive={}).embeddings
    assert not torch.allclose(expected, full, atol=1e-4)
    embeddings, flops_saving = exported_moemb_outputs(exported, inputs, tmp_path)
    torch.testing.assert_close(embeddings, expected, atol=1e-6, rtol=0)
    assert 0 < flops_saving < 1
