"""Model folders on disk: written atomically, with a provenance record beside the weights."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
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
    _remove_stale_staging(out)
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
    """A new empty folder `.{name}.partial-<host>-<pid>-<random>` beside `out`, with the permissions the umask gives
    (mkdtemp's are 0700, which would make every output folder private to its owner on a shared machine). The host and
    process in the name let a later run tell a folder left by a killed process from one a live run is filling."""
    while True:
        staging = out.with_name(f"{_staging_prefix(out)}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _remove_stale_staging(out: Path) -> None:
    """Remove the staging folders beside `out` that processes of this host left when they were killed without a chance
    to clean up (SIGKILL, the out-of-memory killer, a power cut); those of live processes, or of other hosts sharing
    the file system, are kept."""
    host = socket.gethostname()
    for folder in out.parent.glob(f"{_staging_prefix(out)}{host}-*"):
        pid = folder.name.removeprefix(f"{_staging_prefix(out)}{host}-").partition("-")[0]
        if pid.isdigit() and not _process_is_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def read_provenance(folder: str | Path) -> dict:
    path = Path(folder) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_provenance(folder: str | Path, provenance: dict) -> None:
    (Path(folder) / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


def update_provenance(folder: str | Path, **changes) -> dict:
    provenance = read_provenance(folder) | changes
    write_provenance(folder, provenance)
    return provenance
