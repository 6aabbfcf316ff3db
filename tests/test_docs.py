"""The documentation runs as written: README.md and every page of docs/ (conventions in docs/index.md).

- ```python blocks are executed, each in a fresh namespace; ```py marks a fragment that is not.
- ```bash blocks are run by bash (-e -u -o pipefail) with the venv's `moezoo` and `python` first on PATH, offline
  (HF_HUB_OFFLINE=1); ```sh marks commands that are shown, not run (they need the network, a GPU, real data or hours,
  and the text says so). Each `moezoo` command runs in a process of its own, forked from one that imported the
  libraries the commands use (`command_server`), not through a fresh interpreter.
- ```console, ```text, ```json and ```yaml blocks are output or file contents, not run.
- The runnable blocks of a page run in order in one empty temporary folder, so a later block may use what an earlier
  one wrote (a data file, a model folder).

Besides: every code block names one of these kinds, every relative link points to a file of the repository (nothing
outside it: the documentation is read on GitHub and on the Hub), and every docs page is listed in docs/index.md.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
NOT_RUN = {"py", "sh", "console", "text", "json", "yaml"}
# Pages whose blocks take more than a few seconds (data_formats.md runs every train and eval command once).
SLOW_PAGES = {"data_formats.md"}
FENCE = re.compile(r"^(\s*)```(.*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(page: Path) -> list[tuple[str, int, str]]:
    """The fenced code blocks of a page as (kind, line number of the fence, code), indented ones dedented."""
    blocks, lines, index = [], page.read_text(encoding="utf-8").splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        start, body = index, []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index])
            index += 1
        assert index < len(lines), f"{page.name}:{start + 1}: a code block is never closed"
        blocks.append((opening.group(2).strip(), start + 1, textwrap.dedent("\n".join(body)) + "\n"))
        index += 1
    return blocks


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def page_params() -> list:
    return [pytest.param(page, id=page_id(page), marks=[pytest.mark.slow] if page.name in SLOW_PAGES else [])
            for page in PAGES]


# The environment of the pages' bash blocks and of the `moezoo` command server.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

# The command server: it imports the third-party libraries of the `moezoo` commands and the command itself once, then
# forks one process per command, which takes the client's arguments, working folder, environment and standard streams
# (their file descriptors, passed over the socket) and sends back its exit status, as the installed script would end.
# moezoo's own modules are left for each command to import, so a command that misses an import or a registration of
# its own fails here as in a fresh process. A fresh interpreter's imports cost most of a tiny command (~8 s of CPU).
COMMAND_SERVER = """
import json, os, signal, socket, sys, traceback

# imported once here, for the commands (not used by the server itself)
import accelerate, datasets, matplotlib.pyplot, peft, safetensors.torch, torch, trl
from transformers import PreTrainedModel, Trainer, TrainingArguments

from moezoo.cli import main


# Waited for (with os.WNOHANG: those that have ended), the commands' processes count their CPU time as the server's,
# as a fresh process's would count as the test's.
def wait_for_commands(options=0):
    try:
        while os.waitpid(-1, options) != (0, 0):
            pass
    except ChildProcessError:  # none left
        pass


def stop(*_):
    wait_for_commands()
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("ready", flush=True)
while True:
    connection, _ = listener.accept()
    wait_for_commands(os.WNOHANG)
    _, streams, _, _ = socket.recv_fds(connection, 1, 3)
    request = b""
    while chunk := connection.recv(1 << 16):
        request += chunk
    if os.fork():
        connection.close()
        for stream in streams:
            os.close(stream)
        continue
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    listener.close()
    for number, stream in enumerate(streams):
        os.dup2(stream, number)
        os.close(stream)
    request = json.loads(request)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    try:
        status = main(sys.argv[1:])
    except SystemExit as exit:
        status = exit.code
    except BaseException:
        traceback.print_exc()
        status = 1
    if not isinstance(status, int):  # sys.exit(None) or sys.exit(message), as the interpreter ends
        if status is not None:
            print(status, file=sys.stderr)
        status = 0 if status is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    connection.sendall(str(status).encode())
    os._exit(status)
"""

# The `moezoo` of the pages: hands its arguments, folder, environment and streams to the server, exits with the
# command's status. Standard library only (-IS), so it starts in milliseconds.
COMMAND_CLIENT = """#!{python} -IS
import json, os, socket, sys

connection = socket.socket(socket.AF_UNIX)
connection.connect({address!r})
socket.send_fds(connection, [b"."], [0, 1, 2])
connection.sendall(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode())
connection.shutdown(socket.SHUT_WR)
status = connection.recv(16)
sys.exit(int(status) if status else "moezoo: the command's process ended without an exit status")
"""


@pytest.fixture(scope="module")
def command_server(tmp_path_factory):
    """A folder holding the `moezoo` client, to put first on the pages' PATH, while the command server runs."""
    folder = tmp_path_factory.mktemp("moezoo_command")
    address = folder / "server.socket"
    server = subprocess.Popen([sys.executable, "-c", COMMAND_SERVER, str(address)], env={**os.environ, **OFFLINE},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert server.stdout.readline() == "ready\n", "the moezoo command server did not start"
        client = folder / "bin" / "moezoo"
        client.parent.mkdir()
        client.write_text(COMMAND_CLIENT.format(python=sys.executable, address=str(address)))
        client.chmod(0o755)
        yield client.parent
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a command still running (a block that timed out): it and the server
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def run_bash(code: str, where: str, cwd: Path, command_dir: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)  # the venv's python (and moezoo, which `command_dir` stands in for)
    env = {**os.environ, "PATH": os.pathsep.join([str(command_dir), bin_dir, os.environ.get("PATH", "")]), **OFFLINE}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (
        f"{where} failed (exit {result.returncode}):\n{code}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-5000:]}"
    )


@pytest.mark.parametrize("page", page_params())
def test_page_runs(page, tmp_path, monkeypatch, command_server):
    """The page's python and bash blocks, in order, in one empty folder, offline (HF_HUB_OFFLINE for this process too:
    huggingface_hub reads it when it is imported, and whether it is offline from its constant)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    runnable = [(kind, line, code) for kind, line, code in code_blocks(page) if kind in RUN]
    for kind, line, code in runnable:
        where = f"{page_id(page)}:{line} ({kind} block)"
        if kind == "python":
            exec(compile(code, where, "exec"), {"__name__": "__docs__"})
        else:
            run_bash(code, where, tmp_path, command_server)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_code_blocks_name_their_kind(page):
    """A block without a kind, or of a kind the tests do not know (```Python, ```shell), would silently not run."""
    unknown = [f"line {line}: ```{kind}" for kind, line, _ in code_blocks(page) if kind not in RUN | NOT_RUN]
    assert not unknown, f"{page_id(page)}: code blocks of no known kind ({', '.join(sorted(RUN | NOT_RUN))}): {unknown}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation but - and _ dropped, spaces as -."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_stay_in_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text and "/work/" not in text, f"{page_id(page)} names a path outside the repository"
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{page_id(page)}: links to nothing in the repository: {broken}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link to {page.name}"
            assert f"(docs/{page.name})" in readme, f"README.md does not link to docs/{page.name}"


@pytest.mark.slow
def test_readme_counts_the_bad_input_checks():
    """The README says how many bad inputs the suite checks: the tests of the two catalogues, as pytest collects them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"checks (\d+) such bad\s+inputs, (\d+) of the `moezoo` command .*? and (\d+) of the processors",
                       readme, flags=re.S)
    assert stated, "README.md no longer says how many bad inputs the suite checks"
    files = ("tests/test_bad_input_catalogue.py", "tests/test_processor_bad_input.py")
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    counts = [sum(line.startswith(f"{name}::") for line in collected.stdout.splitlines()) for name in files]
    assert [int(n) for n in stated.groups()] == [sum(counts), *counts], (
        f"README.md states {stated.group(0)!r}; the suite has {counts} (command, processors)"
    )


def test_readme_names_the_pinned_versions():
    """The versions the README names are the ones `make setup` installs (constraints.txt)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    libraries = "torch|transformers|peft|trl|accelerate|datasets|huggingface_hub"
    named = dict(re.findall(rf"\b({libraries}) (\d+\.\d+\.\d+)", readme))
    pinned = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M))
    assert len(named) == 7, named
    assert {name: pinned[name] for name in named} == named


def test_readme_stays_an_index():
    """The guides live in docs/: the README is what moezoo is, the commands, the table, quickstarts and links."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the details into a page of docs/"
