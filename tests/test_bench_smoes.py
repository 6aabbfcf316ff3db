"""`moezoo bench smoes` at its smallest: two training steps, four routed samples, two gloo processes. The bytes it
reports are checked against the analytic counts of its own dispatch metrics (so they are the bytes the all-to-alls
really sent), and its verdict against the floor and the target."""

import argparse
import json

import pytest

from moezoo.bench.smoes import BENCH_TEXT_CONFIG, TARGET_SAVING, run_bench


HIDDEN_BYTES = BENCH_TEXT_CONFIG["hidden_size"] * 4  # one fp32 token row
EXPERTS, TOP_K, LAYERS = BENCH_TEXT_CONFIG["num_experts"], BENCH_TEXT_CONFIG["num_experts_per_tok"], 4
SAMPLES, DEVICES = 4, 2


@pytest.fixture(scope="module")
def smallest_args():
    return argparse.Namespace(devices=[DEVICES], steps=2, batch_size=2, eval_samples=SAMPLES, json=True)


def test_bench_reports_the_bytes_the_dispatch_counts_predict(smallest_args, capsys):
    assert run_bench(smallest_args) == 0
    output = json.loads(capsys.readouterr().out)
    rows = {(row["routing"], row["implementation"]): row for row in output["rows"]}
    assert set(rows) == {(routing, ep) for routing in ("top-k", "smoes") for ep in ("all_to_all", "dedup")}
    tokens = SAMPLES * 24  # vision_start, 16 image tokens, vision_end, 6 caption tokens
    split_counts = LAYERS * DEVICES * (DEVICES - 1)  # one count row per destination, per rank and layer
    for (routing, implementation), row in rows.items():
        if implementation == "all_to_all":
            # each remote (token, expert) pair goes out and comes back; the counts are per expert (E / D longs)
            pair_rows = row["remote_pair_frac"] * tokens * TOP_K * LAYERS
            expected = 2 * pair_rows * HIDDEN_BYTES + split_counts * EXPERTS // DEVICES * 8
        else:
            # each (token, remote rank) goes out with its k expert ids (int64) and weights (fp32), and one sum returns
            token_rows = row["dedup_remote_devices_per_token"] * tokens * LAYERS
            expected = token_rows * (2 * HIDDEN_BYTES + TOP_K * 12) + split_counts * 8
        assert row["bytes_sent"] == pytest.approx(expected, rel=1e-9), (routing, implementation)
    assert rows["top-k", "all_to_all"]["saving"] == 0.0
    # dedup never sends more token rows than the pairs: at most one per pair, fewer when a token's experts share a rank
    assert rows["top-k", "dedup"]["bytes_sent"] < rows["top-k", "all_to_all"]["bytes_sent"]

    (verdict,) = output["verdicts"]
    assert verdict["saving"] == rows["smoes", "dedup"]["saving"]
    assert verdict["met"] == (verdict["saving"] >= TARGET_SAVING) and verdict["target"] == TARGET_SAVING
    # perfect specialisation: half the tokens cross, once each way, against the measured stock bytes
    floor_bytes = tokens * LAYERS / 2 * (2 * HIDDEN_BYTES + TOP_K * 12)
    assert verdict["floor"] == pytest.approx(1 - floor_bytes / rows["top-k", "all_to_all"]["bytes_sent"])


def test_devices_that_do_not_divide_the_samples_are_refused(smallest_args):
    args = argparse.Namespace(**{**vars(smallest_args), "devices": [3]})
    with pytest.raises(ValueError, match="--devices 3 must divide the 4 evaluation samples and the 16 experts"):
        run_bench(args)
