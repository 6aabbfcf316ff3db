"""Round-robin timing, shared by the benchmarks: one call of each contender per round and the median over rounds,
so that the drift of a shared, noisy machine hits all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


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
