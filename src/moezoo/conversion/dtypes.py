"""The dtype a conversion writes: the source's, unless `--dtype` says otherwise (DESIGN.md, "Real scale").

Every converter takes the same `--dtype` option (`add_dtype_argument`). The source's dtype is read from its safetensors
headers, or from a PyTorch checkpoint mapped with `torch.load(mmap=True)`, never from its weights (`source_dtype`). A
cast into a narrower range (float16 from bfloat16 or float32) is checked tensor by tensor (`cast_checked`): a value
float16 cannot hold would otherwise be written as infinity, silently, and the converted model would be broken.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hub.sources import open_safetensors
from ..modeling.moe.precision import DTYPES
from .common import PICKLE_SUFFIXES, option_name


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class TensorHeader:
    """What a checkpoint says of one tensor without reading it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def add_dtype_argument(parser) -> None:
    """`--dtype`, the same for every converter."""
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="the dtype the weights are written in (default: the source's)")


def checkpoint_tensors(path: Path) -> dict[str, TensorHeader]:
    """Every tensor of a checkpoint (a folder's safetensors files, or one safetensors or PyTorch file) by name, with its
    dtype and shape: from the safetensors headers, or from a PyTorch checkpoint mapped with `torch.load(mmap=True)`,
    which reads no tensor data."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if path.is_dir() and not files:
        files = sorted(file for file in path.iterdir() if file.suffix in PICKLE_SUFFIXES)
    if not files:
        raise FileNotFoundError(
            f"{path} has no .safetensors weights (nor a .pt/.pth/.bin checkpoint): save the model with save_pretrained "
            "first"
        )
    tensors = {}
    for file in files:
        if file.suffix == ".safetensors":
            with open_safetensors(file) as shard:
                for key in shard.keys():
                    header = shard.get_slice(key)
                    tensors[key] = TensorHeader(SAFETENSORS_DTYPES[header.get_dtype()], tuple(header.get_shape()))
        elif file.suffix in PICKLE_SUFFIXES:
            tensors |= _pickled_tensors(file)
    return tensors


def _pickled_tensors(file: Path) -> dict[str, TensorHeader]:
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"{file} is not a PyTorch checkpoint torch.load(weights_only=True, mmap=True) reads ({reason}): a corrupt or "
            "truncated download, a pickle with arbitrary objects (never loaded), or one saved before torch 1.6 (save "
            "it again)"
        ) from error
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    return {key: TensorHeader(value.dtype, tuple(value.shape)) for key, value in loaded.items()
            if isinstance(value, torch.Tensor)}  # fmt: skip


def dominant_dtype(tensors: dict[str, TensorHeader], what: str) -> torch.dtype:
    """The floating dtype that holds most of the bytes of `tensors` (a few norms or biases kept in float32 beside
    bfloat16 weights do not make a checkpoint float32)."""
    sizes = Counter()
    for header in tensors.values():
        if header.dtype.is_floating_point:
            sizes[header.dtype] += header.nbytes
    if not sizes:
        raise ValueError(f"{what} has no floating-point tensors: pass {option_name('dtype')}")
    return sizes.most_common(1)[0][0]


def source_dtype(source: Path | torch.nn.Module) -> torch.dtype:
    """The dtype of a source checkpoint (see `dominant_dtype`), or of a model already loaded."""
    if isinstance(source, torch.nn.Module):
        return next(p.dtype for p in source.parameters() if p.is_floating_point())
    return dominant_dtype(checkpoint_tensors(source), str(source))


def output_dtype(requested: str | torch.dtype | None, source: Path | torch.nn.Module) -> torch.dtype:
    """The dtype a conversion writes: `requested` (a name of `DTYPES` or a torch dtype), else the source's."""
    if requested is None:
        return source_dtype(source)
    if isinstance(requested, torch.dtype) and requested in DTYPES.values():
        return requested
    if requested not in DTYPES:
        raise ValueError(
            f"{option_name('dtype', requested)} is not one of {', '.join(map(repr, DTYPES))} (or None to keep the "
            "source's)"
        )
    return DTYPES[requested]


def cast_checked(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` (floating tensors only), refusing a cast that turns a finite value into infinity: the
    error names the tensor and the option that chose the dtype."""
    if not tensor.is_floating_point() or tensor.dtype == dtype or tensor.device.type == "meta":
        return tensor
    cast = tensor.to(dtype)
    if torch.finfo(dtype).max < torch.finfo(tensor.dtype).max:
        overflow = torch.isinf(cast) & torch.isfinite(tensor)
        if overflow.any():
            largest = float(tensor[overflow].abs().max())
            raise ValueError(
                f"{name} holds values up to {largest:.4g} in magnitude, beyond {_name(dtype)}'s range "
                f"(±{torch.finfo(dtype).max:.6g}): {option_name('dtype', _name(dtype))} cannot hold the source "
                f"({_name(tensor.dtype)}); write bfloat16 or float32, or leave {option_name('dtype')} out to keep the "
                "source's"
            )
    return cast


def saved_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """What `save_pretrained` writes of `model`: every parameter and persistent buffer once (tied ones once), by name,
    with whether the model's class keeps it in float32 whatever its dtype (`_keep_in_fp32_modules(_strict)`, e.g.
    balancing biases). Non-persistent buffers (rotary frequencies) are not saved."""
    kept = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    seen = set()
    for module_name, module in model.named_modules():
        persistent_buffers = [(name, tensor) for name, tensor in module._buffers.items()
                              if name not in module._non_persistent_buffers_set]  # fmt: skip
        for name, tensor in [*module._parameters.items(), *persistent_buffers]:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            full_name = f"{module_name}.{name}" if module_name else name
            yield full_name, tensor, tensor.is_floating_point() and bool(kept & set(full_name.split(".")))


@torch.no_grad()
def cast_model(model: torch.nn.Module, dtype: torch.dtype, check: bool = True) -> torch.nn.Module:
    """`model` with what it saves (`saved_tensors`) in `dtype`, but the tensors its class keeps in float32; with
    `check`, each cast through `cast_checked` (an uninitialised model, about to be filled, is cast unchecked)."""
    for name, tensor, float32_kept in saved_tensors(model):
        if tensor.is_floating_point() and not float32_kept:
            tensor.data = cast_checked(name, tensor.data, dtype) if check else tensor.data.to(dtype)
    return model


def load_checked(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], **options):
    """`model.load_state_dict(state_dict, **options)`, each tensor first checked to fit the dtype of the model's
    tensor it is copied into (`cast_checked`): load_state_dict itself casts silently."""
    targets = model.state_dict()
    checked = {key: cast_checked(key, tensor, targets[key].dtype) if key in targets else tensor
               for key, tensor in state_dict.items()}  # fmt: skip
    return model.load_state_dict(checked, **options)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
