"""Loading a zoo model larger than memory, the transformers way: `from_pretrained(folder, device_map="auto",
max_memory=..., offload_folder=...)` places whole layers on the accelerators, the CPU and the disk (accelerate's
`infer_auto_device_map`, which never splits a `_no_split_modules` layer, so a decoder layer stays with its MoE block
and the fused experts of one block stay together), and accelerate's hooks bring an offloaded module's weights to the
execution device for its forward.

Three things accelerate's device map gets wrong for some zoo models, which `OffloadMixin` corrects before any weight
is loaded:

- a module split across devices has its direct parameters placed but not its direct buffers (SMoES's `smoes_step`
  on the text model), which accelerate then refuses ("does not give any device for ...");
- accelerate's hooks load the weights of modules, never of a tensor listed alone, so the offloaded direct parameters
  of a split module (MoE-ViE's `logit_scale`, the OmniMoE-VL projector's `fusion_output_scale`) would stay empty:
  they go to the execution device, as the left-out buffers do;
- an offloaded module's weights exist only during its own forward, so a module whose weights are read outside it
  (torch's `nn.MultiheadAttention` reads its `out_proj` weights itself; OmniMoE-VL's injection, read before each anchor
  layer and at every decode step) would meet empty (meta) weights. Such modules, named by `_resident_modules` as
  `_no_split_modules` names layers, stay on the execution device (with the `_no_split_modules` layer around them, if
  any); they are small beside the layers.
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path

from torch import nn


def check_offload_folder(offload_folder: str | os.PathLike | None) -> None:
    """Refuses, before anything is read or written, an `offload_folder` that cannot take the offloaded weights: an
    existing file, or a folder (or the nearest existing parent of one to be made) that is not writable."""
    if offload_folder is None:
        return
    folder = Path(offload_folder)
    existing = next(path for path in (folder, *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        problem = "is a file" if existing == folder else f"lies under the file {existing}"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable" if existing == folder else f"cannot be made: {existing} is not writable"
    else:
        return
    raise ValueError(
        f"offload_folder {folder} {problem}; pass a folder you can write to (device_map offloads weights there)"
    )


def main_device(device_map: dict[str, str | int]):
    """The execution device of offloaded modules, as accelerate's `dispatch_model` picks it."""
    accelerators = [device for device in device_map.values() if device not in ("cpu", "disk")]
    return accelerators[0] if accelerators else "cpu"


def covering_entry(device_map: dict, name: str) -> str | None:
    """The device-map entry that places module or tensor `name`: itself or its nearest listed ancestor."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        candidate = ".".join(parts[:end])
        if candidate in device_map:
            return candidate
    return None


def split_entry(model: nn.Module, device_map: dict, name: str) -> None:
    """Replaces the entry of module `name` by entries of its direct parameters, direct buffers and children, on the
    same device (what accelerate does when it splits a module, buffers included)."""
    device = device_map.pop(name)
    module = model.get_submodule(name)
    prefix = f"{name}." if name else ""
    for part in (module.named_parameters(recurse=False), module.named_buffers(recurse=False), module.named_children()):
        for child, _ in part:
            device_map[prefix + child] = device


def resident_units(model: nn.Module) -> list[str]:
    """The modules that must not be offloaded (see the module docstring), each widened to the `_no_split_modules`
    layer that holds it, outermost first."""
    resident = {"MultiheadAttention"}
    for module in model.modules():
        resident.update(getattr(module, "_resident_modules", None) or ())
    no_split = set(model._no_split_modules or ())
    units, layer = [], None
    for name, module in model.named_modules():
        if layer is not None and name.startswith(f"{layer}."):
            continue  # inside a unit already kept, or inside a layer that holds none
        layer = None
        if type(module).__name__ in no_split and any(type(inner).__name__ in resident for inner in module.modules()):
            units.append(name)
            layer = name
        elif type(module).__name__ in resident:
            units.append(name)
            layer = name
        elif type(module).__name__ in no_split:
            layer = name
    return units


def complete_device_map(model: nn.Module, device_map: dict) -> None:
    """Corrects accelerate's device map in place (see the module docstring): resident modules go to the execution
    device, and so do the direct parameters and buffers of a split module when offloaded or left out (accelerate's
    hooks load the weights of modules, never of a tensor listed alone)."""
    execution_device = main_device(device_map)
    offloaded = {"cpu", "disk"} - {execution_device}
    for unit in resident_units(model):
        entry = covering_entry(device_map, unit)
        if entry is None or device_map[entry] not in offloaded:
            continue
        while entry != unit:
            split_entry(model, device_map, entry)
            entry = covering_entry(device_map, unit)
        device_map[unit] = execution_device
    split = {".".join(name.split(".")[:end]) for name in device_map for end in range(name.count(".") + 1)}
    for name in split - set(device_map):
        module = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        for tensor, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if device_map.get(prefix + tensor, "disk") in offloaded:
                device_map[prefix + tensor] = execution_device


class OffloadMixin:
    """For every zoo `PreTrainedModel`, placed before transformers' class: `from_pretrained` with a `device_map`
    that offloads (see the module docstring)."""

    # Class names of modules whose weights are read outside their own forward, kept on the execution device.
    _resident_modules: list[str] | None = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        check_offload_folder(kwargs.get("offload_folder"))
        return super().from_pretrained(*args, **kwargs)

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        # transformers dispatches the model with this same dict once the weights are loaded.
        if isinstance(load_config.device_map, dict):
            complete_device_map(model, load_config.device_map)
        return super()._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
