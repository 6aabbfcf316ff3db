"""MoEMB's recipes beyond the LoRA one on two gloo processes give the results of one process on the same global
batches: GRPO over the efficiency heads under DDP (the rewards' candidates, the advantages and the rollouts' draws
are the global batch's). Tiny models, two steps, one thread per process; one launch per test.

Run as a script, this file is the training command of every process: `torchrun ... test_moemb_distributed.py
RECIPE MODEL OUT [--fsdp N] [--ep N]`.
"""

import argparse
import json
import sys

import pytest
import torch

from moezoo.training.moemb_grpo import GrpoOptions, train_moemb_grpo
from moezoo.training.moemb_synthetic import ShapeRetrieval

from conftest import run_processes
from test_distributed_training import GLOBAL_BATCH, LEARNING_RATE, STEPS, WORLD, assert_same_weights


def train(recipe: str, model, out, batch_size: int, fsdp: int = 1, ep: int = 1) -> dict:
    """One run of `moezoo train moemb` with `recipe`, deterministic: fixed data, no dropout, the same seed
    everywhere."""
    data = ShapeRetrieval().training_dataset(16, torch.Generator().manual_seed(0))
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, fsdp=fsdp, ep=ep)
    # masked rollouts: the packed ones take the same actions, and are slower on the CPU at this size
    options = GrpoOptions(**common, rollouts=2, execution="masked")
    return train_moemb_grpo(model, data, out, options)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train(args.recipe, args.model, args.out, GLOBAL_BATCH // WORLD, args.fsdp, args.ep)


def assert_same_record(folder, reference: dict, names: tuple[str, ...]) -> None:
    """The training record of the run that wrote `folder` (values rounded to 4 decimals) is the reference run's."""
    training = json.loads((folder / "moezoo.json").read_text())["training"]
    for name in names:
        assert training[name] == pytest.approx(reference[name], abs=2e-4), name


@pytest.mark.slow
def test_grpo_under_ddp_trains_as_one_process_on_the_global_batch(tiny_moemb, tmp_path):
    """Rewards, FLOPs saving and accuracy of the first and last steps, and the trained heads, as one process's."""
    reference = train("grpo", tiny_moemb, tmp_path / "one", GLOBAL_BATCH)
    run_processes(__file__, "grpo", tiny_moemb, tmp_path / "ddp", nproc=WORLD, timeout=300)
    assert_same_weights(tmp_path / "ddp", tmp_path / "one")
    assert_same_record(tmp_path / "ddp", reference, tuple(f"{name}_{when}" for name in ("reward", "flops_saving",
                       "accuracy") for when in ("first", "last")))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
