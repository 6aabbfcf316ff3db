"""The files that make an exported folder load with `SentenceTransformer(folder, trust_remote_code=True)`.

sentence-transformers reads `modules.json` (its pipeline of modules, here a single one whose `type` is
"<code file>.<class>" of the folder, loaded as remote code), `config_sentence_transformers.json` (library versions,
prompts, similarity) and the module's own config file. The module file itself is flattened into the folder with the
model code (it imports only sentence-transformers and transformers).
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# (exported module, its class, its config file, its config) by architecture.
SENTENCE_TRANSFORMERS_MODULES = {
    "moemb": ("moezoo.hub.sentence_transformers_moemb", "MoEmbSentenceEncoder", "sentence_moemb_config.json",
              {"max_length": None}),
}  # fmt: skip
REQUIRED_VERSION = ">=6.0"


def write_sentence_transformers_files(folder: str | Path, architecture: str, flat_names: dict[str, str]) -> None:
    """Write `modules.json`, `config_sentence_transformers.json` and the module config into `folder`, whose code
    files `flatten_modules` wrote (`flat_names`: module name -> flat file stem, the module of
    `SENTENCE_TRANSFORMERS_MODULES[architecture]` included)."""
    module, class_name, config_file, module_config = SENTENCE_TRANSFORMERS_MODULES[architecture]
    folder = Path(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{flat_names[module]}.{class_name}"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    versions = {"sentence_transformers": _version("sentence-transformers"), "transformers": _version("transformers"),
                "pytorch": _version("torch")}  # fmt: skip
    config = {
        "model_type": "SentenceTransformer",
        "__version__": {name: value for name, value in versions.items() if value},
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
        "requirements": {"sentence-transformers": REQUIRED_VERSION},
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / config_file).write_text(json.dumps(module_config, indent=2) + "\n")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
