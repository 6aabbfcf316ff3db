"""Round-robin timing, shared by the benchmarks: one call of each contender per round and the median over rounds,
so that the drift of a shared, noisy machine hits all of them alike; the size of the CPU's last-level cache; the
`--threads` option they all take, and the device, dtype and experts implementation options of the MoE benchmarks
with the line that names the device in their titles."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch CPU threads (default: torch's, one per core; on a machine shared with other jobs, fewer threads "
        "than cores avoid threads waiting for each other at every operation)",
    )


DEVICES = ("cpu", "cuda")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu",
        help="cuda: on a GPU, with moezoo's Triton kernels (moezoo_triton) in place of its CPU implementation",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--impl", nargs="+", default=None,
                        help="experts implementations to time (default: all that run on the device)")


def describe_device(device: str) -> str:
    """What a benchmark's title says it ran on: the GPU's name, or the CPU threads torch computes with."""
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU threads: {torch.get_num_threads()}"


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's CPU threads from `--threads`, if given."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)


def time_round_robin(
    calls: Mapping[str, Callable[[], object]], seconds: float, max_rounds: int, min_rounds: int = 3
) -> dict[str, float]:
    """Median seconds per call of each named call: at least `min_rounds` rounds, then more until `seconds` have
    passed or `max_rounds` are done. Each round runs the calls in a new order (shuffled, seeded), so that no call
    always follows the same one and finds the caches as that one left them. Run every call once beforehand (an
    accuracy check, a warm-up) so that no round is a cold start."""
    names = list(calls)
    shuffler = random.Random(0)
    samples: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - started < seconds):
        shuffler.shuffle(names)
        for name in names:
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: sorted(times)[len(times) // 2] for name, times in samples.items()}


def last_level_cache_bytes(
    cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache"), default: int = 64 * 2**20
) -> int:
    """The size of the largest CPU cache Linux reports for CPU 0 (`default` where sysfs does not say)."""
    sizes = []
    for size_file in cache_dir.glob("index*/size"):
        try:
            text = size_file.read_text().strip()
        except OSError:
            continue
        multiplier = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * multiplier)
    return max(sizes, default=default)
