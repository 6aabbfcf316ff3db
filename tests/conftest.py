"""Shared helpers: running code in a fresh Python process (with or without moezoo importable, or as two gloo
processes, one launch running several scenarios in turn), and the tiny checkpoints several test files use."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


TESTS = Path(__file__).resolve().parent
# Makes the toy architecture of tests/toy_arch known to `import moezoo` in child processes.
TOY_ENV = {"MOEZOO_EXTRA_PRESETS": "toy_arch.presets", "PYTHONPATH": str(TESTS)}
# First lines of a child process in which neither moezoo nor the toy package can be imported.
WITHOUT_MOEZOO = "import sys\nsys.modules['moezoo'] = None\nsys.modules['toy_arch'] = None\n"

# Triton runs on the CPU only in its interpreter, which must be on before triton decorates the first kernel; child
# processes inherit it. On a machine with a GPU the kernels are compiled and tested on it instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs one pytest-xdist worker per core: each worker, and every process it starts, computes on one thread
# so the workers do not fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# The package of transformers' common tests is imported by the conformance test modules, not collected itself.
collect_ignore = ["transformers_tests"]

# Markers that transformers' common test files and testing_utils put on their tests (its own conftest registers them).
TRANSFORMERS_MARKERS = (
    "accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test",
    "is_agent_test", "is_expert_parallel_test", "is_fsdp_test", "is_pipeline_test", "is_staging_test",
    "is_tensor_parallel_test", "is_training_test", "order",
)


def pytest_configure(config):
    for marker in TRANSFORMERS_MARKERS:
        config.addinivalue_line("markers", f"{marker}: used by transformers' common tests")


def pytest_collection_modifyitems(config, items):
    """The files that hold slow tests run first. `make test` hands each pytest-xdist worker one whole file at a time
    (`--dist loadfile`), in collection order, so a long file collected late would leave the other worker idle while
    it finishes; started first, the long files overlap with the many short ones."""
    files_with_slow_tests = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in files_with_slow_tests)  # a stable sort: files stay whole, in order


def run_python(code: str, env: dict | None = None, cwd=None, timeout: int = 300,
               without_moezoo: bool = False) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; fail the test with its output if it fails."""
    code = (WITHOUT_MOEZOO if without_moezoo else "") + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})},
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, f"child process failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def exported_moemb_outputs(folder: Path, inputs: dict, tmp_path: Path) -> tuple[torch.Tensor, float]:
    """Embeddings and logical FLOPs saving of the exported MoEMB `folder` on `inputs`, computed in a fresh process in
    which moezoo cannot be imported (transformers loads the folder's own code)."""
    torch.save(inputs, tmp_path / "inputs.pt")
    run_python(f"""
        import torch, transformers
        model = transformers.AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(**torch.load({str(tmp_path / "inputs.pt")!r}))
        torch.save((out.embeddings, float(out.adaptive.flops_saving)), {str(tmp_path / "outputs.pt")!r})
    """, without_moezoo=True)
    return torch.load(tmp_path / "outputs.pt")


def run_moezoo(*args, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the `moezoo` command in a fresh process (without failing on a non-zero exit)."""
    return subprocess.run(
        [sys.executable, "-m", "moezoo.cli", *map(str, args)],
        env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **TOY_ENV, **(env or {})},
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


def run_moezoo_in_this_process(capfd, *args) -> subprocess.CompletedProcess:
    """`moezoo ARGS` through the command's entry point (`moezoo.cli.main`) in this process, without a fresh
    interpreter's seconds of imports, as `run_moezoo` reports it; the toy architecture is known once the test asks
    for `toy_registered`. An exception escaping `main` fails the test, as its traceback would."""
    from moezoo.cli import main

    capfd.readouterr()
    try:
        status = main(list(map(str, args)))
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    captured = capfd.readouterr()
    return subprocess.CompletedProcess(["moezoo", *map(str, args)], status, captured.out, captured.err)


def free_port() -> int:
    """A local TCP port nobody listens on (at the time of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_processes(script: Path, *args, nproc: int = 2, env: dict | None = None, timeout: int = 180,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` (with `args`) as `nproc` processes under torchrun on this machine, one thread each, with `env`
    added to the environment; with `check`, fail the test if any process fails."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(script), *map(str, args)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_two_processes(script: Path, *args, timeout: int = 180) -> None:
    """Run `script` (with `args`) as two processes under torchrun on this machine; fail the test if either fails."""
    run_processes(script, *args, timeout=timeout)


class Scenarios:
    """One torchrun launch of `script` on `nproc` processes that runs several scenarios in turn: importing torch,
    transformers and moezoo and starting the process group cost most of a launch on a loaded machine, so the tests of
    a file share one. `scenarios` maps a name to the arguments of the script's `main`; each test checks that its
    scenario ended as it should (`check`: completed, or interrupted on purpose) and then reads what its run wrote, as
    after a launch of its own. Every process runs them in order and stops at the first failure (torchrun then ends
    the others), so the scenarios after a failed one fail too, each with the launch's stderr. The script runs them
    through `run_scenarios`. A second launch of the same script over the same folder (`resume_interrupted`) takes
    another `launch` name, which keeps the two launches' plans and marks apart."""

    def __init__(self, script: Path, scenarios: dict[str, list], root: Path, nproc: int = 2,
                 env: dict | None = None, timeout_per_scenario: int = 240, launch: str = "launch"):  # fmt: skip
        self.script, self.root, self.nproc, self.env = script, root, nproc, env
        self.done = root / f"{launch}.completed"
        self.done.mkdir(parents=True)
        plan = root / f"{launch}.json"
        plan.write_text(json.dumps({name: list(map(str, args)) for name, args in scenarios.items()}))
        try:
            result = run_processes(script, SCENARIOS_FLAG, plan, self.done, nproc=nproc, env=env, check=False,
                                   timeout=60 + timeout_per_scenario * len(scenarios))  # fmt: skip
            self.report = f"launch exit status {result.returncode}:\n{result.stderr[-5000:]}"
        except subprocess.TimeoutExpired as timeout:
            stderr = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else timeout.stderr
            self.report = f"launch timed out after {timeout.timeout} s:\n{(stderr or '')[-5000:]}"

    def check(self, name: str, exit_status: int = 0) -> Path:
        """Fail the test unless scenario `name` ended on every process with `exit_status` (0: it completed; a run
        interrupted on purpose exits with its own status, see `run_scenarios`); else `ROOT/name`, the folder its run
        writes to by the callers' convention."""
        marks = [self.done / f"{name}.{rank}" for rank in range(self.nproc)]
        statuses = [mark.read_text() if mark.exists() else "none" for mark in marks]
        assert statuses == [str(exit_status)] * self.nproc, (
            f"scenario {name} ended with exit status {', '.join(statuses)} (by rank), not {exit_status}; {self.report}"
        )
        return self.root / name


SCENARIOS_FLAG = "--scenarios"


def run_scenarios(main, argv: list[str]) -> None:
    """The command line of a test file run as a torchrun script: `main(argv)`, or with `--scenarios PLAN DONE` (from
    `Scenarios`) `main` on each scenario's arguments in turn, each marked in DONE by every process with its exit
    status: 0, or the status of the `SystemExit` that ended it (a run interrupted on purpose, which the launch
    outlives); any other exception ends the launch. Between scenarios the process keeps what `main` set up globally
    (the process group, accelerate's state), so `main` must undo its own patches."""
    if argv[:1] != [SCENARIOS_FLAG]:
        main(argv)
        return
    plan, done = json.loads(Path(argv[1]).read_text()), Path(argv[2])
    for name, args in plan.items():
        try:
            main(args)
            status = 0
        except SystemExit as exit:
            status = exit.code
        (done / f"{name}.{os.environ['RANK']}").write_text(str(status))


def resume_interrupted(launched: Scenarios, resumptions: dict[str, list]) -> Scenarios:
    """The runs that `launched` interrupted after a checkpoint, resumed in a second launch of its script, as after a
    real interruption. `resumptions` maps the name of each interrupted run to
    the arguments of its resumption, scenario `NAME-resumed`, which writes `ROOT/NAME-resumed` (its arguments name
    that folder) from a copy of the interrupted run's checkpoints, `ROOT/NAME-resumed.checkpoints`: the interrupted
    run's own folders stay as it left them, for the tests to read."""
    for name in resumptions:
        checkpoints = launched.root / f"{name}.checkpoints"
        if checkpoints.exists():  # else the test fails on the interrupted run's exit status
            shutil.copytree(checkpoints, launched.root / f"{name}-resumed.checkpoints")
    return Scenarios(launched.script, {f"{name}-resumed": args for name, args in resumptions.items()}, launched.root,
                     nproc=launched.nproc, env=launched.env, launch="resumptions")  # fmt: skip


@pytest.fixture(scope="session")
def tiny_moemb(tmp_path_factory):
    """A randomly initialised tiny MoEMB folder (seed 0) with its processor."""
    from transformers import AutoImageProcessor

    from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
    from moezoo.modeling.moemb import MoEmbForEmbedding
    from moezoo.processors.build_moemb import make_moemb_processor
    from moezoo.processors.moemb import MoEmbImageProcessor

    config = MoEmbConfig(**TINY_MOEMB)
    AutoImageProcessor.register(MoEmbConfig, image_processor_classes={"pil": MoEmbImageProcessor}, exist_ok=True)
    folder = tmp_path_factory.mktemp("tiny_moemb") / "model"
    torch.manual_seed(0)
    MoEmbForEmbedding(config).save_pretrained(folder)
    make_moemb_processor(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def toy_registered():
    """Register the toy architecture in this process too."""
    from moezoo.registry import ARCHITECTURES, register, register_auto_classes

    sys.path.insert(0, str(TESTS))
    from toy_arch import presets

    toy = presets.ARCHITECTURES[0]
    if toy.name not in ARCHITECTURES:
        register(presets.ARCHITECTURES, presets.PRESETS, presets.CONVERTERS)
        register_auto_classes(toy)
    return toy
