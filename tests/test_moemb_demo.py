"""The MoEMB demo stage's step 5 in quick mode (`demos.moemb.adaptive_computation`): MoDES + GDN-β and a short GRPO
run over the efficiency gates, each evaluated with MMEB's protocol beside full compute, in one table, and the GRPO
policy's per-layer skip and drop rates by modality written as a PNG (the paper's Fig. 9). Step 5 runs here on the
random tiny model that the stage would have trained first: steps 1-4 (conversion, 120 LoRA steps, evaluation) take
minutes on the CPU and are not run (the converter, the trainer and the evaluation have their own tests). About 17 s."""

import math

import pytest
import torch

from moezoo.demos import moemb as demo
from moezoo.evaluation.moemb import ForwardTally, evaluate_mmeb
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.moemb import MoEmbProcessor
from moezoo.terminal import console
from moezoo.training.moemb_synthetic import ShapeRetrieval

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stage(tiny_moemb, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moemb_demo")
    data = ShapeRetrieval()
    tasks = demo.write_eval_tasks(out_dir / "mmeb_eval", data, num_queries=4)
    model, processor = MoEmbForEmbedding.from_pretrained(tiny_moemb).eval(), MoEmbProcessor.from_pretrained(tiny_moemb)
    with torch.no_grad(), ForwardTally(model) as tally:
        scores = evaluate_mmeb(model, processor, tasks, progress=False)
    full = {"hit@1": scores["overall"], "flops_saving": 0.0,
            "embeddings_per_second": tally.throughput()["embeddings_per_second"]}  # fmt: skip
    grpo_out = out_dir / "grpo"
    with console.capture() as printed:
        result = demo.adaptive_computation(model, processor, tiny_moemb, full, data, tasks, grpo_out, quick=True)
    return grpo_out, result, printed.get()


def test_the_table_has_full_compute_and_both_adaptive_runs(stage):
    _, result, printed = stage
    runs = result["runs"]
    assert list(runs) == ["full compute", "MoDES 30% + GDN-β keep 0.5", "GRPO gates (greedy)"]
    for text in ("hit@1", "FLOPs saving", "embeddings/s", "speedup", *runs):
        assert text in printed, text
    assert runs["full compute"]["flops_saving"] == 0.0
    for name, row in runs.items():
        assert 0.0 <= row["hit@1"] <= 1.0, name
        assert math.isfinite(row["embeddings_per_second"]) and row["embeddings_per_second"] > 0, name
    # MoDES is calibrated for 30% of the routed slots and GDN-β drops half the visual tokens: both save FLOPs
    assert 0.0 < runs["MoDES 30% + GDN-β keep 0.5"]["flops_saving"] < 1.0
    assert 0.0 <= runs["GRPO gates (greedy)"]["flops_saving"] < 1.0


def test_the_grpo_run_writes_its_curves_and_the_rates_figure(stage):
    grpo_out, result, _ = stage
    for name in ("grpo_curves.png", "action_rates.png"):
        path = grpo_out / name
        assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE, name
    assert (grpo_out / "config.json").is_file()  # the policy the table's GRPO row was evaluated with
    training = result["grpo"]
    assert training["steps"] == 4 and training["rollouts"] == 4  # quick mode
    for name in ("reward_first", "reward_last", "flops_saving_last", "greedy_flops_saving"):
        assert math.isfinite(training[name]), name
