"""`moezoo export`: a model folder -> a flat folder that can be pushed to the Hub as is.

The exported folder holds safetensors weights (sharded when large), the processor files, the architecture's code
flattened into `configuration_*.py`, `modeling_*.py`, `processing_*.py` and the core modules they import, an
`auto_map` for every Auto class the architecture serves, the provenance record and a rendered model card; for
embedders, also the sentence-transformers files (`modules.json` and its module). It loads
with `trust_remote_code=True` where moezoo is not installed, and without remote code where it is.

Export checks the weights against moezoo's classes and writes fresh code files and `auto_map`s, so it also repairs
folders saved after distributed training (platform.md §8.3: an FSDP2 save copies torch's wrapper files instead of
the model's and writes a wrong `auto_map`). The model is never loaded: it is built on the `meta` device, which
checks every tensor's name and shape from the safetensors headers, and the tensors are copied one at a time into
shards of `max_shard_size`, so an export holds one output shard whatever the model's size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import SafetensorError
from transformers.utils import GENERATION_CONFIG_NAME
from transformers.utils.hub import convert_file_size_to_int

from .. import __version__
from ..conversion.streaming import ShardWriter, SourceCheckpoint, copy_as, stream_groups
from ..modeling.moe.accounting import count_parameters
from ..registry import Architecture, get_architecture, resolve
from ..terminal import quiet_libraries
from .cards import render_model_card
from .flatten import flatten_modules
from .folders import atomic_output_dir, read_provenance, write_provenance
from .sources import model_folder
from .sentence_transformers_files import SENTENCE_TRANSFORMERS_MODULES, write_sentence_transformers_files


def load_model_checked(architecture: Architecture, folder: Path, **kwargs):
    """Load with moezoo's class (`kwargs` go to `from_pretrained`: `device_map="meta"` checks the folder's tensor
    names and shapes without reading a weight) and fail on any missing, unexpected or mismatched tensor, naming them.

    transformers' own load report is silenced: the problems are reported here, in one error.
    """
    model_class = architecture.model_class()
    try:
        with quiet_libraries():
            model, info = model_class.from_pretrained(folder, output_loading_info=True, ignore_mismatched_sizes=True,
                                                      **kwargs)
    except (RuntimeError, ValueError, OSError, SafetensorError) as error:
        raise ValueError(f"cannot load {folder} as {architecture.title}: {error}") from error
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        entries = sorted(_describe(entry) for entry in info.get(kind) or [])
        if entries:
            problems.append(f"{kind.replace('_', ' ')} ({len(entries)}): {', '.join(entries[:8])}"
                            + (" ..." if len(entries) > 8 else ""))
    if problems:
        raise ValueError(
            f"the weights in {folder} do not match its config ({architecture.title}): " + "; ".join(problems)
        )
    return model.eval()


def _describe(entry) -> str:
    """A key, or (key, checkpoint shape, model shape) for a mismatch."""
    if isinstance(entry, tuple) and len(entry) == 3:
        key, checkpoint_shape, model_shape = entry
        return f"{key} (checkpoint {tuple(checkpoint_shape)}, config {tuple(model_shape)})"
    return str(entry)


def load_processor(architecture: Architecture, folder: Path):
    """The folder's processor, or its tokenizer for text-only architectures."""
    path, required = (architecture.processor, "processor_config.json") if architecture.processor else (
        architecture.tokenizer, "tokenizer_config.json")
    if path is None:
        return None
    if not (folder / required).is_file():
        raise FileNotFoundError(
            f"{folder} has no {required}; a {architecture.title} folder needs its "
            f"{'processor' if architecture.processor else 'tokenizer'} (moezoo create and moezoo convert write one)"
        )
    return resolve(path).from_pretrained(folder)


def code_entry_modules(architecture: Architecture) -> list[str]:
    paths = [architecture.config, *architecture.models.values()]
    if architecture.processor:
        paths += [architecture.processor, *architecture.processor_parts.values()]
    return list(dict.fromkeys(path.partition(":")[0] for path in paths))


def export_folder(
    source: str | Path,
    out: str | Path,
    repo_id: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    training: dict | None = None,
) -> Path:
    out = Path(out)
    source, model_type = model_folder(source, "`moezoo export`")
    architecture = get_architecture(model_type)
    # The weights are read once `out` is claimed: a taken `out` fails at once, not after loading a large model.
    with atomic_output_dir(out, overwrite=overwrite) as staging:
        # On the meta device: checked against the config from the safetensors headers, no weight read
        model = load_model_checked(architecture, source, device_map="meta")
        processor = load_processor(architecture, source)
        provenance = read_provenance(source) | {"architecture": architecture.name, "moezoo_version": __version__}
        if training:  # entries for the record of the run that trained the model, which the card shows
            provenance["training"] = provenance.get("training", {}) | training
        counts = count_parameters(model)
        copy_weights(source, staging, max_shard_size)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(staging)
        if (source / GENERATION_CONFIG_NAME).is_file():
            shutil.copy2(source / GENERATION_CONFIG_NAME, staging / GENERATION_CONFIG_NAME)
        if processor is not None:
            processor.save_pretrained(staging)
        entry_modules = code_entry_modules(architecture)
        sentence_transformers = SENTENCE_TRANSFORMERS_MODULES.get(architecture.name)
        if sentence_transformers:
            entry_modules.append(sentence_transformers[0])
        flat_names = flatten_modules(entry_modules, staging, {"moezoo", *(m.split(".")[0] for m in entry_modules)})
        write_auto_maps(architecture, staging, flat_names)
        if sentence_transformers:
            write_sentence_transformers_files(staging, architecture.name, flat_names)
        write_provenance(staging, provenance)
        card = render_model_card(
            architecture, provenance, {"total": counts.total, "active": counts.active}, repo_id or out.name
        )
        card.save(staging / "README.md")
    return out


def copy_weights(source: Path, folder: Path, max_shard_size: str | int) -> None:
    """The tensors of `source`'s safetensors files, as they are stored (names, dtypes), resharded into `folder` at
    `max_shard_size`: read one at a time, so the copy holds one output shard, whatever the model's size."""
    checkpoint = SourceCheckpoint(source, "the model folder")
    writer = ShardWriter(folder, convert_file_size_to_int(max_shard_size), dtype=None)
    for key, tensor in stream_groups([checkpoint], [copy_as(key, key) for key in checkpoint.shapes]):
        writer.add(key, tensor, cast=False)
    writer.finish()


def _flat_reference(class_path: str, flat_names: dict[str, str]) -> str:
    module, _, name = class_path.partition(":")
    return f"{flat_names[module]}.{name}"


def write_auto_maps(architecture: Architecture, folder: Path, flat_names: dict[str, str]) -> None:
    """Point every Auto class the architecture serves at the flattened code (platform.md §1.1 layout)."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoConfig": _flat_reference(architecture.config, flat_names)} | {
        auto_name: _flat_reference(path, flat_names) for auto_name, path in architecture.models.items()
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if architecture.processor is None:
        return

    processor_reference = _flat_reference(architecture.processor, flat_names)
    parts = {name: _flat_reference(path, flat_names) for name, path in architecture.processor_parts.items()}
    processor_path = folder / "processor_config.json"
    processor_config = json.loads(processor_path.read_text())
    processor_config["auto_map"] = {"AutoProcessor": processor_reference}
    if "AutoImageProcessor" in parts and isinstance(processor_config.get("image_processor"), dict):
        processor_config["image_processor"]["auto_map"] = {"AutoImageProcessor": parts["AutoImageProcessor"]}
    processor_path.write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")

    tokenizer_path = folder / "tokenizer_config.json"
    if tokenizer_path.is_file():
        tokenizer_config = json.loads(tokenizer_path.read_text())
        auto_map = {"AutoProcessor": processor_reference}
        if "AutoTokenizer" in parts:
            auto_map["AutoTokenizer"] = [None, parts["AutoTokenizer"]]
        tokenizer_config["auto_map"] = auto_map
        tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
