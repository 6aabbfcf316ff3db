"""`moezoo push`: upload an exported folder with huggingface_hub (honours HF_ENDPOINT and HF_TOKEN)."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError

from .sources import transport_errors


def check_exported(folder: Path) -> None:
    """An exported folder has its model card and the code every auto_map entry points to."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} {'is not a folder' if folder.exists() else 'does not exist'}; push takes a folder written by "
            "`moezoo export`"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; push takes a folder written by `moezoo export`")
    auto_map = json.loads(config_path.read_text()).get("auto_map") or {}
    code_files = sorted({ref.split(".")[0] + ".py" for ref in auto_map.values()})
    missing = ([] if auto_map else ["the auto_map in config.json"]) + [
        name for name in [*code_files, "README.md"] if not (folder / name).is_file()
    ]
    if missing:
        raise ValueError(
            f"{folder} is not an exported folder ({', '.join(missing)} missing); "
            f"run `moezoo export {folder} --out <folder>` and push that"
        )


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool | None = False,
    revision: str | None = None,
    token: str | None = None,
) -> str:
    """Create the repo if needed (and the branch `revision`), upload the folder, return the commit URL. `token`
    (default: `hf auth login`'s, or HF_TOKEN) and `private=None` (the Hub's default) are the train command's."""
    folder = Path(folder)
    check_exported(folder)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                   commit_message=f"Upload {folder.name} with moezoo")
    except HfHubHTTPError as error:
        raise ConnectionError(f"the Hub at {constants.ENDPOINT} refused the push of {repo_id}: {error}") from error
    except transport_errors() as error:  # connection refused, DNS failure, timeouts
        raise ConnectionError(
            f"cannot reach the Hub at {constants.ENDPOINT} ({type(error).__name__}: {error}); check HF_ENDPOINT, "
            "HF_TOKEN and the network"
        ) from error
    return commit.commit_url
