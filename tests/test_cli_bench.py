"""The `moezoo` command: help, errors without tracebacks, and the moe-layer benchmark's JSON contract."""

import json
import subprocess
import sys

import pytest
import torch

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
    rows = json.loads(result.stdout)
    assert {row["impl"] for row in rows} == {"eager", "grouped_mm", "batched_mm", "moezoo"}
    assert {(row["tokens"], row["mode"]) for row in rows} == {(t, m) for t in (16, 48) for m in ("fwd", "fwd_bwd")}
    for row in rows:
        assert {"impl", "tokens", "mode", "ms", "pct_of_matmul_peak", "max_abs_diff_vs_eager"} <= row.keys()
        assert row["ms"] > 0 and 0 < row["pct_of_matmul_peak"]
        assert row["max_abs_diff_vs_eager"] <= 1e-5
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
    """moezoo_triton is timed on GPUs only, and forward only; elsewhere its row says why it is empty."""
    from moezoo.bench.moe_layer import split_runnable

    implementations = ("grouped_mm", "moezoo_triton")
    assert split_runnable(implementations, 64, 32, 16, 4, device="cuda") == (list(implementations), {})
    runnable, skipped = split_runnable(implementations, 64, 32, 16, 4, device="cpu")
    assert runnable == ["grouped_mm"] and "GPUs only" in skipped["moezoo_triton"]
    runnable, skipped = split_runnable(implementations, 64, 32, 16, 4, passes=2, device="cuda")
    assert runnable == ["grouped_mm"] and "forward kernels" in skipped["moezoo_triton"]

    assert main(["bench", "moe-layer", "--tokens", "8", "--experts", "4", "--top-k", "2", "--hidden", "32",
                 "--expert-width", "16", "--impl", "eager", "moezoo_triton", "--mode", "fwd",
                 "--seconds-per-case", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["impl"], row["ms"] is None) for row in rows] == [("eager", False), ("moezoo_triton", True)]
    if not torch.cuda.is_available():
        assert main(["bench", "moe-layer", "--tokens", "8", "--device", "cuda", "--json"]) == 2
        assert "torch sees no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_moe_layer_on_a_gpu():
    result = moezoo("bench", "moe-layer", "--device", "cuda", "--tokens", "64", "512", "--experts", "16",
                    "--hidden", "256", "--expert-width", "128", "--seconds-per-case", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    triton_rows = [row for row in rows if row["impl"] == "moezoo_triton"]
    assert [row["mode"] for row in triton_rows] == ["fwd", "fwd_bwd", "fwd", "fwd_bwd"]
    for row in triton_rows:
        assert (row["ms"] is not None) == (row["mode"] == "fwd")
        if row["ms"] is not None:
            assert row["max_rel_diff_vs_eager"] <= 1e-5 and row["speedup_vs_best_transformers"] > 0


def test_targets_are_checked_on_the_case_they_are_set_for(capsys):
    """moezoo's rows against its speed-up and accuracy targets, with eager's own error beside a missed bound."""
    from moezoo.bench.moe_layer import TARGET_CASE, BenchRow, check_targets, print_target_checks

    def row(impl, tokens, mode, speedup, diff, fp64_error):
        return BenchRow(impl, tokens, mode, 1.0, 1.0, 1.0, diff, max_abs_err_vs_fp64=fp64_error,
                        speedup_vs_best_transformers=speedup)

    rows = [
        row("eager", 64, "fwd", 0.6, 0.0, 3e-7), row("moezoo", 64, "fwd", 2.1, 4e-7, 3e-7),
        row("eager", 64, "fwd_bwd", 0.2, 0.0, 1.4e-5), row("moezoo", 64, "fwd_bwd", 2.5, 3e-5, 1.3e-5),
        row("eager", 512, "fwd", 1.0, 0.0, 3e-7), row("moezoo", 512, "fwd", 1.9, 4e-7, 3e-7),  # no target at 512
    ]
    checks = check_targets(rows, **TARGET_CASE)
    assert [(c.tokens, c.mode, c.speedup_target) for c in checks] == [(64, "fwd", 2.0), (64, "fwd_bwd", 3.0)]
    assert checks[0].verdict() == "met"
    assert checks[1].verdict() == "speed missed; max |Δ| missed (eager itself is off fp64 by more than 1e-05)"
    assert check_targets(rows, **{**TARGET_CASE, "hidden": 256}) == []
    assert check_targets(rows, **{**TARGET_CASE, "dtype": torch.bfloat16}) == []

    print_target_checks(checks)
    out = capsys.readouterr().out
    assert "moezoo against its targets" in out and ">= 3x" in out and "speed missed" in out
