"""Model folders on disk: written atomically, with a provenance record beside the weights."""

from __future__ import annotations

import json
import os
import shutil
import secrets
from contextlib import contextmanager
from pathlib import Path


PROVENANCE_FILE = "moezoo.json"


@contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False):
    """Yield a temporary folder beside `out`; on success it becomes `out`, on any error it is removed.

    A command interrupted half-way therefore never leaves a folder that looks complete.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder; choose another --out or remove it")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _new_folder_beside(out)
    try:
        yield staging
        if out.exists():
            previous = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            out.rename(previous)
            staging.rename(out)
            shutil.rmtree(previous)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _new_folder_beside(out: Path) -> Path:
    """A new empty folder `.{name}.partial-<random>` beside `out`, with the permissions the umask gives (mkdtemp's
    are 0700, which would make every output folder private to its owner on a shared machine)."""
    while True:
        staging = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging


def read_provenance(folder: str | Path) -> dict:
    path = Path(folder) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_provenance(folder: str | Path, provenance: dict) -> None:
    (Path(folder) / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


def update_provenance(folder: str | Path, **changes) -> dict:
    provenance = read_provenance(folder) | changes
    write_provenance(folder, provenance)
    return provenance
