"""The `moezoo` command: help, errors without tracebacks, and the moe-layer benchmark's JSON contract."""

import json
import subprocess
import sys

import pytest
import torch

from moezoo.bench.moe_layer import GPU_TARGETS, TARGET_CASE, BenchRow, check_targets, print_target_checks
from moezoo.cli import main


def moezoo(*args):
    return subprocess.run([sys.executable, "-m", "moezoo.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_commands_with_examples():
    result = moezoo("--help")
    assert result.returncode == 0
    assert "bench" in result.stdout and "demo" in result.stdout
    bench_help = moezoo("bench", "moe-layer", "--help")
    assert bench_help.returncode == 0 and "examples:" in bench_help.stdout


def test_bench_moe_layer_json_rows():
    result = moezoo(
        "bench", "moe-layer", "--tokens", "16", "48", "--experts", "8", "--top-k", "2", "--hidden", "32",
        "--expert-width", "16", "--seconds-per-case", "0.05", "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["case"] == {"num_experts": 8, "top_k": 2, "hidden": 32, "expert_width": 16, "dtype": "float32",
                              "device": "cpu"}
    assert report["matmul_peak_gflops"] > 0 and report["targets"] == []  # no targets are set for this shape
    rows = report["rows"]
    assert {row["impl"] for row in rows} == {"eager", "grouped_mm", "batched_mm", "moezoo"}
    assert {(row["tokens"], row["mode"]) for row in rows} == {(t, m) for t in (16, 48) for m in ("fwd", "fwd_bwd")}
    for row in rows:
        assert {"impl", "tokens", "mode", "ms", "pct_of_matmul_peak", "max_abs_diff_vs_eager"} <= row.keys()
        assert row["ms"] > 0 and 0 < row["pct_of_matmul_peak"]
        assert row["max_abs_diff_vs_eager"] <= 1e-5 and row["max_rel_diff_vs_eager"] <= 1e-5
        # error against eager in float64: eager's own is fp32 rounding, and nobody is far from it
        assert 0 < row["max_abs_err_vs_fp64"] <= 1e-5
        assert row["weights_read_ms"] > 0
        if row["impl"] == "eager":
            assert row["max_abs_diff_vs_eager"] == 0


def test_bad_arguments_fail_with_a_message_not_a_traceback(capsys):
    assert main(["bench", "moe-layer", "--tokens", "8", "--impl", "fastest", "--json"]) == 2
    err = capsys.readouterr().err
    assert "unknown experts implementation 'fastest'" in err and "Traceback" not in err
    assert main(["bench", "moe-layer", "--tokens", "8", "--top-k", "99", "--json"]) == 2
    assert "num_experts_per_tok" in capsys.readouterr().err
    assert main(["bench", "moe-layer", "--tokens", "8", "--threads", "0", "--json"]) == 2
    assert "--threads must be positive" in capsys.readouterr().err
    assert main(["bench", "moe-layer", "--tokens", "8", "0", "--json"]) == 2
    assert "token counts must be positive, got 0" in capsys.readouterr().err


def test_timed_calls_cycle_through_identical_layers_that_exceed_the_cache(monkeypatch):
    from moezoo.bench import moe_layer

    monkeypatch.setattr(moe_layer, "last_level_cache_bytes", lambda: 100_000)
    config, layers, exact = moe_layer._make_layers(8, 2, 32, 16, torch.float32, seed=0)
    layer_bytes = sum(p.nbytes for p in layers[0].parameters())
    assert len(layers) == 5 and len(layers) * layer_bytes >= 1.5 * 100_000
    pointers = {p.data_ptr() for layer in layers for p in layer.parameters()}
    assert len(pointers) == 2 * len(layers)
    for layer in [*layers, exact]:
        assert layer.config is config
        torch.testing.assert_close(layer.gate_up_proj.double(), exact.gate_up_proj, rtol=0, atol=0)
        torch.testing.assert_close(layer.down_proj.double(), exact.down_proj, rtol=0, atol=0)
    assert exact.gate_up_proj.dtype == torch.float64

    monkeypatch.setattr(moe_layer, "last_level_cache_bytes", lambda: 2**40)
    assert len(moe_layer._make_layers(8, 2, 32, 16, torch.float32, seed=0)[1]) == moe_layer.MAX_LAYER_COPIES


def test_float64_reference_propagates_the_same_upstream_gradient_in_bfloat16():
    """In bf16 every implementation is off float64 by bf16 rounding only (not by a different upstream gradient)."""
    from moezoo.bench.moe_layer import run_moe_layer_bench

    rows, _ = run_moe_layer_bench(
        tokens=(16,), num_experts=8, top_k=2, hidden=64, expert_width=32, dtype=torch.bfloat16,
        implementations=("eager", "moezoo"), modes=("fwd_bwd",), seconds_per_case=0.0, max_rounds=1,
    )
    for row in rows:
        assert 0 < row.max_abs_err_vs_fp64 < 0.1, row


def test_triton_rows_are_skipped_where_the_kernels_do_not_run(capsys):
    """moezoo_triton is timed on GPUs only (forward and forward + backward); elsewhere its row says why it is empty."""
    from moezoo.bench.moe_layer import split_runnable

    implementations = ("grouped_mm", "moezoo_triton")
    for passes in (1, 2):
        assert split_runnable(implementations, 64, 32, 16, 4, passes, device="cuda") == (list(implementations), {})
    runnable, skipped = split_runnable(implementations, 64, 32, 16, 4, device="cpu")
    assert runnable == ["grouped_mm"] and "GPUs only" in skipped["moezoo_triton"]

    assert main(["bench", "moe-layer", "--tokens", "8", "--experts", "4", "--top-k", "2", "--hidden", "32",
                 "--expert-width", "16", "--impl", "eager", "moezoo_triton", "--mode", "fwd",
                 "--seconds-per-case", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(row["impl"], row["ms"] is None) for row in rows] == [("eager", False), ("moezoo_triton", True)]
    if not torch.cuda.is_available():
        assert main(["bench", "moe-layer", "--tokens", "8", "--device", "cuda", "--json"]) == 2
        assert "torch sees no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_moe_layer_on_a_gpu():
    result = moezoo("bench", "moe-layer", "--device", "cuda", "--tokens", "64", "512", "--experts", "16",
                    "--hidden", "256", "--expert-width", "128", "--seconds-per-case", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    triton_rows = [row for row in rows if row["impl"] == "moezoo_triton"]
    assert [row["mode"] for row in triton_rows] == ["fwd", "fwd_bwd", "fwd", "fwd_bwd"]
    for row in triton_rows:
        assert row["max_rel_diff_vs_eager"] <= 1e-5 and row["speedup_vs_best_transformers"] > 0


def _case_rows(tokens, mode, ms, read_floor_ms=4.0, rel_diff=1e-6):
    """Synthetic rows of one (tokens, mode) case: {impl: ms}, each at 50% of the matmul peak."""
    return [
        BenchRow(impl, tokens, mode, impl_ms, 1.0, 50.0, 0.0, rel_diff if impl.startswith("moezoo") else 0.0,
                 weights_read_ms=read_floor_ms)
        for impl, impl_ms in ms.items()
    ]


def test_cpu_targets_each_get_their_own_verdict(capsys):
    """moezoo's speed-up over transformers' fastest, its time over the read floor (64-token forward) and its accuracy
    are checked separately, on synthetic rows of the shape the targets are set for, and nowhere else."""
    rows = [
        # 6 ms: 2x grouped_mm (the fastest), 1.5x the read floor: both met
        *_case_rows(64, "fwd", {"eager": 40.0, "grouped_mm": 12.0, "batched_mm": 30.0, "moezoo": 6.0}),
        # 2.9x the fastest (< 3), within 1e-5
        *_case_rows(64, "fwd_bwd", {"eager": 90.0, "grouped_mm": 29.0, "moezoo": 10.0}),
        # 1.25x, but off eager by 2e-5 (relative to max(1, max|eager|))
        *_case_rows(2048, "fwd", {"eager": 50.0, "grouped_mm": 60.0, "moezoo": 40.0}, rel_diff=2e-5),
        *_case_rows(512, "fwd", {"eager": 10.0, "moezoo": 1.0}),  # no targets at 512 tokens
    ]
    # 64-token forward 1.6x the read floor, yet 2x the fastest: only the floor target is missed
    slow_floor = _case_rows(64, "fwd", {"grouped_mm": 12.8, "moezoo": 6.4})

    checks = check_targets(rows, **TARGET_CASE)
    assert [(c.tokens, c.mode) for c in checks] == [(64, "fwd"), (64, "fwd_bwd"), (2048, "fwd")]
    forward, training, large = checks
    assert forward.speedup == pytest.approx(2.0) and forward.read_floor_ratio == pytest.approx(1.5)
    assert forward.verdicts() == {"speedup": True, "read_floor_ratio": True, "rel_diff": True} and forward.met
    assert forward.compute_floor_ms == pytest.approx(3.0)  # 6 ms at 50% of the peak
    assert training.verdicts() == {"speedup": False, "rel_diff": True} and not training.met
    assert large.verdicts() == {"speedup": True, "rel_diff": False}
    assert check_targets(slow_floor, **TARGET_CASE)[0].verdicts() == {
        "speedup": True, "read_floor_ratio": False, "rel_diff": True
    }
    assert check_targets(rows, **{**TARGET_CASE, "hidden": 256}) == []
    assert check_targets(rows, **{**TARGET_CASE, "dtype": torch.bfloat16}) == []

    report = forward.as_dict()
    assert report["verdicts"]["read_floor_ratio"] is True and report["met"] is True and report["min_speedup"] == 1.5
    json.dumps([check.as_dict() for check in checks])  # the --json output holds them as they are

    print_target_checks(checks)
    out = capsys.readouterr().out
    assert "moezoo against its targets" in out and "transformers" in out and "× read floor" in out
    assert ">= 3" in out and "<= 1.5" in out and "<= 1e-05" in out and out.count("MISSED") == 2


def test_gpu_targets_compare_triton_with_grouped_mm():
    """moezoo_triton on a GPU in bf16: over grouped_mm (not transformers' fastest), with no accuracy target."""
    rows = [
        *_case_rows(64, "fwd", {"eager": 1.0, "grouped_mm": 1.3, "moezoo_triton": 1.0}),  # 1.3x: met
        *_case_rows(8192, "fwd", {"grouped_mm": 1.0, "moezoo_triton": 1.12}),  # 12% slower: missed
        *_case_rows(8192, "fwd_bwd", {"grouped_mm": 3.0, "moezoo_triton": 2.0}),  # no target
        *_case_rows(2048, "fwd_bwd", {"grouped_mm": 1.2, "moezoo_triton": 1.0}, rel_diff=1e-2),  # 1.2x: met
    ]
    checks = check_targets(rows, **GPU_TARGETS.case)
    assert [(c.tokens, c.mode, c.baseline) for c in checks] == [
        (64, "fwd", "grouped_mm"), (8192, "fwd", "grouped_mm"), (2048, "fwd_bwd", "grouped_mm")
    ]
    assert [c.verdicts() for c in checks] == [{"speedup": True}, {"speedup": False}, {"speedup": True}]
    assert check_targets(rows, **{**GPU_TARGETS.case, "dtype": torch.float32}) == []
    # no grouped_mm row (skipped, or not asked for): nothing to compare with
    assert check_targets(_case_rows(64, "fwd", {"moezoo_triton": 1.0}), **GPU_TARGETS.case) == []


def test_bench_moemb_takes_the_device_and_dtype_options(capsys):
    """`moezoo bench moemb --dtype bfloat16` runs both models in bf16; `--device cuda` without a GPU fails with a
    message."""
    args = ["bench", "moemb", "--size", "tiny", "--inputs", "image+text", "--batch-size", "2", "--text-tokens", "8",
            "--image-size", "32", "--impl", "eager", "moezoo", "--seconds-per-case", "0", "--threads", "1", "--json"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["model"], row["impl"]) for row in rows} == {
        (model, impl) for model in ("moemb", "transformers") for impl in ("eager", "moezoo")
    }
    # the same bf16 weights and inputs: MoEMB's embeddings are transformers' up to bf16 rounding
    assert all(0 <= row["max_abs_diff_vs_transformers"] < 0.05 for row in rows if row["model"] == "moemb")
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "torch sees no CUDA GPU" in capsys.readouterr().err
