"""Round-robin timing, shared by the benchmarks: one call of each contender per round and the median over rounds,
so that the drift of a shared, noisy machine hits all of them alike; and the `--threads` option they all take."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping

import torch


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch CPU threads (default: torch's, one per core; on a machine shared with other jobs, fewer threads "
        "than cores avoid threads waiting for each other at every operation)",
    )


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
    passed or `max_rounds` are done. Run every call once beforehand (an accuracy check, a warm-up) so that no round
    is a cold start."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    started = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - started < seconds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: sorted(times)[len(times) // 2] for name, times in samples.items()}
