"""Where every model, tokenizer, checkpoint and Hub data set moezoo loads comes from: a local path, or a Hub repo id.

All loading goes through `locate` (and `model_folder`, for model folders), so that every command and library entry
point fails the same way, at once and in one sentence, when what it needs is not there:

- a path that does not exist (and is no Hub repo id `organisation/name`) is named as such, with what to give instead;
- for a Hub repo id, one short request first checks that the Hub answers and has the repo; then the repo is downloaded
  into the Hub cache, or brought up to date there. Without that check, a download from an unreachable Hub retries
  every file for minutes before it fails, and transformers' own error names neither the file nor how to give it
  locally. When the Hub does not answer, the Hub cache's copy is used, if there is one;
- with `HF_HUB_OFFLINE=1` the network is never tried: the Hub cache's copy, or an error at once.

A model folder's architecture is checked from its `config.json` alone, before any weights are read or downloaded, and
its safetensors files are checked to be whole before transformers reads them (its error would not name the file).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    HFValidationError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    NotASafetensorsRepoError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import SafetensorsFileMetadata, validate_repo_id
from safetensors import SafetensorError, safe_open

from ..registry import ARCHITECTURES


# Seconds the Hub has to answer the check before a download: it answers in well under a second when reachable.
HUB_CHECK_TIMEOUT = 10.0
# What a tokenizer needs from a repo (not its weights).
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.jinja")
# What a model folder needs from a repo: moezoo reads safetensors only, so other weight formats (often beside them in
# a repo, e.g. Llama's original consolidated.pth) are not downloaded.
MODEL_FILES = (*TOKENIZER_FILES, "*.safetensors", "*.py")
MODEL_FOLDER_WRITERS = "moezoo create, convert or train, or save_pretrained"


class HubUnreachableError(ConnectionError):
    """A Hub repo is needed that is not in the Hub cache, and the Hub cannot be used (no network, or
    `HF_HUB_OFFLINE=1`). An `OSError`, like the errors transformers raises for files it cannot find."""


def locate(
    source: str | Path,
    what: str,
    how: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    check_config: Callable[[Path], object] | None = None,
    repo_type: str = "model",
) -> Path:
    """
    The local file or folder `source`, or the Hub repo `source` (of `repo_type`: "model" or "dataset") in the Hub
    cache, downloading `allow_patterns` (default every file) after the Hub answered one short request;
    `check_config(folder)` first sees a folder holding the repo's config.json alone, to refuse a repo before its
    weights are downloaded.

    `what` names the thing in errors ("the model", "CLIP's tokenizer"); `how` says how the caller can be given a local
    copy instead ("pass --tokenizer with a local tokenizer folder"). Raises `FileNotFoundError` for a path or repo
    that does not exist and `HubUnreachableError` when the repo would have to be downloaded from an unusable Hub.
    """
    path = Path(source).expanduser()
    if path.exists():
        return path
    repo_id = str(source)
    if not is_hub_repo_id(repo_id):
        raise FileNotFoundError(
            f"{what} {source} does not exist; {how or 'give a local path'}, or a Hub repo id (organisation/name)"
        )
    patterns = list(allow_patterns) if allow_patterns else None
    download_advice = (
        f"{how + ', or ' if how else ''}download it where there is a network "
        f"(`hf download {repo_id}{'' if repo_type == 'model' else f' --repo-type {repo_type}'}"
        f"{''.join(f' --include {pattern!r}' for pattern in patterns or ())}`) into the Hub "
        "cache, which moezoo reads when the Hub cannot be used"
    )
    if constants.HF_HUB_OFFLINE:
        cached = _cached_snapshot(repo_id, repo_type, patterns)
        if cached is None:
            raise HubUnreachableError(
                f"{what} {repo_id} is neither a local path nor in the Hub cache, and HF_HUB_OFFLINE is set; "
                f"{download_advice}"
            )
        return cached
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_CHECK_TIMEOUT)
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{what} {repo_id} is neither a local path nor a repo on the Hub at {constants.ENDPOINT} (a private or "
            f"gated repo needs `hf auth login`); {how or 'give a local path'}"
        ) from None
    except (HfHubHTTPError, *transport_errors()) as error:  # DNS failure, refused connection, timeout, 5xx
        cached = _cached_snapshot(repo_id, repo_type, patterns)
        if cached is None:
            raise HubUnreachableError(
                f"cannot reach the Hub at {constants.ENDPOINT} to download {what} {repo_id} ({type(error).__name__}: "
                f"{error}); {download_advice} (with HF_HUB_OFFLINE=1 set, the Hub is not tried)"
            ) from error
        return cached
    # The Hub answered: the download brings a cached copy up to date (a repo pushed again), quickly when it is.
    if check_config is not None:
        check_config(Path(hf_hub_download(repo_id, "config.json", repo_type=repo_type)).parent)
    return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns))


@contextmanager
def header_only_source(source: str | Path, what: str, how: str | None = None) -> Iterator[Path]:
    """What a source says of itself without its weights, for `moezoo convert --dry-run`: a local path as it is; a Hub
    repo as a temporary folder holding its small files (configs, tokenizer, the safetensors index: `TOKENIZER_FILES`)
    and, for each safetensors file, a stand-in with the file's header and a hole (a sparse file) where its data is.
    The headers come from `HfApi.get_safetensors_metadata`, which asks for the first bytes of each file (HTTP range
    requests), so no weight is downloaded. A repo without safetensors (a PyTorch pickle, whose shapes lie in the
    pickle), and any repo when the Hub cannot be used, are found as `locate` finds them."""
    path = Path(source).expanduser()
    if path.exists() or not is_hub_repo_id(str(source)) or constants.HF_HUB_OFFLINE:
        yield locate(source, what, how)
        return
    small_files = locate(source, what, how, allow_patterns=TOKENIZER_FILES)
    try:
        metadata = HfApi().get_safetensors_metadata(str(source))
    except NotASafetensorsRepoError:
        yield locate(source, what, how)
        return
    with tempfile.TemporaryDirectory(prefix="moezoo-headers-") as folder:
        shutil.copytree(small_files, folder, dirs_exist_ok=True)
        for name, header in metadata.files_metadata.items():
            write_header_only_safetensors(Path(folder) / name, header)
        yield Path(folder)


def write_header_only_safetensors(path: Path, header: SafetensorsFileMetadata) -> None:
    """A safetensors file with `header`'s tensors (names, dtypes, shapes, offsets) whose data is a hole of the right
    size: safetensors reads its header as the original's, and the disk holds only the header."""
    entries = {name: {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": list(tensor.data_offsets)}
               for name, tensor in header.tensors.items()}  # fmt: skip
    if header.metadata:
        entries["__metadata__"] = header.metadata
    encoded = json.dumps(entries).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts aligned, as safetensors writes it
    data_size = max((tensor.data_offsets[1] for tensor in header.tensors.values()), default=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        file.truncate(8 + len(encoded) + data_size)


def _cached_snapshot(repo_id: str, repo_type: str, patterns: list[str] | None) -> Path | None:
    """The repo's folder in the Hub cache if it holds the files of `patterns` (all files when None), else None."""
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError:  # not cached, or only in part (an interrupted download)
        return None


@contextmanager
def open_safetensors(path: str | Path) -> Iterator:
    """`safetensors.safe_open(path)`, failing with an error that names the file when it is corrupt or incomplete (a
    partial download): the reader's own error does not say which file."""
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise ValueError(
            f"{path} is not a complete safetensors file (corrupt or cut short: {error}): download or save it again"
        ) from error
    with handle as tensors:
        yield tensors


def check_safetensors(folder: Path) -> None:
    """Open the header of every safetensors file in `folder` (a few kilobytes each), which fails naming a corrupt or
    incomplete file (see `open_safetensors`); transformers' loading fails on it without naming it."""
    for path in sorted(folder.glob("*.safetensors")):
        with open_safetensors(path):
            pass


def source_name(source: str | Path) -> str:
    """How provenance names a source: the Hub repo id for a snapshot folder of the Hub cache (where `locate`
    downloads a repo id to; the cache path means nothing on another machine), else the path as given."""
    parts = Path(source).parts
    # <cache>/models--<org>--<name>/snapshots/<revision>; Hub repo ids cannot contain "--", so the split is exact.
    if len(parts) >= 3 and parts[-3].startswith("models--") and parts[-2] == "snapshots":
        return parts[-3].removeprefix("models--").replace("--", "/")
    return str(source)


def is_hub_repo_id(name: str) -> bool:
    """Whether `name` is taken for a Hub repo id when no such path exists: `organisation/name` only. A bare name is
    taken for a mistyped local path: the Hub's few ids without an organisation all have one now (gpt2 is
    openai-community/gpt2)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return name.count("/") == 1


def transport_errors() -> tuple[type[Exception], ...]:
    """What a request to an unreachable Hub raises: `OSError` and the network errors of the HTTP client huggingface_hub
    uses (httpx2 in 2.x, httpx in 1.x)."""
    errors: list[type[Exception]] = [OSError]
    for module_name in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module_name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def model_folder(
    source: str | Path, command: str, model_types: Collection[str] | None = None, other_types: str | None = None
) -> tuple[Path, str]:
    """
    The folder and `model_type` of the model `source` (a local folder or a Hub repo id, see `locate`), checked to be
    one of `model_types` (default: any architecture of the zoo) before a weight is read or downloaded, and checked to
    hold no corrupt safetensors file. `command` names the caller in errors ("`moezoo train moe_vie`"); `other_types`
    ends the error for another architecture (what to do with it instead).
    """
    def check(folder: Path) -> str:
        return check_model_type(folder, command, model_types, other_types, source)

    folder = locate(source, "the model", f"give a local model folder (written by {MODEL_FOLDER_WRITERS})",
                    MODEL_FILES, check_config=check)
    model_type = check(folder)
    check_safetensors(folder)
    return folder, model_type


def check_model_type(
    folder: Path,
    command: str,
    model_types: Collection[str] | None = None,
    other_types: str | None = None,
    source: str | Path | None = None,
) -> str:
    """The `model_type` of the model folder `folder` (shown in errors as `source`, default `folder`), refused unless
    it is one of `model_types` (default: any architecture of the zoo; see `model_folder`)."""
    source = source or folder
    expected = f"{command} takes a model folder written by {MODEL_FOLDER_WRITERS}"
    if not folder.is_dir():
        raise FileNotFoundError(f"{source} is not a folder; {expected}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{source} has no config.json; {expected}")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); save the model again") from error
    if not model_type:
        raise ValueError(f"{config_path} has no model_type; cannot tell which architecture it is")
    if model_type not in (model_types or ARCHITECTURES):
        held = ARCHITECTURES[model_type].title if model_type in ARCHITECTURES else "non-moezoo"
        wanted = " or ".join(ARCHITECTURES[name].title for name in model_types) if model_types else "moezoo"
        raise ValueError(
            f"{source} holds a {held} model (model_type {model_type!r}); {command} takes {wanted} models"
            + (f" ({other_types})" if other_types else "")
        )
    return model_type
