"""The documentation runs as written: README.md and every page of docs/ (conventions in docs/index.md).

- ```python blocks are executed, each in a fresh namespace; ```py marks a fragment that is not.
- ```bash blocks are run by bash (-e -u -o pipefail) with the venv's `moezoo` and `python` first on PATH, offline
  (HF_HUB_OFFLINE=1); ```sh marks commands that are shown, not run (they need the network, a GPU, real data or hours,
  and the text says so).
- ```console, ```text, ```json and ```yaml blocks are output or file contents, not run.
- The runnable blocks of a page run in order in one empty temporary folder, so a later block may use what an earlier
  one wrote (a data file, a model folder).

Besides: every code block names one of these kinds, every relative link points to a file of the repository (nothing
outside it: the documentation is read on GitHub and on the Hub), and every docs page is listed in docs/index.md.
"""

import os
import re
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


def run_bash(code: str, where: str, cwd: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)  # the venv's python and moezoo
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (
        f"{where} failed (exit {result.returncode}):\n{code}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-5000:]}"
    )


@pytest.mark.parametrize("page", page_params())
def test_page_runs(page, tmp_path, monkeypatch):
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
            run_bash(code, where, tmp_path)


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
