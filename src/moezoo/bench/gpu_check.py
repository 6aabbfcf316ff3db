"""`moezoo bench gpu-check` (`make gpu-check`): moezoo's GPU paths tested and timed in one prepared run of under
8 minutes on one GPU, written to one folder as `gpu_check.json` and `gpu_check.md`.

The steps run one after the other, each in a fresh process with its own time budget; one that overruns it is
stopped, with every process it started, and reported, and the next one runs:

1. `tests`: pytest on the kernel tests (`tests/test_triton_experts.py`: the Triton experts in fp32 and bf16, forward
   and backward) and, in the other files named by `GPU_TEST_FILES` and the conformance files, the tests whose names
   say they need a GPU or a GPU library (flash-attn, fla's packed Gated DeltaNet), which skip what is not installed.
2. `moe-layer`: `moezoo bench moe-layer --device cuda --dtype bfloat16`, every experts implementation with its share
   of the GPU's bf16 matmul peak, and moezoo_triton against grouped_mm's time: the GPU targets of issue 21.
3. `moe-vie`: `moezoo bench moe-vie --size h14 --device cuda --dtype bfloat16` (the MoE-ViE paper's Tab. 7 protocol).
4. `moemb`: `moezoo bench moemb --device cuda`.

The report is written again after each step, so a run stopped from outside leaves the steps it finished; each step's
output is in `STEP.log` beside it, and the tests' JUnit XML in `tests.xml`. Nothing needs network access. The
command's exit status is 1 when a step failed or overran its budget (a missed speed target is reported, not a
failure).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..terminal import console, format_cell
from .moe_layer import GPU_TARGETS, TARGETS_NOTE, TargetCheck, target_check_table


# The source checkout this module lies in (`src/moezoo/bench/`): the tests are run from it.
REPOSITORY = Path(__file__).resolve().parents[3]
TIME_LIMIT_S = 8 * 60
# Files with GPU-only tests besides the kernels' own, and the names that select those tests in them (pytest's -k,
# which also matches the module's name: every test of tests/test_triton_experts.py is selected).
GPU_TEST_FILES = (
    "tests/test_triton_experts.py",
    "tests/test_moemb_model.py",
    "tests/test_moemb_packed.py",
    "tests/test_cli_bench.py",
    "tests/test_bench_moe_vie.py",
)
GPU_TEST_SELECTION = "triton or cuda or gpu or fla_ or flash_attn"
# The columns of each benchmark's rows in the Markdown report: {key of its --json rows: header}.
BENCH_COLUMNS = {
    "moe-layer": {
        "impl": "impl", "tokens": "tokens", "mode": "mode", "ms": "ms", "gflops": "GFLOP/s",
        "pct_of_matmul_peak": "% of matmul peak", "speedup_vs_best_transformers": "× best transformers",
        "max_rel_diff_vs_eager": "rel |Δ| vs eager", "note": "note",
    },
    "moe-vie": {
        "model": "model", "impl": "impl", "batch_size": "batch", "ms": "ms", "images_per_second": "images/s",
        "speedup_vs_dense": "× dense", "speedup_vs_siglip2": "× SigLIP2",
        "speedup_vs_best_transformers": "× best transformers", "max_abs_diff_vs_eager": "max |Δ| vs eager",
        "note": "note",
    },
    "moemb": {
        "inputs": "inputs", "model": "model", "impl": "impl", "batch_size": "batch", "ms": "ms",
        "embeddings_per_second": "embeddings/s", "overhead_vs_transformers": "overhead vs transformers (fraction)",
        "speedup_vs_eager": "× eager", "max_abs_diff_vs_transformers": "max |Δ| vs transformers", "note": "note",
    },
}  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One command of the check. `kind` "tests": pytest with `args`, read from its JUnit XML; "bench": `moezoo bench`
    with `args` and `--json`, read from what it prints."""

    name: str
    kind: str
    args: tuple[str, ...]
    budget_s: float

    def command(self, out: Path) -> list[str]:
        if self.kind == "tests":
            return [sys.executable, "-m", "pytest", *self.args, f"--junitxml={out / f'{self.name}.xml'}"]
        return [sys.executable, "-m", "moezoo.cli", "bench", *self.args, "--json"]


def gpu_check_steps() -> list[Step]:
    """The steps of `make gpu-check`; their budgets add up to 7 min 40 s, under `TIME_LIMIT_S` with this process's
    own start."""
    conformance = sorted(path.relative_to(REPOSITORY).as_posix()
                         for path in REPOSITORY.glob("tests/test_conformance_*.py"))  # fmt: skip
    return [
        # Four workers compile the Triton kernels in parallel; a file that fails to import leaves the others to run.
        Step("tests", "tests", (*GPU_TEST_FILES, *conformance, "-k", GPU_TEST_SELECTION, "-n", "4", "-q", "-rfEs",
                                "-p", "no:cacheprovider", "--continue-on-collection-errors"), 160),
        Step("moe-layer", "bench", ("moe-layer", "--device", "cuda", "--dtype", "bfloat16", "--seconds-per-case", "3"),
             60),
        # Building the H/14 towers (5.1 B parameters together, initialised on the CPU) takes a good part of it.
        Step("moe-vie", "bench", ("moe-vie", "--size", "h14", "--device", "cuda", "--dtype", "bfloat16",
                                  "--batch-size", "16", "32", "64", "128", "--seconds-per-case", "8"), 180),
        Step("moemb", "bench", ("moemb", "--device", "cuda", "--seconds-per-case", "10"), 60),
    ]  # fmt: skip


@dataclass
class StepResult:
    name: str
    command: str
    budget_s: float
    seconds: float
    returncode: int | None  # None: stopped at its budget
    # a bench's --json output, or the tests' summary (`summarize_junit`)
    results: dict | list | None = None
    # why it failed: the last lines of its log, or what was wrong with its output
    error: str = ""

    @property
    def status(self) -> str:
        if self.returncode is None:
            return f"stopped at its {self.budget_s:g} s budget"
        if self.returncode != 0:
            return f"failed (exit status {self.returncode})"
        return "failed (unreadable output)" if self.error else "passed"

    @property
    def ok(self) -> bool:
        return self.status == "passed"


def check_cuda() -> None:
    """Raise a `ValueError` unless torch sees a CUDA GPU: the check is about nothing else."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"moezoo bench gpu-check needs a CUDA GPU, and torch sees none here (torch {torch.__version__}, {build}); "
            "run it on a machine with an NVIDIA GPU and a CUDA build of torch"
        )


def run_step(step: Step, out: Path) -> StepResult:
    """Run `step` from the repository's root, its output in `out/NAME.log`, stopped at its budget."""
    log_path, junit = out / f"{step.name}.log", out / f"{step.name}.xml"
    junit.unlink(missing_ok=True)  # a previous run's, which a step stopped before writing its own would leave
    command = step.command(out)
    started = time.perf_counter()
    stdout, overran = "", False
    with log_path.open("w") as log:
        # A session of its own, so that the step's processes (pytest's workers too) can be stopped together.
        # Offline: on a machine without network a Hub request would wait for its timeout, not fail.
        process = subprocess.Popen(
            command, cwd=REPOSITORY, env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.PIPE if step.kind == "bench" else log,
            stderr=log if step.kind == "bench" else subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            stdout, _ = process.communicate(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            overran = True
        finally:  # past its budget, or this command was interrupted (Ctrl-C, a kill): the step stops with it
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    returncode = None if overran else process.returncode
    result = StepResult(step.name, shlex.join(command), step.budget_s, time.perf_counter() - started, returncode)
    if step.kind == "tests":
        result.results = summarize_junit(junit) if junit.exists() else None
    elif returncode == 0:
        try:
            result.results = json.loads(stdout)
        except json.JSONDecodeError as error:
            result.error = f"its output is not JSON ({error}): {stdout[-500:]}"
    if returncode != 0 and not result.error:
        result.error = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    return result


def summarize_junit(path: Path) -> dict:
    """Counts of a pytest JUnit XML report, the failed tests by name, and the skipped ones counted by reason."""
    outcomes: Counter[str] = Counter()
    failed, skip_reasons = [], Counter()
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes[outcome] += 1
        if outcome in ("failure", "error"):
            failed.append(name)
        elif outcome == "skipped":
            skip_reasons[case.find("skipped").get("message", "")] += 1
    return {
        "tests": sum(outcomes.values()), "passed": outcomes["passed"], "failed": outcomes["failure"],
        "errors": outcomes["error"], "skipped": outcomes["skipped"], "failed_tests": failed,
        "skip_reasons": dict(skip_reasons.most_common()),
    }  # fmt: skip


def describe_environment(gpu: str) -> dict:
    """What the report was measured with: the GPU (named by the caller, from CUDA) and the library versions."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "moezoo": __version__,
        **{package: version(package) for package in ("transformers", "triton", "flash-attn", "flash-linear-attention")},
        "python": sys.version.split()[0], "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }  # fmt: skip


def gpu_target_checks(results: Sequence[StepResult]) -> list[TargetCheck] | None:
    """moezoo_triton's checks against the GPU targets, from the moe-layer step's output; None if it has none."""
    moe_layer = next((result for result in results if result.name == "moe-layer" and result.results), None)
    if moe_layer is None:
        return None
    names = [field.name for field in fields(TargetCheck)]
    return [TargetCheck(**{name: check[name] for name in names}) for check in moe_layer.results["targets"]]


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    def line(cells: Iterable[object]) -> str:  # a "|" in a cell ("rel |Δ|") would end it
        return "| " + " | ".join(format_cell(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns), *map(line, rows)])


def markdown_report(environment: dict, results: Sequence[StepResult]) -> str:
    """The whole report as Markdown: the steps, the tests, the GPU targets with their verdicts, every bench's rows."""
    versions = ", ".join(f"{name} {value}" for name, value in environment.items() if name not in ("gpu", "date"))
    sections = [
        f"# moezoo GPU check\n\n{environment['gpu']}; {versions}; {environment['date']}.",
        markdown_table(["step", "status", "seconds", "budget (s)", "command"],
                       [[r.name, r.status, r.seconds, r.budget_s, f"`{r.command}`"] for r in results]),
    ]  # fmt: skip
    sections += [f"**{r.name}** {r.status}:\n\n```\n{r.error}\n```" for r in results if r.error]
    tests = next((r.results for r in results if r.name == "tests" and r.results), None)
    if tests is not None:
        counts = ", ".join(f"{tests[key]} {key}" for key in ("passed", "failed", "errors", "skipped"))
        sections.append(f"## Tests\n\n{counts} (of {tests['tests']}).")
        if tests["failed_tests"]:
            sections.append("Failed:\n\n" + "\n".join(f"- `{name}`" for name in tests["failed_tests"]))
        if tests["skip_reasons"]:
            sections.append(markdown_table(["skipped because", "tests"], tests["skip_reasons"].items()))
    checks = gpu_target_checks(results)
    title = f"## GPU targets: {GPU_TARGETS.impl} against {GPU_TARGETS.baseline}, bfloat16, default shape"
    if checks:
        met = sum(check.met for check in checks)
        sections += [f"{title}\n\n{met} of {len(checks)} met.", markdown_table(*target_check_table(checks)),
                     TARGETS_NOTE]  # fmt: skip
    else:
        sections.append(f"{title}\n\nNot measured: the moe-layer step did not run to the end, or not on the case the "
                        "targets are set for.")  # fmt: skip
    for r in results:
        if r.name in BENCH_COLUMNS and r.results:
            rows = r.results["rows"] if isinstance(r.results, dict) else r.results
            columns = BENCH_COLUMNS[r.name]
            heading = f"## {r.name}"
            if r.name == "moe-layer":
                heading += f" (dense matmul peak in this dtype: {r.results['matmul_peak_gflops'] / 1e3:.0f} TFLOP/s)"
            sections += [heading, markdown_table(columns.values(), ([row[key] for key in columns] for row in rows))]
    return "\n\n".join(sections) + "\n"


def write_report(out: Path, environment: dict, results: Sequence[StepResult]) -> None:
    checks = gpu_target_checks(results)
    report = {
        "environment": environment,
        "time_limit_s": TIME_LIMIT_S,
        "steps": [{**asdict(result), "status": result.status} for result in results],
        "gpu_targets": None if checks is None else [check.as_dict() for check in checks],
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown_report(environment, results))


def run_gpu_check(out: str | Path, steps: Sequence[Step], environment: dict) -> list[StepResult]:
    """Run `steps` one after the other, writing the report into `out` after each."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for step in steps:
        console.print(f"{step.name}: running (at most {step.budget_s:g} s)")
        results.append(run_step(step, out))
        console.print(f"{step.name}: {results[-1].status} in {results[-1].seconds:.0f} s")
        write_report(out, environment, results)
    return results


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo bench gpu-check`."""
    parser.add_argument("--out", default="gpu_check_output",
                        help="folder for gpu_check.json, gpu_check.md and each step's log (files of a previous run "
                             "in it are replaced)")  # fmt: skip
    names = [step.name for step in gpu_check_steps()]
    parser.add_argument("--steps", nargs="+", choices=names, default=names, help="run only these steps")


def run_bench(args: argparse.Namespace) -> int:
    """`moezoo bench gpu-check` with the options of `add_bench_arguments`."""
    check_cuda()
    steps = [step for step in gpu_check_steps() if step.name in args.steps]
    results = run_gpu_check(args.out, steps, describe_environment(torch.cuda.get_device_name()))
    checks = gpu_target_checks(results)
    if checks:
        console.print(f"GPU targets: {sum(check.met for check in checks)} of {len(checks)} met")
    console.print(f"report: {Path(args.out) / 'gpu_check.md'} and gpu_check.json")
    return 0 if all(result.ok for result in results) else 1
