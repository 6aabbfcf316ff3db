"""Every command prints its own output and nothing else: `--help` of each command and subcommand of the parser,
`moezoo list` and `moezoo create`, run in a fresh interpreter, so that what the libraries print when they are first
imported shows (issue 28, item 2: DeepSpeed's "Setting accelerator to CPU" line on stdout, from the import that
accelerate makes in `save_pretrained` wherever DeepSpeed is installed, as it is here).

One interpreter runs them all, one after another, through `moezoo.cli.main`, with its file descriptors 1 and 2 sent
to files around each command (what C code or a library's own handler writes is caught too): an interpreter costs
seconds of imports, and whatever a module prints when it is imported shows in the first command that imports it.
"""

import json
import re

from conftest import run_python

CHILD = r"""
import argparse, json, os, sys, tempfile

def captured(call):
    '''`call()` with file descriptors 1 and 2 sent to files: (its exit status, stdout, stderr).'''
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            try:
                status = call()
            except SystemExit as exit:  # argparse's --help
                status = exit.code
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        return status or 0, out.read().decode(), err.read().decode()

def command_paths(parser, path=()):
    '''Every command line the parser takes before options: (), ("train",), ("train", "moe_vie"), ("bench", "moemb").'''
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from command_paths(subparser, (*path, name))
        elif action.choices and not action.option_strings:  # `train ARCH`: the architecture's module has the options
            yield from ((*path, choice) for choice in action.choices)

results = []
def run(name, call):
    status, out, err = captured(call)
    results.append(dict(command=name, status=status, out=out, err=err, deepspeed="deepspeed" in sys.modules))

def import_cli():
    import moezoo.cli

run("import moezoo.cli", import_cli)
from moezoo.cli import build_parser, main
from moezoo.registry import CONVERTERS

lines = [[*path, "--help"] for path in command_paths(build_parser())]
# With --to, convert's help adds the options of the converters into that architecture (imported then).
lines += [["convert", "--to", architecture, "--help"] for architecture in sorted({c.architecture for c in
                                                                                CONVERTERS.values()})]
for line in [*lines, ["list"], ["create", "tiny-moe_vie", "--out", OUT]]:
    run(" ".join(line), lambda: main(line))
with open(RESULTS, "w") as file:
    json.dump(results, file)
"""

# What the libraries' logging and warnings look like: `[WARNING]`, `WARNING:root:`, `UserWarning: ...`.
LIBRARY_LINE = re.compile(r"\[(DEBUG|INFO|WARNING|ERROR)\]|^(DEBUG|INFO|WARNING|ERROR):|\w+Warning: ", re.MULTILINE)


def test_commands_print_only_their_own_output(tmp_path):
    out_dir = tmp_path / "tiny-moe-vie"
    paths = f"RESULTS = {str(tmp_path / 'results.json')!r}\nOUT = {str(out_dir)!r}\n"
    # Progress bars on, as in a terminal (run_python turns huggingface_hub's off).
    child = run_python(paths + CHILD, env={"HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert (child.stdout, child.stderr) == ("", "")  # nothing outside the commands either (at exit)
    results = {result.pop("command"): result for result in json.loads((tmp_path / "results.json").read_text())}
    helps = [command for command in results if command.endswith("--help")]
    # Derived from the parser: each subcommand, architecture and benchmark.
    assert {"--help", "train moemb --help", "eval moe_vie --help", "bench moemb --help", "bench moe-layer --help",
            "convert --help", "convert --to moe_vie --help", "demo --help"} <= set(helps)  # fmt: skip
    for command, result in results.items():
        assert result["err"] == "" and LIBRARY_LINE.search(result["out"]) is None, (command, result)
        assert result["status"] == 0, (command, result)
    assert results["import moezoo.cli"]["out"] == ""
    for command in helps:
        words = command.removesuffix("--help").split()
        path = words[:1] if words[:1] == ["convert"] else words  # `convert --to X --help`: convert's help first
        assert results[command]["out"].startswith(" ".join(["usage: moezoo", *path])), command
    assert results["list"]["out"].lstrip().startswith("moezoo presets")
    assert results[f"create tiny-moe_vie --out {out_dir}"]["out"] == f"wrote tiny-moe_vie (seed 0) to {out_dir}\n"
    # DeepSpeed is imported by `--deepspeed` runs and (through accelerate) by saving a model, not by the commands' code.
    assert [command for command, result in results.items() if result["deepspeed"] and "create" not in command] == []
