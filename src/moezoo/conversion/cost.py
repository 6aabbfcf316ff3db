"""What a conversion, or a preset, will cost, said before any weight is read (`moezoo convert --dry-run`, `moezoo list
--memory`), and the disk-space check every conversion makes before it starts.

A converter's `plan` function (`moezoo.registry.Converter.plan`) builds the output's config from what the sources say of
themselves without their weights: config.json, the tokenizer, safetensors headers (a PyTorch checkpoint is mapped with
`torch.load(mmap=True)`, not read). The output model is built from that config on the `meta` device, which allocates
nothing and has every shape: its parameters are counted and its size on disk is what `save_pretrained` would write
(parameters and persistent buffers, floating ones in the output dtype but those the model keeps in float32).

The peak memory is estimated for the streaming design (DESIGN.md, "Real scale"): a conversion holds one source tensor
being transformed and its result, so twice the largest source tensor (in the wider of its dtype and the output's),
plus the output shard being filled (the converter's `--max-shard-size`, else `save_pretrained`'s default, at most the
whole output). Python, torch and the tokenizer come on top (a few hundred MB).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedConfig
from transformers.utils.hub import convert_file_size_to_int

from ..registry import Converter, get_architecture, resolve
from .dtypes import checkpoint_tensors, output_dtype, saved_tensors


# What `save_pretrained` shards at when a converter has no --max-shard-size of its own.
SAVE_PRETRAINED_SHARD_SIZE = "50GB"


@dataclass(frozen=True)
class PlannedOutput:
    """What a conversion will write, known from the sources' configs and headers."""

    config: PreTrainedConfig  # the converted model's config
    sources: tuple[Path, ...]  # every checkpoint the conversion reads; the first one's dtype is the output's default


@dataclass(frozen=True)
class ConversionCost:
    converter: str
    architecture: str
    parameters: int
    dtype: torch.dtype
    disk_bytes: int
    largest_source_tensor: str  # its name
    largest_source_tensor_bytes: int  # in the wider of its dtype and the output's
    output_shard_bytes: int

    @property
    def peak_memory_bytes(self) -> int:
        return 2 * self.largest_source_tensor_bytes + self.output_shard_bytes


def stored_bytes(model: torch.nn.Module, dtypes: list[torch.dtype]) -> dict[torch.dtype, int]:
    """The bytes `save_pretrained` writes of `model` (built on the `meta` device, or not) in each of `dtypes`."""
    sizes = dict.fromkeys(dtypes, 0)
    for _, tensor, float32_kept in saved_tensors(model):
        for dtype in dtypes:
            itemsize = torch.float32.itemsize if float32_kept else (
                dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
            sizes[dtype] += tensor.numel() * itemsize
    return sizes


def conversion_cost(converter: Converter, source: Path, options: dict) -> ConversionCost | None:
    """What converting `source` with `converter` and its parsed `options` will cost; None for a converter without a
    `plan` function (one added by an extension)."""
    if converter.plan is None:
        return None
    planned: PlannedOutput = resolve(converter.plan)(source, **options)
    dtype = output_dtype(options.get("dtype"), planned.sources[0])
    with torch.device("meta"):
        model = get_architecture(planned.config.model_type).model_class()(planned.config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    sizes = stored_bytes(model, [dtype])
    largest, largest_bytes = "", 0
    for folder in planned.sources:
        for name, header in checkpoint_tensors(folder).items():
            size = header.nbytes // header.dtype.itemsize * max(header.dtype.itemsize, dtype.itemsize)
            if size > largest_bytes:
                largest, largest_bytes = name, size
    shard = convert_file_size_to_int(options.get("max_shard_size") or SAVE_PRETRAINED_SHARD_SIZE)
    return ConversionCost(converter.name, planned.config.model_type, parameters, dtype, sizes[dtype], largest,
                          largest_bytes, min(shard, sizes[dtype]))  # fmt: skip


def free_disk_space(out: str | Path) -> tuple[Path, int]:
    """The nearest existing folder of `out` (itself, or a parent) and the bytes free on its disk."""
    folder = Path(out).absolute()
    while not folder.exists():
        folder = folder.parent
    return folder, shutil.disk_usage(folder).free


def check_disk_space(out: str | Path, needed: int) -> None:
    """Refuse a conversion whose output does not fit on the disk `out` would be written to, before it starts."""
    folder, free = free_disk_space(out)
    if needed > free:
        raise OSError(
            f"the converted model needs {human_bytes(needed)} on disk but {folder} has {human_bytes(free)} free: free "
            "some space, choose another --out, or a smaller --dtype"
        )


def human_bytes(count: int) -> str:
    """A size as people write it: 16.4 GB, 512 MB (powers of 1000, as disks are sold and `--max-shard-size` reads)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"
