"""MoEMB's logical FLOPs model (spec moemb.md §3.0 Eq. 6-7, §10 E-26) and the grouped-GEMM cost model (§3.14)."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moezoo.configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB, MoEmbConfig
from moezoo.modeling.moe.grouped_gemm_cost import (
    balanced_expert_tiles,
    balanced_rows_per_expert,
    expert_tile_speedup,
    expert_tiles,
    smallest_skip_saving_a_tile,
)
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.modeling.moemb_flops import TokenDecisions, TokenLayerFlops, flops_saving, logical_flops, vision_flops


@pytest.fixture(scope="module")
def a3b():
    return MoEmbConfig(**copy.deepcopy(MOEMB_CONFIGS["MoEMB-A3B"]))


@pytest.fixture(scope="module")
def tiny():
    return MoEmbConfig(**copy.deepcopy(TINY_MOEMB))


def test_a3b_per_token_costs_are_the_worked_numbers(a3b):
    """Spec §3.0: routed 50.3, shared 6.3, router 1.05, GDN projections ≈ 67.4 (+≈3), attention projections ≈ 54.5
    MFLOP per token and layer."""
    costs = TokenLayerFlops.from_config(a3b)
    mega = 1e6
    assert round(costs.experts_per_token * costs.routed_expert / mega, 1) == 50.3
    assert round(costs.shared_expert / mega, 1) == 6.3
    assert round(costs.router / mega, 2) == 1.05
    assert round(costs.gated_delta_net_projections / mega, 1) == 67.4
    assert round(costs.gated_delta_net_recurrence / mega) == 3
    assert round(costs.attention_projections / mega, 1) == 54.5


def test_routed_experts_are_forty_percent_and_table_8_holds(a3b):
    """A short text (LM only): the routed experts are ≈40% of the FLOPs, so Table 8's mean k of 4.02 (49.8% of the
    expert work skipped) saves ≈19.8%."""
    cu_seqlens = torch.tensor([0, 32])
    full = logical_flops(a3b, cu_seqlens)
    assert round(full.routed_experts / full.total, 2) == 0.40
    decisions = TokenDecisions(experts_per_token=torch.full((32, 40), 4.02))
    assert flops_saving(a3b, cu_seqlens, decisions) == pytest.approx(0.198, abs=0.005)


def test_full_compute_counts_every_part_by_hand(tiny):
    """Two sequences (3 and 5 tokens) of the tiny model: each part written out from the per-token costs."""
    costs = TokenLayerFlops.from_config(tiny)
    flops = logical_flops(tiny, torch.tensor([0, 3, 8]))
    tokens, layers, attention_layers = 8, 8, 2
    gdn_layers = layers - attention_layers
    assert flops.token_mixers == tokens * (
        attention_layers * costs.attention_projections
        + gdn_layers * (costs.gated_delta_net_projections + costs.gated_delta_net_recurrence)
    )
    keys_attended = (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5)  # causal, within each sequence
    assert flops.attention_context == attention_layers * costs.attention_per_key * keys_attended
    assert flops.shared_experts == tokens * layers * (6 * 64 * 32 + 2 * 64)
    assert flops.routed_experts == tokens * layers * 4 * 6 * 64 * 32
    assert flops.routers == tokens * layers * 2 * 64 * 8
    assert flops.vision == 0


@torch.no_grad()
def test_the_matrix_products_equal_torchs_flop_counter(tiny):
    """Spec §10 E-25: the projections of every token mixer, the routers, the experts that run and the shared experts
    of an eager forward, as `torch.utils.flop_counter` counts them (the Gated DeltaNet recurrence, chunked in
    transformers' PyTorch fallback, and the attention scores are counted analytically, not compared)."""
    torch.manual_seed(0)
    model = MoEmbForEmbedding(tiny).eval()
    model.set_experts_implementation("eager")  # a loop over the experts with the tokens each received
    input_ids = torch.randint(1, 120, (1, 20))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, pooled_index=torch.tensor([19]))
    matrix_products = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
                       "v_proj", "o_proj", "mlp.gate", "mlp.experts", "mlp.shared_expert", "mlp.shared_expert_gate")
    counted = sum(
        sum(ops.values()) for module, ops in counter.get_flop_counts().items() if module.endswith(matrix_products)
    )
    flops = logical_flops(tiny, torch.tensor([0, 20]))
    gdn_layers = tiny.text_config.layer_types.count("linear_attention")
    recurrence = 20 * gdn_layers * TokenLayerFlops.from_config(tiny).gated_delta_net_recurrence
    assert counted == flops.token_mixers - recurrence + flops.routers + flops.routed_experts + flops.shared_experts


def test_top_k_prime_removes_its_share_of_the_routed_experts(tiny):
    cu_seqlens = torch.tensor([0, 6])
    full = logical_flops(tiny, cu_seqlens)
    top_3 = logical_flops(tiny, cu_seqlens, TokenDecisions(experts_per_token=torch.full((6, 8), 3.0)))
    assert top_3.routed_experts == pytest.approx(full.routed_experts * 3 / 4)
    assert top_3.total - top_3.routed_experts == pytest.approx(full.total - full.routed_experts)


def test_a_token_dropped_at_a_layer_leaves_every_later_layer(tiny):
    """Dropping token 2 of 4 at layer K = 2 removes its routed experts at K, all of its cost after K, and its key
    from the later attention layers (3 and 7): one query, plus the one later token that attended to it."""
    costs = TokenLayerFlops.from_config(tiny)
    cu_seqlens = torch.tensor([0, 4])
    drop = torch.zeros(4, 8)
    drop[2, 2] = 1.0
    full = logical_flops(tiny, cu_seqlens)
    dropped = logical_flops(tiny, cu_seqlens, TokenDecisions(drop=drop))
    later = range(3, 8)
    mixers = sum(
        costs.attention_projections if kind == "full_attention"
        else costs.gated_delta_net_projections + costs.gated_delta_net_recurrence
        for kind in (tiny.text_config.layer_types[layer] for layer in later)
    )
    expected = (
        mixers
        + len(later) * (costs.shared_expert + costs.router)
        + (len(later) + 1) * 4 * costs.routed_expert
        + costs.router  # the router at K itself
        + 2 * costs.attention_per_key * (3 + 1)  # layers 3 and 7: token 2 attended 3 keys, token 3 one more
    )
    assert full.total - dropped.total == pytest.approx(expected)


def test_saving_bounds_and_probabilities(tiny):
    cu_seqlens = torch.tensor([0, 5])
    assert flops_saving(tiny, cu_seqlens, TokenDecisions()) == 0.0
    everything_dropped = TokenDecisions(drop=torch.ones(5, 8))
    assert 0 < flops_saving(tiny, cu_seqlens, everything_dropped) < 1
    half_skip = flops_saving(tiny, cu_seqlens, TokenDecisions(skip=torch.full((5, 8), 0.5)))
    full_skip = flops_saving(tiny, cu_seqlens, TokenDecisions(skip=torch.ones(5, 8)))
    assert half_skip == pytest.approx(full_skip / 2)


@pytest.mark.parametrize(
    ("decisions", "message"),
    [
        (TokenDecisions(skip=torch.zeros(4, 8)), r"skip has shape \(4, 8\); expected .* \(5, 8\)"),
        (TokenDecisions(drop=torch.full((5, 8), 1.5)), r"drop must lie in \[0, 1.0\]"),
        (TokenDecisions(experts_per_token=torch.full((5, 8), 5.0)), r"experts_per_token must lie in \[0, 4\]"),
        (TokenDecisions(drop=torch.full((5, 8), 0.6), skip=torch.full((5, 8), 0.6)), "must not exceed 1"),
    ],
)
def test_invalid_decisions_are_named(tiny, decisions, message):
    with pytest.raises(ValueError, match=message):
        logical_flops(tiny, torch.tensor([0, 5]), decisions)


@pytest.mark.parametrize("cu_seqlens", [[5], [0], [1, 5], [0, 5, 3]])
def test_invalid_sequence_bounds_are_named(tiny, cu_seqlens):
    with pytest.raises(ValueError, match="cu_seqlens must be 0 followed by"):
        logical_flops(tiny, torch.tensor(cu_seqlens))


def test_vision_tower_counts_by_hand(tiny):
    """Tiny tower (width 32, MLP 64, 2 blocks, 4×4-pixel patches of 2 frames): one 4×4-patch image."""
    patches, frame = 16, 16
    per_patch = 2 * 96 * 32 + 2 * (8 * 32 * 32 + 4 * 32 * 64 + 4 * 32 * frame)
    merger = (patches // 4) * (2 * 128 * 128 + 2 * 128 * 64)
    assert vision_flops(tiny, torch.tensor([[1, 4, 4]])) == patches * per_patch + merger
    flops = logical_flops(tiny, torch.tensor([0, 6]), image_grid_thw=torch.tensor([[1, 4, 4]]))
    assert flops.vision == patches * per_patch + merger


# --- grouped-GEMM cost model ----------------------------------------------------------------------------------------


def test_tiles_count_the_rows_each_expert_runs():
    assert int(expert_tiles(torch.tensor([128, 129, 0, 50]))) == 1 + 2 + 0 + 1
    per_layer = expert_tiles(torch.tensor([[256, 1], [0, 0]]), tile_rows=64)
    assert per_layer.tolist() == [4 + 1, 0]
    with pytest.raises(ValueError, match="tile_rows"):
        expert_tiles(torch.tensor([1]), tile_rows=0)


def test_the_paper_tile_examples():
    """App. C.3: top-8 of 256 experts. 4096 tokens: 128 rows, one tile, still one after a 52.9% skip (no gain);
    8192 tokens: 256 rows, two tiles, one after a 69.6% skip (≈ 78 rows)."""
    assert balanced_rows_per_expert(4096, 8, 256) == 128
    assert balanced_expert_tiles(4096, 8, 256) == balanced_expert_tiles(4096, 8, 256, skip_fraction=0.529) == 256
    assert expert_tile_speedup(4096, 8, 256, 0.529) == 1.0
    assert round(balanced_rows_per_expert(8192, 8, 256, skip_fraction=0.696)) == 78
    assert balanced_expert_tiles(8192, 8, 256) == 512
    assert balanced_expert_tiles(8192, 8, 256, skip_fraction=0.696) == 256
    assert expert_tile_speedup(8192, 8, 256, 0.696) == 2.0


def test_smallest_skip_that_saves_a_tile():
    assert smallest_skip_saving_a_tile(8192, 8, 256) == 0.5
    assert smallest_skip_saving_a_tile(4096, 8, 256) == 1.0
    assert smallest_skip_saving_a_tile(12288, 8, 256) == pytest.approx(1 - 256 / 384)
    skip = smallest_skip_saving_a_tile(12288, 8, 256)
    assert balanced_expert_tiles(12288, 8, 256, skip) < balanced_expert_tiles(12288, 8, 256, skip - 0.01)
