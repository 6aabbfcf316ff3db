"""`moezoo bench gpu-check` without a GPU: it refuses to start, its steps fit the time limit and parse, and its runner
and report (JSON and Markdown) work on CPU-sized steps and fake rows; only the CUDA calls are left to a GPU."""

import argparse
import ast
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from moezoo.bench import gpu_check, moemb
from moezoo.bench.gpu_check import (
    BENCH_COLUMNS,
    GPU_TEST_FILES,
    GPU_TEST_SELECTION,
    REPOSITORY,
    TIME_LIMIT_S,
    Step,
    StepResult,
    gpu_check_steps,
    run_gpu_check,
    write_report,
)
from moezoo.bench.moe_layer import GPU_TARGETS, BenchRow, check_targets, rows_as_dicts
from moezoo.bench.moe_vie import VieBenchRow
from moezoo.bench.moemb import EmbedBenchRow
from moezoo.cli import build_parser, main


ENVIRONMENT = {"gpu": "NVIDIA Test GPU", "torch": "2.x", "triton": "not installed", "date": "2026-12-01 18:00 UTC"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_fails_fast_without_a_gpu(tmp_path, capsys):
    assert main(["bench", "gpu-check", "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert "gpu-check needs a CUDA GPU, and torch sees none here" in err and "Traceback" not in err
    assert not (tmp_path / "report").exists()


def test_the_steps_fit_the_time_limit_and_their_commands_parse():
    steps = gpu_check_steps()
    assert [step.name for step in steps] == ["tests", "moe-layer", "moe-vie", "moemb"]
    assert sum(step.budget_s for step in steps) <= TIME_LIMIT_S - 20  # 20 s left for the check's own start

    test_paths = [arg for arg in steps[0].args if arg.startswith("tests/")]
    assert set(GPU_TEST_FILES) <= set(test_paths) and "tests/test_conformance_moemb.py" in test_paths
    assert all((REPOSITORY / path).is_file() for path in test_paths)

    parser = build_parser()
    moe_layer = parser.parse_args(["bench", *steps[1].args, "--json"])
    case = {"num_experts": moe_layer.experts, "top_k": moe_layer.top_k, "hidden": moe_layer.hidden,
            "expert_width": moe_layer.expert_width, "dtype": getattr(torch, moe_layer.dtype),
            "device": moe_layer.device}  # fmt: skip
    assert case == GPU_TARGETS.case and moe_layer.tokens == [64, 2048, 8192]  # the case the GPU targets are set for
    moe_vie = parser.parse_args(["bench", *steps[2].args, "--json"])
    assert (moe_vie.size, moe_vie.device, moe_vie.dtype) == ("h14", "cuda", "bfloat16")
    moemb_parser = argparse.ArgumentParser()
    moemb.add_bench_arguments(moemb_parser)
    assert parser.parse_args(["bench", *steps[3].args[:1]]).options == []
    assert moemb_parser.parse_args([*steps[3].args[1:], "--json"]).device == "cuda"


@pytest.mark.slow
def test_the_test_selection_takes_every_kernel_test_and_the_gpu_ones_elsewhere():
    """pytest's -k matches module names too: every test of the kernels' file is selected, by its file name."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_triton_experts.py",
         "tests/test_cli_bench.py", "-k", GPU_TEST_SELECTION],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    selected = {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line}
    kernel_tests = [node.name for node in ast.parse((REPOSITORY / "tests/test_triton_experts.py").read_text()).body
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]  # fmt: skip
    assert kernel_tests and {f"tests/test_triton_experts.py::{name}" for name in kernel_tests} <= selected
    assert "tests/test_cli_bench.py::test_bench_moe_layer_on_a_gpu" in selected
    assert "tests/test_cli_bench.py::test_bench_moe_layer_json_rows" not in selected


@pytest.mark.slow
def test_a_run_writes_the_report_after_every_step(tmp_path):
    """The runner on CPU-sized steps, offline: failed tests, a bench that runs, one that fails, one stopped at its
    budget."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(textwrap.dedent("""
        import os

        import pytest

        def test_passes():
            assert os.environ["HF_HUB_OFFLINE"] == "1"  # the GPU machine may have no network

        @pytest.mark.skip(reason="needs a GPU library")
        def test_skipped():
            pass

        def test_fails():
            assert False
    """))
    steps = [
        # The sample file's test ids are relative to its own folder wherever the temporary folder lies.
        Step("tests", "tests", (str(test_file), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)), 120),
        Step("moe-layer", "bench", ("moe-layer", "--tokens", "8", "--experts", "4", "--top-k", "2", "--hidden", "32",
                                    "--expert-width", "16", "--mode", "fwd", "--seconds-per-case", "0", "--threads",
                                    "1"), 300),
        Step("moe-vie", "bench", ("moe-vie", "--batch-size", "0"), 300),
        Step("moemb", "bench", ("moemb", "--size", "tiny"), 0.5),
    ]  # fmt: skip
    out = tmp_path / "report"
    results = run_gpu_check(out, steps, ENVIRONMENT)

    assert [result.status for result in results] == [
        "failed (exit status 1)", "passed", "failed (exit status 2)", "stopped at its 0.5 s budget"
    ]
    tests = results[0].results
    assert {key: tests[key] for key in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1
    }
    assert tests["failed_tests"] == ["test_sample::test_fails"]
    assert [reason for reason in tests["skip_reasons"]] == ["needs a GPU library"]
    assert results[1].results["rows"][0]["impl"] == "eager" and results[1].results["targets"] == []
    assert "batch sizes must be positive, got 0" in results[2].error

    report = json.loads((out / "gpu_check.json").read_text())
    assert [step["status"] for step in report["steps"]] == [result.status for result in results]
    assert report["gpu_targets"] == [] and report["environment"] == ENVIRONMENT
    markdown = (out / "gpu_check.md").read_text()
    assert "1 passed, 1 failed, 0 errors, 1 skipped (of 3)" in markdown and "`test_sample::test_fails`" in markdown
    assert "Not measured" in markdown and "## moe-layer" in markdown and "batch sizes must be positive" in markdown
    assert sorted(path.name for path in out.iterdir()) == [
        "gpu_check.json", "gpu_check.md", "moe-layer.log", "moe-vie.log", "moemb.log", "tests.log", "tests.xml"
    ]


def test_the_report_gives_the_gpu_targets_their_verdicts(tmp_path):
    """Fake rows of every benchmark: the Markdown holds the GPU targets with a verdict each, and every bench's rows."""
    timings = {(64, "fwd"): (1.3, 1.0), (8192, "fwd"): (1.0, 1.2), (2048, "fwd_bwd"): (1.5, 1.0)}
    rows = [
        BenchRow(impl, tokens, mode, ms, 1e5, 40.0, 0.0, 0.0, 1e-3, weights_read_ms=0.05)
        for (tokens, mode), pair in timings.items() for impl, ms in zip(("grouped_mm", "moezoo_triton"), pair)
    ]  # fmt: skip
    checks = check_targets(rows, **GPU_TARGETS.case)
    moe_layer = {"case": {}, "matmul_peak_gflops": 7.5e5, "rows": rows_as_dicts(rows),
                 "targets": [check.as_dict() for check in checks]}  # fmt: skip
    moe_vie = [dataclasses.asdict(VieBenchRow("moe_vie", "moezoo_triton", 16, 1024, 80.0, 200.0, 10**9, 10**8))]
    results = [
        StepResult("tests", "pytest tests/test_triton_experts.py", 160, 93.0, 0,
                   {"tests": 2, "passed": 1, "failed": 0, "errors": 0, "skipped": 1, "failed_tests": [],
                    "skip_reasons": {"needs flash-attn": 1}}),
        StepResult("moe-layer", "moezoo bench moe-layer --device cuda", 70, 41.0, 0, moe_layer),
        StepResult("moe-vie", "moezoo bench moe-vie --size h14", 170, 52.0, 0, moe_vie),
        StepResult("moemb", "moezoo bench moemb --device cuda", 60, 60.0, None, error="building the models"),
    ]  # fmt: skip
    write_report(tmp_path, ENVIRONMENT, results)

    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "NVIDIA Test GPU" in markdown and "1 passed, 0 failed, 0 errors, 1 skipped (of 2)" in markdown
    assert "## GPU targets: moezoo_triton against grouped_mm" in markdown and "2 of 3 met" in markdown
    target_lines = [line for line in markdown.splitlines() if line.startswith(("| 64 | fwd |", "| 8192 | fwd |"))]
    assert "| 1.3 | >= 1.3 | met |" in target_lines[0] and "| 0.833 | >= 0.909 | MISSED |" in target_lines[1]
    assert "stopped at its 60 s budget" in markdown and "building the models" in markdown
    assert "| rel \\|Δ\\| vs eager |" in markdown  # escaped: a bare "|" would split the column
    assert "dense matmul peak in this dtype: 750 TFLOP/s" in markdown and "## moe-vie" in markdown
    assert "| moe_vie | moezoo_triton | 16 | 80.0 | 200.0 |" in markdown
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [check["verdicts"] for check in report["gpu_targets"]] == [
        {"speedup": True}, {"speedup": False}, {"speedup": True}
    ]


def test_the_command_runs_the_steps_asked_for(tmp_path, monkeypatch, capsys):
    """`run_bench` with its CUDA calls replaced: it runs the --steps asked for, and exits 1 when one fails."""
    test_file = tmp_path / "test_ok.py"
    test_file.write_text("def test_ok():\n    pass\n")
    steps = [Step("tests", "tests", (str(test_file), "-q", "-p", "no:cacheprovider"), 120),
             Step("broken", "tests", ("--no-such-option",), 120)]  # fmt: skip
    monkeypatch.setattr(gpu_check, "check_cuda", lambda: None)
    monkeypatch.setattr(gpu_check, "gpu_check_steps", lambda: steps)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA Test GPU")
    parser = argparse.ArgumentParser()
    gpu_check.add_bench_arguments(parser)

    out = tmp_path / "report"
    assert gpu_check.run_bench(parser.parse_args(["--out", str(out), "--steps", "tests"])) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert [step["name"] for step in report["steps"]] == ["tests"] and report["environment"]["gpu"] == "NVIDIA Test GPU"
    assert report["steps"][0]["results"]["passed"] == 1
    assert "gpu_check.md" in capsys.readouterr().out
    assert gpu_check.run_bench(parser.parse_args(["--out", str(out)])) == 1  # both steps: "broken" fails
    assert [step["status"] for step in json.loads((out / "gpu_check.json").read_text())["steps"]] == [
        "passed", "failed (exit status 4)"
    ]


def test_the_markdown_columns_are_fields_of_the_bench_rows():
    for name, row_class in (("moe-layer", BenchRow), ("moe-vie", VieBenchRow), ("moemb", EmbedBenchRow)):
        assert set(BENCH_COLUMNS[name]) <= {field.name for field in dataclasses.fields(row_class)}, name
