"""The benchmarks' timing helpers: the round-robin order and the size of the last-level cache."""

import pytest

from moezoo.bench.timing import last_level_cache_bytes, time_round_robin


def test_round_robin_shuffles_the_order_of_every_round():
    called = []
    calls = {name: (lambda name=name: called.append(name)) for name in "abc"}
    timings = time_round_robin(calls, seconds=60.0, max_rounds=12)
    assert set(timings) == {"a", "b", "c"} and all(seconds >= 0 for seconds in timings.values())
    assert len(called) == 36
    assert all(sorted(called[i:i + 3]) == ["a", "b", "c"] for i in range(0, 36, 3))  # each once per round
    # no call always follows the same other one
    for name in "abc":
        before = {called[i - 1] for i in range(1, len(called)) if called[i] == name} - {name}
        assert len(before) == 2, (name, called)


def test_round_robin_runs_min_rounds_even_without_time_left():
    counts = {"only": 0}

    def call():
        counts["only"] += 1

    time_round_robin({"only": call}, seconds=0.0, max_rounds=10, min_rounds=3)
    assert counts["only"] == 3


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [({"index0": "48K", "index2": "2048K", "index3": "307200K"}, 300 * 2**20), ({"index1": "2M"}, 2 * 2**20), ({}, 7)],
)
def test_last_level_cache_is_the_largest_reported(tmp_path, sizes, expected):
    for index, size in sizes.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path, default=7) == expected
