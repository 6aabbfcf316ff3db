"""MoEMB's recipes beyond the LoRA one on two gloo processes give the results of one process on the same global
batches: GRPO over the efficiency heads under DDP (the rewards' candidates and the advantages the global batch's,
each input's draws those of one process on the global batch), `--fsdp 2` and `--ep 2` (the frozen backbone sharded,
the heads kept whole); the trained efficiency gates (`--adaptive-recipe`: global rates and load balance, the pruner's
Gumbel noise drawn as for the global batch, the layer-skip gates kept whole, the distillation teacher) under the same
three; GradCache (`--chunk-size`)
under `--fsdp 2` and `--ep 2`. Tiny models, two steps, one thread per process; one launch for the file, which runs
every test's recipes and parallelisms in turn.

Run as a script, this file is the training command of every process: `torchrun ... test_moemb_distributed.py RECIPE
PARALLELISM MODEL OUT`, or `--scenarios PLAN DONE` (conftest's `Scenarios`) for the runs of `RUNS`.
"""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from moezoo.training import moemb
from moezoo.training.moemb_adaptive import AdaptiveRecipeOptions
from moezoo.training.moemb_grpo import GrpoOptions, train_moemb_grpo
from moezoo.training.moemb_synthetic import ShapeRetrieval

from conftest import Scenarios, run_scenarios
from test_distributed_training import GLOBAL_BATCH, LEARNING_RATE, STEPS, WORLD, assert_same_weights


def train(recipe: str, model, out, batch_size: int, fsdp: int = 1, ep: int = 1) -> dict:
    """One run of `moezoo train moemb` with `recipe`, deterministic: fixed data, no dropout, the same seed
    everywhere."""
    data = ShapeRetrieval().training_dataset(16, torch.Generator().manual_seed(0))
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, fsdp=fsdp, ep=ep)
    if recipe == "grpo":
        # masked rollouts: the packed ones take the same actions, and are slower on the CPU at this size
        return train_moemb_grpo(model, data, out, GrpoOptions(**common, rollouts=2, execution="masked"))
    lora = moemb.LoraOptions(rank=2, alpha=4, dropout=0.0)
    if recipe == "gradcache":  # the LoRA recipe, each process embedding its batch one input at a time
        options = moemb.MoEmbTrainingOptions(**common, warmup_steps=0, lora=lora, chunk_size=1)
    else:
        options = moemb.MoEmbTrainingOptions(**common, warmup_steps=0, lora=lora,
                                             adaptive=AdaptiveRecipeOptions(recipe))  # fmt: skip
    return moemb.train_moemb(model, data, out, options)


PARALLELISMS = {"ddp": {}, "fsdp": {"fsdp": WORLD}, "ep": {"ep": WORLD}}


# recipe -> parallelisms of each test's runs on two processes
GRPO_RUNS = {"grpo": tuple(PARALLELISMS)}
ADAPTIVE_RUNS = {"combined_simultaneous": tuple(PARALLELISMS), "layer_skip": ("ep",), "adamoe": ("ddp",),
                 "gradcache": ("fsdp", "ep")}  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("parallelism", choices=PARALLELISMS)
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train(args.recipe, args.model, args.out, GLOBAL_BATCH // WORLD, **PARALLELISMS[args.parallelism])


@pytest.fixture(scope="module")
def launched(tiny_moemb, tmp_path_factory):
    """The runs of every test in one launch of two processes, `RECIPE-PARALLELISM` each, writing `ROOT/NAME`."""
    root = tmp_path_factory.mktemp("launched")
    scenarios = {f"{recipe}-{parallelism}": [recipe, parallelism, tiny_moemb, root / f"{recipe}-{parallelism}"]
                 for runs in (GRPO_RUNS, ADAPTIVE_RUNS) for recipe, parallelisms in runs.items()
                 for parallelism in parallelisms}  # fmt: skip
    return Scenarios(Path(__file__), scenarios, root, nproc=WORLD)


def assert_same_record(folder, reference: dict, names: tuple[str, ...]) -> None:
    """The training record of the run that wrote `folder` (values rounded to 4 decimals) is the reference run's:
    `names`, and the realised rates of the trained gates (`rate/*`) where it has some."""
    training = json.loads((folder / "moezoo.json").read_text())["training"]
    for name in names + tuple(name for name in reference if name.startswith("rate/")):
        assert training[name] == pytest.approx(reference[name], abs=2e-4), name


def assert_runs_train_as_one_process(model, launched, folder, runs: dict[str, tuple[str, ...]],
                                     names: tuple[str, ...]) -> None:  # fmt: skip
    """`runs` (recipe -> parallelisms) of the launch, each against one process on the global batch (trained in
    `folder`): the same weights, and the same `names` in the training record."""
    for recipe, parallelisms in runs.items():
        reference = train(recipe, model, folder / recipe, GLOBAL_BATCH)
        for parallelism in parallelisms:
            many = launched.check(f"{recipe}-{parallelism}")
            assert_same_weights(many, folder / recipe)
            assert_same_record(many, reference, names)


@pytest.mark.slow
def test_grpo_on_two_processes_trains_as_one_process_on_the_global_batch(tiny_moemb, launched, tmp_path):
    """Under DDP, --fsdp 2 and --ep 2: rewards, FLOPs saving and accuracy of the first and last steps, and the
    trained heads, as one process's."""
    names = tuple(f"{name}_{when}" for name in ("reward", "flops_saving", "accuracy") for when in ("first", "last"))
    assert_runs_train_as_one_process(tiny_moemb, launched, tmp_path, GRPO_RUNS, names)


@pytest.mark.slow
def test_adaptive_recipes_and_gradcache_on_two_processes_train_as_one_process(tiny_moemb, launched, tmp_path):
    """The combined recipe (pruner, skip gate, layer skip; squared per-action budgets of the global rates) under DDP,
    --fsdp 2 and --ep 2, layer skip with its distillation teacher under --ep 2 (a teacher copied from the split model
    would run the student's experts), AdaMoE's load balancing under DDP, and the LoRA recipe with GradCache (chunks of
    one input: every chunk's backward reduces its gradients, which accumulate) under --fsdp 2 and --ep 2: losses,
    realised rates and merged weights as one process's."""
    names = ("initial_loss", "final_loss", "mean_loss")
    assert_runs_train_as_one_process(tiny_moemb, launched, tmp_path, ADAPTIVE_RUNS, names)


def test_adaptive_recipes_refuse_gradcache_saying_why(tiny_moemb, tmp_path):
    options = moemb.MoEmbTrainingOptions(steps=1, batch_size=4, chunk_size=2, adaptive=AdaptiveRecipeOptions())
    with pytest.raises(ValueError, match=r"--adaptive-recipe .* GradCache \(--chunk-size\) does not back-propagate"):
        data = ShapeRetrieval().training_dataset(8, torch.Generator())
        moemb.train_moemb(tiny_moemb, data, tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    run_scenarios(main, sys.argv[1:])
