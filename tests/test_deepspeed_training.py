"""`moezoo train ARCH --deepspeed zero3` on two gloo processes (DeepSpeed's CPU accelerator): SMoES trained in full
and with `--lora`, and OmniMoE-VL's Stage I (its 0-d `fusion_output_scale`), give the losses and the final (merged)
weights of one process on the same global batches, and the saved folder loads in a fresh process; a run resumes from
its DeepSpeed checkpoint; what does not combine with `--deepspeed` is refused. Tiny models, two steps, one thread per
process; the helpers, fixtures and one-process runs are those of tests/test_distributed_training_vlm.py.

The launches partition every parameter (`zero3_config`), the tiny models' small ones included. Every process runs
tests/test_distributed_training_vlm.py's training command with `--deepspeed CONFIG`: one launch runs the runs of
`RUNS` and the interrupted run in turn (conftest's `Scenarios`), another the resumption.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from moezoo.training import deepspeed_zero

import test_distributed_training_vlm
from conftest import Scenarios, resume_interrupted, run_python
from test_distributed_training import INTERRUPTED, WEIGHT_ATOL, WORLD, assert_same_losses, assert_same_weights
from test_distributed_training_vlm import distributed_arguments, folders, one_process  # noqa: F401 (fixtures)

# Installed by the `test` extra; skipped before the fixtures build their models when it is not.
requires_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                        reason=f"DeepSpeed is not installed: {deepspeed_zero.INSTALL}")


@pytest.fixture(scope="module")
def zero3_config(tmp_path_factory):
    """The `zero3` preset with every parameter partitioned: DeepSpeed keeps the parameters under
    `stage3_param_persistence_threshold` elements (1e5 by default, most of a tiny model's) whole on every process."""
    config = deepspeed_zero.read_config("zero3")
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp_path_factory.mktemp("deepspeed") / "zero3_all_partitioned.json"
    path.write_text(json.dumps(config))
    return path


# The ZeRO-3 runs, by name: (arch, LoRA rank). One launch (`launched`) runs them in turn, and then SMoES's run
# checkpointing every step, interrupted at step 2 of 2 (`interrupted`), which another launch resumes (`resumed`).
RUNS = {"smoes": ("smoes", 0), "smoes-lora": ("smoes", 2), "omnimoe_vl": ("omnimoe_vl", 0)}
CHECKPOINTED = ("smoes", 0)


def zero3_arguments(folders, out, config, arch: str, lora_r: int, *flags) -> list:
    """The arguments of tests/test_distributed_training_vlm.py's command for a ZeRO-3 run of `arch` (Stage I)."""
    return distributed_arguments(folders, out, arch, "I", lora_r, False, ("--deepspeed", config, *flags))


@pytest.fixture(scope="module")
def launched(folders, zero3_config, tmp_path_factory):
    """Every run of `RUNS` in one launch of two processes, writing `ROOT/NAME`, then the interrupted run."""
    root = tmp_path_factory.mktemp("launched")
    scenarios = {name: zero3_arguments(folders, root / name, zero3_config, *run) for name, run in RUNS.items()}
    scenarios["interrupted"] = zero3_arguments(folders, root / "interrupted", zero3_config, *CHECKPOINTED,
                                               "--save-steps", 1, "--stop-at", 2)  # fmt: skip
    return Scenarios(Path(test_distributed_training_vlm.__file__), scenarios, root, nproc=WORLD)


@pytest.fixture(scope="module")
def resumed(folders, zero3_config, launched):
    """The interrupted run of `launched` resumed: `interrupted-resumed`."""
    return resume_interrupted(launched, {
        "interrupted": zero3_arguments(folders, launched.root / "interrupted-resumed", zero3_config, *CHECKPOINTED,
                                       "--save-steps", 1, "--resume"),  # fmt: skip
    })


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("lora_r", [0, 2])
def test_zero3_trains_as_one_process(lora_r, one_process, launched):
    """SMoES (a Qwen3.5-MoE host): its sparse MoE blocks are ZeRO-3 leaves; in full, and with PEFT's LoRA attached
    after loading (partitioned by DeepSpeed with the rest), merged at the end. The full run's folder loads in a
    fresh process."""
    reference, summary = one_process("smoes", "I", lora_r)
    zero3 = launched.check("smoes-lora" if lora_r else "smoes")
    assert_same_weights(zero3, reference)
    assert_same_losses(zero3, summary)
    if lora_r:
        return
    run_python(f"""
        import torch
        from moezoo.training.smoes import load_smoes_model
        trained, _ = load_smoes_model({str(zero3)!r})
        expected, _ = load_smoes_model({str(reference)!r})
        for name, tensor in expected.state_dict().items():
            torch.testing.assert_close(trained.state_dict()[name], tensor, rtol=0, atol={WEIGHT_ATOL}, msg=name)
    """)


@pytest.mark.slow
@requires_deepspeed
def test_a_zero3_run_resumes_from_its_deepspeed_checkpoint(one_process, launched, resumed):
    """Stopped after its checkpoint at step 1 of 2 and resumed, it ends with the weights of one uninterrupted
    process."""
    reference, _ = one_process("smoes", "I")
    stopped = launched.check("interrupted", exit_status=INTERRUPTED)
    assert not stopped.exists()
    assert [path.name for path in stopped.with_name("interrupted.checkpoints").iterdir()] == ["checkpoint-1"]
    assert_same_weights(resumed.check("interrupted-resumed"), reference)


def test_the_deepspeed_option_reaches_every_train_command(tmp_path):
    """`--deepspeed` is a Trainer option: every train command parses it into its options (the check at construction
    needs DeepSpeed installed, so it is only parsed here)."""
    from moezoo.training import moe_vie, moemb, mote, omnimoe_vl, smoes
    from moezoo.training.arguments import trainer_options

    for module in (moe_vie, moemb, mote, omnimoe_vl, smoes):
        parser = argparse.ArgumentParser()
        module.add_train_arguments(parser)
        args = parser.parse_args(["--model", "m", "--data", "d", "--out", "o", "--deepspeed", "zero3"])
        assert trainer_options(args)["deepspeed"] == "zero3", module.__name__


def test_what_does_not_combine_with_deepspeed_is_refused_before_loading(tmp_path, monkeypatch):
    from moezoo.training.arguments import TrainerOptions

    with pytest.raises(ValueError, match="--deepspeed with --fsdp 2 / --ep 1: both shard the model"):
        TrainerOptions(deepspeed="zero3", fsdp=2)
    with pytest.raises(ValueError, match="--deepspeed 'zero4' is neither a preset \\(zero3\\) nor"):
        deepspeed_zero.read_config("zero4")
    (tmp_path / "broken.json").write_text("{stage: 3")
    with pytest.raises(ValueError, match="broken.json: not a JSON file"):
        deepspeed_zero.read_config(str(tmp_path / "broken.json"))
    (tmp_path / "list.json").write_text("[3]")
    with pytest.raises(ValueError, match="a DeepSpeed config is a JSON object, got list"):
        deepspeed_zero.read_config(str(tmp_path / "list.json"))
    (tmp_path / "mine.json").write_text('{"zero_optimization": {"stage": 2}}')
    assert deepspeed_zero.read_config(str(tmp_path / "mine.json")) == {"zero_optimization": {"stage": 2}}
    assert deepspeed_zero.read_config("zero3")["zero_optimization"]["stage"] == 3
    monkeypatch.setattr(deepspeed_zero.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"DeepSpeed, which is not installed: pip install 'moezoo\[deepspeed\]'"):
        TrainerOptions(deepspeed="zero3")


@pytest.mark.slow
@requires_deepspeed
def test_zero3_trains_omnimoe_vl_and_its_0d_parameter_as_one_process(one_process, launched):
    """OmniMoE-VL's Stage I, the projector: its 0-d `fusion_output_scale`, which DeepSpeed cannot partition, trains as
    a one-element vector and is saved 0-d again (the weights are compared shape and all)."""
    reference, summary = one_process("omnimoe_vl", "I")
    zero3 = launched.check("omnimoe_vl")
    assert_same_weights(zero3, reference)
    assert_same_losses(zero3, summary)


@requires_deepspeed
def test_zero3_marks_the_moe_blocks_as_leaves_but_not_those_with_expert_adapters():
    """MoEMB's model: every sparse MoE block is a leaf; once expert adapters parametrize the experts (every layer's
    here), none is (see `set_moe_blocks_as_leaves`)."""
    from deepspeed.utils import z3_leaf_module

    from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
    from moezoo.modeling.moe.block import SparseMoeBlock
    from moezoo.modeling.moemb import MoEmbForEmbedding
    from moezoo.training.expert_lora import add_expert_adapters

    model = MoEmbForEmbedding(MoEmbConfig(**TINY_MOEMB))
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    assert blocks and deepspeed_zero.set_moe_blocks_as_leaves(model) == blocks
    assert all(z3_leaf_module(block) for block in blocks)

    adapted = MoEmbForEmbedding(MoEmbConfig(**TINY_MOEMB))
    add_expert_adapters(adapted, 2, 4)
    assert deepspeed_zero.set_moe_blocks_as_leaves(adapted) == []
    assert not any(z3_leaf_module(module) for module in adapted.modules())


def test_a_trainer_that_cannot_run_zero3_is_refused_with_its_reason():
    from types import SimpleNamespace

    class Trainer:  # the Trainer's first two parameters
        def __init__(self, model, args):
            self.model = model

    class RefusingTrainer(deepspeed_zero.DeepSpeedZero3Mixin, Trainer):
        zero3_refusal = "its vision tower runs on some processes only"

    def arguments(zero3: bool):
        return SimpleNamespace(hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: zero3))

    with pytest.raises(ValueError, match="--deepspeed with ZeRO-3: its vision tower runs on some processes only"):
        RefusingTrainer(torch.nn.Linear(2, 2), arguments(zero3=True))
    assert RefusingTrainer(torch.nn.Linear(2, 2), arguments(zero3=False)).model is not None  # ZeRO-2 and below run

