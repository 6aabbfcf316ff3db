"""Streaming conversion: read safetensors checkpoints shard by shard, write the target shard by shard, and account for
every tensor on the `meta` device before a byte is written.

A conversion is a list of `TensorGroup`s: each turns some source tensors (possibly none, for new parameters) into
target tensors. `check_plan` runs every group on `meta` tensors of the source shapes and compares the result with the
target model's state dict built on `meta`: every target tensor produced exactly once, with its shape, and every source
tensor either used or dropped with a reason. `stream_groups` then reads each source file once and yields a group's
targets as soon as all its sources were read, so at most one group's tensors are held at a time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedConfig, PreTrainedModel

from ..hub.sources import open_safetensors
from ..modeling.moe.offload import complete_device_map
from .dtypes import cast_checked


# build(tensors by source key, device) -> target tensors by target key; `device` is "meta" while the plan is checked.
Build = Callable[[dict[str, torch.Tensor], str], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorGroup:
    """Target tensors computed from a set of source tensors; written as soon as all of them were read."""

    sources: tuple[str, ...]
    build: Build


def copy_as(source_key: str, target_key: str) -> TensorGroup:
    return TensorGroup((source_key,), lambda tensors, device: {target_key: tensors[source_key]})


class SourceCheckpoint:
    """A folder's `config.json` and safetensors headers: which tensors exist and their shapes (no data is read)."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = folder, what
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{what} {folder} has no config.json: not a transformers checkpoint folder")
        self.config = json.loads(config_file.read_text())
        self.model_type = self.config.get("model_type")
        index_file = folder / "model.safetensors.index.json"
        if index_file.is_file():
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        else:
            files = sorted(path.name for path in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{what} {folder} has no safetensors weights (model.safetensors or an index): convert .bin checkpoints "
                "to safetensors first"
            )
        self.files = [folder / name for name in files]
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            with open_safetensors(path) as shard:
                for key in shard.keys():
                    self.shapes[key] = tuple(shard.get_slice(key).get_shape())


def check_plan(
    checkpoints: Iterable[SourceCheckpoint],
    groups: list[TensorGroup],
    dropped: Iterable[str],
    expected: dict[str, tuple[int, ...]],
    target: str,
) -> None:
    """Fail naming every problem unless the groups produce exactly `expected` (target key -> shape) and every source
    tensor is read by a group or listed in `dropped`."""
    shapes = {key: shape for checkpoint in checkpoints for key, shape in checkpoint.shapes.items()}
    used = [key for group in groups for key in group.sources]
    problems = []
    unknown_sources = sorted(set(used) - set(shapes))
    if unknown_sources:
        problems.append(f"tensors the sources lack: {listing(unknown_sources)}")
    unaccounted = sorted(set(shapes) - set(used) - set(dropped))
    if unaccounted:
        problems.append(f"source tensors {target} has no place for: {listing(unaccounted)}")
    produced: dict[str, tuple[int, ...]] = {}
    twice = []
    if not unknown_sources:
        for group in groups:
            inputs = {key: torch.empty(shapes[key], device="meta") for key in group.sources}
            for key, tensor in group.build(inputs, "meta").items():
                if key in produced:
                    twice.append(key)
                produced[key] = tuple(tensor.shape)
        unexpected = sorted(set(produced) - set(expected))
        if unexpected:
            problems.append(f"tensors {target} does not have: {listing(unexpected)} (the sources hold these "
                            "unexpected ones: another architecture, or a config.json that does not match its weights)")
        missing = sorted(set(expected) - set(produced))
        if missing:
            problems.append(f"{target} tensors the sources do not give: {listing(missing)}")
        mismatched = [f"{key} has shape {produced[key]} from the sources but {shape} in {target}"
                      for key, shape in expected.items() if key in produced and produced[key] != shape]
        if mismatched:
            problems.append(f"shape mismatches (a config.json disagrees with its weights): {listing(mismatched)}")
        if twice:
            problems.append(f"tensors produced twice: {listing(sorted(twice))}")
    if problems:
        raise ValueError(f"the sources do not convert into {target}: " + "; ".join(problems))


def stream_groups(
    checkpoints: Iterable[SourceCheckpoint], groups: list[TensorGroup]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read each source file once; yield each group's targets once all its sources were read (groups without
    sources first)."""
    for group in groups:
        if not group.sources:
            yield from group.build({}, "cpu").items()
    group_of = {key: group for group in groups for key in group.sources}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for checkpoint in checkpoints:
        for path in checkpoint.files:
            with open_safetensors(path) as shard:
                for key in shard.keys():
                    group = group_of.get(key)
                    if group is None:  # dropped
                        continue
                    tensors = pending.setdefault(id(group), {})
                    tensors[key] = shard.get_tensor(key)
                    if len(tensors) == len(group.sources):
                        del pending[id(group)]
                        yield from group.build(tensors, "cpu").items()


class ShardWriter:
    """Writes tensors into `model-XXXXX-of-YYYYY.safetensors` shards of at most `max_shard_size` bytes (a single
    `model.safetensors` when everything fits), plus the index; floating tensors are written in `dtype`, a value it
    cannot hold failing the conversion (`cast_checked`)."""

    def __init__(self, folder: Path, max_shard_size: int, dtype: torch.dtype):
        self.folder, self.max_shard_size, self.dtype = folder, max_shard_size, dtype
        self.shards: list[list[str]] = []
        self.current: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()  # of the tensors in `current`
        self.current_size = 0
        self.total_size = 0
        self.num_tensors = 0

    def add(self, key: str, tensor: torch.Tensor, cast: bool = True) -> None:
        """Queue `tensor` under `key`, in the writer's dtype unless `cast` is False (tensors a class keeps in
        float32 whatever the model's dtype)."""
        if cast:
            tensor = cast_checked(key, tensor, self.dtype)
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_size + size > self.max_shard_size:
            self._flush()
        tensor = tensor.contiguous()
        # safetensors refuses tensors that share memory: one source tensor may be written under several names (the
        # copies of a dense FFN that become experts)
        if tensor.untyped_storage().data_ptr() in self._storages:
            tensor = tensor.clone()
        self._storages.add(tensor.untyped_storage().data_ptr())
        self.current[key] = tensor
        self.current_size += size
        self.total_size += size
        self.num_tensors += 1

    def _flush(self) -> None:
        save_file(self.current, self.folder / f"shard-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.current))
        self.current, self.current_size = {}, 0
        self._storages.clear()

    def finish(self) -> None:
        if self.current:
            self._flush()
        if len(self.shards) == 1:
            (self.folder / "shard-0.tmp").rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for index, keys in enumerate(self.shards):
            name = f"model-{index + 1:05d}-of-{len(self.shards):05d}.safetensors"
            (self.folder / f"shard-{index}.tmp").rename(self.folder / name)
            weight_map |= {key: name for key in keys}
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class StreamedModel:
    """A converted model that exists as a folder (config.json, safetensors, generation config) written tensor by tensor
    into a temporary directory, never as a model in memory: `ConversionResult.model` of a streaming converter.

    It answers what `moezoo convert` asks of a model (`config`, `save_pretrained`, which moves the files into the
    output) without loading a weight; `load()` builds the model, for tests and small models. The directory is removed
    with the object."""

    def __init__(self, model_class: type[PreTrainedModel], prefix: str):
        self.model_class = model_class
        self._directory = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self._directory.name)

    @property
    def config(self) -> PreTrainedConfig:
        return self.model_class.config_class.from_pretrained(self.folder)

    def load(self, **kwargs) -> PreTrainedModel:
        return self.model_class.from_pretrained(self.folder, **kwargs).eval()

    def save_pretrained(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)  # as transformers' save_pretrained does
        for path in self.folder.iterdir():
            shutil.move(path, Path(folder) / path.name)


def load_layer_by_layer(
    model_class: type[PreTrainedModel], folder: str | Path, offload_folder: str | Path,
    resident_modules: tuple[str, ...] = (), **kwargs
) -> PreTrainedModel:
    """`model_class.from_pretrained(folder, **kwargs)` with every decoder layer and vision block (the class's
    `_no_split_modules`) left on disk: accelerate's offload hooks read a block's weights when its forward starts and drop
    them when it ends, so a forward pass holds one block at a time (in the dtype asked for) beside the rest, whatever
    the depth. Weights transformers must transform on loading (per-expert tensors fused, a dtype cast of a fused
    tensor) are written into `offload_folder` first; the others are read from `folder`'s own files.

    accelerate loads an offloaded weight for the forward of the module that holds it: `resident_modules` names the
    classes (besides the model's own `_resident_modules`) that read a submodule's weight directly and so stay on the
    CPU, e.g. transformers' Siglip2VisionEmbeddings, which resizes its position embedding's weight itself."""
    config = model_class.config_class.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = model_class(config)
    device_map = offload_device_map(skeleton)
    # What zoo classes do in from_pretrained (OffloadMixin), for transformers' own too (a SigLIP source's pooling head)
    skeleton._resident_modules = [*(getattr(skeleton, "_resident_modules", None) or ()), *resident_modules]
    complete_device_map(skeleton, device_map)
    return model_class.from_pretrained(
        folder, device_map=device_map, offload_folder=str(offload_folder), **kwargs
    ).eval()


def offload_device_map(model: torch.nn.Module) -> dict[str, str]:
    """A device map that leaves the outermost modules of `model._no_split_modules` on "disk" and the other tensors
    (embeddings, norms, heads, counters: as many whatever the depth) on the CPU, by module where a module holds no
    block, else by tensor."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units = {name for name, module in model.named_modules() if type(module).__name__ in blocks}
    units = {name for name in units if not any(name.startswith(f"{other}.") for other in units)}
    if not units:
        raise ValueError(f"{type(model).__name__} names no block to load one at a time (_no_split_modules)")
    device_map = dict.fromkeys(sorted(units), "disk")
    for name, module in model.named_modules():
        if name in units or any(name.startswith(f"{mapped}.") for mapped in device_map):
            continue
        own = [key for key, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        if not own:
            continue
        prefix = f"{name}." if name else ""  # the model itself holds some (SigLIP's logit_scale)
        if any(unit.startswith(prefix) for unit in units):
            device_map |= {f"{prefix}{key}": "cpu" for key in own}
        else:
            device_map[name] = "cpu"
    return device_map
