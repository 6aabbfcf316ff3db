"""Build and load `native_experts.c`, moezoo's C kernels: SwiGLU experts that see few tokens each (with the counting
sort that groups a call's pairs by expert for them), the SwiGLU pass between the BLAS GEMMs when they see many, and
the streaming read `moezoo bench moe-layer` takes as its floor.

The source is compiled on first use with the machine's C compiler (`$CC`, else `cc`) for this very CPU
(`-march=native`) and cached under `$MOEZOO_KERNEL_CACHE` (default `~/.cache/moezoo/kernels`), keyed by the source,
the compiler and the CPU, so a later process loads it in milliseconds. Without a compiler, or with
`MOEZOO_NATIVE_KERNELS=0`, or in code exported to a Hub folder (remote code carries no C source),
`native_library()` returns None and the sorted-experts implementation keeps to its PyTorch path; nothing else
changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_experts.c")
# -funroll-loops: ~2% off the 64-token forward of `moezoo bench moe-layer` (A/B of both builds in one process).
BASE_FLAGS = ("-O3", "-funroll-loops", "-march=native", "-fopenmp", "-fPIC", "-shared")
# GCC and Clang default to 256-bit vectors on some AVX-512 CPUs; the kernels are written for 16-float vectors.
WIDE_VECTOR_FLAGS = ("-mprefer-vector-width=512",)

_POINTER, _SIZE, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# The C functions' parameters, in order (native_experts.c documents them).
_PARAMETERS = {
    "moezoo_swiglu_forward": [
        ("x", _POINTER), ("num_tokens", _SIZE), ("hidden", _SIZE), ("width", _SIZE), ("num_experts", _SIZE),
        ("top_k", _SIZE), ("order", _POINTER), ("offsets", _POINTER), ("routing_weights", _POINTER),
        ("gate_up", _POINTER), ("down", _POINTER), ("projected", _POINTER), ("pair_out", _POINTER), ("out", _POINTER),
        ("num_threads", _INT),
    ],
    "moezoo_swiglu_backward": [
        ("grad_out", _POINTER), ("x", _POINTER), ("num_tokens", _SIZE), ("hidden", _SIZE), ("width", _SIZE),
        ("num_experts", _SIZE), ("top_k", _SIZE), ("order", _POINTER), ("offsets", _POINTER),
        ("routing_weights", _POINTER), ("gate_up", _POINTER), ("down", _POINTER), ("projected", _POINTER),
        ("grad_pair_x", _POINTER), ("grad_x", _POINTER), ("grad_routing_weights", _POINTER),
        ("grad_gate_up", _POINTER), ("grad_down", _POINTER), ("num_threads", _INT),
    ],
    "moezoo_swiglu_pairs": [
        ("projected", _POINTER), ("num_pairs", _SIZE), ("width", _SIZE), ("pair_weights", _POINTER),
        ("weighted_act", _POINTER), ("num_threads", _INT),
    ],
    "moezoo_swiglu_pairs_backward": [
        ("projected", _POINTER), ("d_weighted_act", _POINTER), ("num_pairs", _SIZE), ("width", _SIZE),
        ("pair_weights", _POINTER), ("weighted_act", _POINTER), ("d_projected", _POINTER),
        ("grad_pair_weights", _POINTER), ("num_threads", _INT),
    ],
    "moezoo_read_floats": [("p", _POINTER), ("n", _SIZE), ("total", _POINTER), ("num_threads", _INT)],
    "moezoo_sort_pairs": [
        ("expert_index", _POINTER), ("num_pairs", _SIZE), ("num_experts", _SIZE), ("order", _POINTER),
        ("offsets", _POINTER),
    ],
}
# The functions that return a value (the others return nothing).
_RESULTS = {"moezoo_sort_pairs": _SIZE}


def cache_dir() -> Path:
    return Path(os.environ.get("MOEZOO_KERNEL_CACHE") or Path.home() / ".cache" / "moezoo" / "kernels")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_description() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags", "Features")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file next to `target`, then rename it into place (concurrent builds are safe)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        for extra in (WIDE_VECTOR_FLAGS, ()):
            command = [compiler, *BASE_FLAGS, *extra, str(SOURCE), "-o", temporary]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode == 0:
                os.replace(temporary, target)
                return
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when disabled or no C compiler can build them."""
    if os.environ.get("MOEZOO_NATIVE_KERNELS", "1") == "0":
        return None
    if not SOURCE.exists():  # exported remote code: transformers copies only the .py files of a Hub folder
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("moezoo: no C compiler found; the native experts kernels are off")
        return None
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, _compiler_version(compiler), _cpu_description(), *BASE_FLAGS]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"native_experts-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as error:
        logger.warning("moezoo: the native experts kernels could not be built or loaded (%s); using PyTorch", error)
        return None
    for name, parameters in _PARAMETERS.items():
        function = getattr(library, name)
        function.argtypes, function.restype = [kind for _, kind in parameters], _RESULTS.get(name)
    return library
