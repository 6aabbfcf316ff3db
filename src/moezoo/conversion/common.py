"""What every converter shares: where the source is, what it is, which converter takes it, how results are saved.

A converter is a function `convert(source: Path, **options) -> ConversionResult` named in the catalogue
(`moezoo.registry.Converter`); it accounts for every source tensor and measures its own fidelity against the
source model (`provenance["max_abs_diff"]`), which the model card reports.
"""

from __future__ import annotations

import json
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from .. import __version__
from ..hub.folders import atomic_output_dir, write_provenance
from ..hub.sources import header_only_source, locate, open_safetensors, source_name
from ..registry import CONVERTERS, Converter, architectures_named


PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
SOURCE_ADVICE = ("give --from a local folder or file",)  # how an error about --from says what to do


@dataclass
class ConversionResult:
    model: Any  # a moezoo PreTrainedModel, or the `streaming.StreamedModel` folder a converter streamed it into
    processor: Any | None
    # source, base_model, license, max_abs_diff (measured against the source model), notes, ...
    provenance: dict = field(default_factory=dict)


def local_source(source: str | Path) -> Path:
    """A local file or folder as is; a Hub repo id downloaded (see `moezoo.hub.sources.locate`)."""
    return locate(source, "the source", *SOURCE_ADVICE)


def source_headers(source: str | Path) -> AbstractContextManager[Path]:
    """`local_source` without the weights of a Hub repo, for `moezoo convert --dry-run` (see
    `moezoo.hub.sources.header_only_source`)."""
    return header_only_source(source, "the source", *SOURCE_ADVICE)


def option_name(name: str, value: Any = ...) -> str:
    """How an error names a converter option: the flag of `moezoo convert` and the keyword of the Python function,
    which both reach the same code; e.g. `--top-k 3 (top_k=3)`, or `--emb-token-id (emb_token_id=)` without a value."""
    flag = "--" + name.replace("_", "-")
    if value is ...:
        return f"{flag} ({name}=)"
    return f"{flag} {value} ({name}={value!r})"


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (see `open_safetensors`)."""
    with open_safetensors(path) as tensors:
        return {key: tensors.get_tensor(key) for key in tensors.keys()}


def source_kind(path: Path) -> str:
    """What a source is: the `model_type` of its config.json, or "pytorch-pickle" for a bare .pt/.pth/.bin."""
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        model_type = json.loads(config.read_text()).get("model_type")
        if not model_type:
            raise ValueError(f"{config} has no model_type")
        return model_type
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        return "pytorch-pickle"
    if path.is_dir() and any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
        return "pytorch-pickle"
    raise ValueError(f"cannot tell what {path} is: no config.json and no .pt/.pth/.bin checkpoint")


def find_converter(architecture: str, kind: str, variant: str | None = None) -> Converter:
    """The converter into `architecture` (or into a member of that family) that takes a source of type `kind`."""
    targets = {member.name for member in architectures_named(architecture)}
    candidates = [c for c in CONVERTERS.values() if c.architecture in targets]
    if not candidates:
        raise KeyError(f"no converter produces {architecture!r}")
    matching = [c for c in candidates if kind in c.sources and (variant is None or variant in c.variants)]
    if not matching:
        accepted = "; ".join(
            f"{c.name}: {', '.join(c.sources)}" + (f" (variants {', '.join(c.variants)})" if c.variants else "")
            for c in candidates
        )
        wanted = f"{kind!r}" + (f" with variant {variant!r}" if variant else "")
        raise ValueError(f"no {architecture} converter takes a source of type {wanted}; converters: {accepted}")
    return matching[0]


def save_conversion(result: ConversionResult, converter: Converter, out: Path, overwrite: bool = False) -> Path:
    """Save the conversion into `out`, atomically (see `write_conversion`)."""
    with atomic_output_dir(out, overwrite=overwrite) as staging:
        write_conversion(result, converter, staging)
    return out


def write_conversion(result: ConversionResult, converter: Converter, folder: Path) -> None:
    """Write the model, its processor and the provenance (`moezoo.json`) into `folder`, the provenance's source and base
    model naming a Hub source by its repo id whichever folder the converter read it from."""
    provenance = dict(result.provenance)
    for key in ("source", "base_model"):
        if isinstance(provenance.get(key), str):
            provenance[key] = source_name(provenance[key])
    result.model.save_pretrained(folder)
    if result.processor is not None:
        result.processor.save_pretrained(folder)
    write_provenance(folder, provenance | {"converter": converter.name, "moezoo_version": __version__})


# --- reading a source folder ---------------------------------------------------------------------------------------


def read_config(folder: Path, model_types: tuple[str, ...], what: str) -> dict:
    """The source's config.json, checked to be one of `model_types`."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass the folder of a {what} checkpoint")
    config = json.loads(path.read_text())
    if config.get("model_type") not in model_types:
        raise ValueError(
            f"{folder} holds a {config.get('model_type')!r} model, not a {what} checkpoint (model_type "
            f"{' or '.join(map(repr, model_types))})"
        )
    return config


def plain_config_fields(config: dict) -> dict:
    """A config.json's fields without the ones that name its class or its saving."""
    return {
        key: value for key, value in config.items()
        if key not in ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype",
                       "torch_dtype")
    }


def source_license(folder: Path) -> str | None:
    """The `license:` of the source's model card front matter, if it has one."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    match = re.search(r"^---\n(.*?)\n---", readme.read_text(errors="replace"), flags=re.DOTALL)
    license_line = re.search(r"^license:\s*(\S+)", match[1], flags=re.MULTILINE) if match else None
    return license_line[1] if license_line else None


def source_tokenizer(folder: Path):
    """The source's tokenizer (with its chat template), saved beside the converted model; `None` if it has none."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))
