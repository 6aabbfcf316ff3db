"""`moezoo bench moe-vie`: the JSON contract on the tiny towers, the dense tower's active-parameter match, the
batched_mm memory guard, and bad arguments."""

import json
import math

import pytest
import torch

import moezoo.bench.moe_layer
from conftest import run_moezoo
from moezoo.bench.moe_vie import dense_equivalent_config, moe_vie_bench_config, run_moe_vie_bench
from moezoo.cli import main
from moezoo.configuration.moe_vie import TINY_MOE_VIE, MoeVieVisionConfig
from moezoo.modeling.moe_vie import MoeVieVisionModel


IMPLEMENTATIONS = ["eager", "grouped_mm", "batched_mm", "moezoo"]


def test_json_rows_for_every_tower_and_implementation():
    # One thread: on a machine shared with other test runs, two threads wait for each other at every small operation.
    result = run_moezoo(
        "bench", "moe-vie", "--size", "tiny", "--batch-size", "1", "3", "--image-size", "12", "--seconds-per-case",
        "0.05", "--threads", "1", "--json",
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(row["batch_size"], row["model"], row["impl"]) for row in rows] == [
        (batch, model, impl)
        for batch in (1, 3)
        for model, impl in [("siglip2", None), ("dense", None)] + [("moe_vie", impl) for impl in IMPLEMENTATIONS]
    ]
    for batch in (1, 3):
        case = {row["impl"] or row["model"]: row for row in rows if row["batch_size"] == batch}
        for row in case.values():
            assert row["tokens"] == 9  # 12 px / patch 4 = a 3 x 3 grid
            assert row["ms"] > 0 and math.isclose(row["images_per_second"], batch * 1e3 / row["ms"])
            assert math.isclose(row["speedup_vs_dense"], case["dense"]["ms"] / row["ms"])
            assert math.isclose(row["speedup_vs_siglip2"], case["siglip2"]["ms"] / row["ms"])
        best_transformers = min(case[impl]["ms"] for impl in ("eager", "grouped_mm", "batched_mm"))
        for impl in IMPLEMENTATIONS:
            assert math.isclose(case[impl]["speedup_vs_best_transformers"], best_transformers / case[impl]["ms"])
            assert case[impl]["max_abs_diff_vs_eager"] <= 1e-5
        assert case["eager"]["max_abs_diff_vs_eager"] == 0

        moe, dense, siglip2 = case["eager"], case["dense"], case["siglip2"]
        assert moe["total_parameters"] > moe["active_parameters"]
        assert dense["total_parameters"] == dense["active_parameters"]
        assert abs(dense["active_parameters"] - moe["active_parameters"]) <= 0.01 * moe["active_parameters"]
        assert siglip2["total_parameters"] == siglip2["active_parameters"] > 0


def test_dense_mlps_are_as_wide_as_the_experts_a_token_activates():
    # Top-1 routing: the active width (shared + 1 routed expert) is half the dense width of block 0.
    config = MoeVieVisionConfig(**{**TINY_MOE_VIE["vision_config"], "num_experts_per_tok": 1})
    moe = MoeVieVisionModel(config)
    dense = MoeVieVisionModel(dense_equivalent_config(config))
    assert dense_equivalent_config(config).moe_layers == []
    for layer in config.moe_layers:
        block = moe.encoder.layers[layer].mlp
        routed = sum(p.numel() for p in block.experts.parameters())
        active_routed = routed * config.num_experts_per_tok // config.n_routed_experts
        active_expert_weights = sum(p.numel() for p in block.shared_expert.parameters()) + active_routed
        dense_weights = sum(p.numel() for p in dense.encoder.layers[layer].mlp.parameters() if p.ndim == 2)
        assert dense_weights == active_expert_weights


def test_batched_mm_is_skipped_with_a_note_when_it_would_copy_too_much(monkeypatch):
    monkeypatch.setattr(moezoo.bench.moe_layer, "BATCHED_MM_MEMORY_LIMIT_BYTES", 0)
    rows = run_moe_vie_bench(
        moe_vie_bench_config("tiny", image_size=8), batch_sizes=[1], implementations=["eager", "batched_mm"],
        seconds_per_case=0,
    )
    eager, batched_mm = (row for row in rows if row.model == "moe_vie")
    assert batched_mm.ms is None and batched_mm.images_per_second is None and batched_mm.speedup_vs_dense is None
    assert batched_mm.note.startswith("skipped: would copy")
    assert eager.speedup_vs_best_transformers == 1.0 and eager.ms > 0


def test_moe_layers_follow_the_depth():
    assert moe_vie_bench_config("tiny", num_layers=5).moe_layers == [1, 2, 3, 4]
    assert moe_vie_bench_config("b16").hidden_size == 768


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--impl", "fastest"], "unknown experts implementation 'fastest'"),
        (["--size", "huge"], "unknown size 'huge'; choose from cpu, tiny, b16, l16, h14"),
        (["--image-size", "10"], "image size 10 is not a multiple of the patch size 4"),
        (["--layers", "1"], "the MoE tower has no MoE layer"),
        (["--layers", "0"], "num_hidden_layers must be a positive integer"),
        (["--batch-size", "0"], "batch sizes must be positive"),
        (["--threads", "0"], "--threads must be positive"),
        pytest.param(["--device", "cuda"], "torch sees no CUDA GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    ],
)
def test_bad_arguments_fail_with_a_message_not_a_traceback(capsys, arguments, message):
    assert main(["bench", "moe-vie", "--size", "tiny", *arguments, "--json"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_bfloat16_towers_on_each_device(device):
    """In bf16 every tower runs; on a GPU moezoo's Triton kernels take the place of its CPU implementation."""
    config = MoeVieVisionConfig(**{**TINY_MOE_VIE["vision_config"], "image_size": 12})
    implementations = moezoo.bench.moe_layer.default_implementations(device)
    rows = run_moe_vie_bench(config, batch_sizes=(2,), implementations=implementations, seconds_per_case=0.0,
                             max_rounds=1, device=device, dtype=torch.bfloat16)
    assert [row.impl for row in rows] == [None, None, *implementations]
    for row in rows:
        assert row.ms > 0, row
        if row.model == "moe_vie":
            assert row.max_abs_diff_vs_eager < 0.1, row
    if device == "cuda":
        assert "moezoo_triton" in implementations
