"""`moezoo train omnimoe_vl` and `moezoo train smoes` on two gloo processes: DDP, FSDP2 (`--fsdp 2`) and expert
parallelism (`--ep 2`, SMoES also with moezoo's `--ep-implementation dedup`) give the logged losses and the final
weights of one process on the same global batch, OmniMoE-VL sharded after loading for its 0-d `fusion_output_scale`
(`moezoo.training.adapted_sharding`); so does `--lora` under `--fsdp 2` and `--ep 2`, the adapters attached before
the sharding; so does OmniMoE-VL with `--smoes` (SMoES on its language experts, attached by hooks before the
sharding) under `--fsdp 2` and `--ep 2`; an interrupted run resumes to the uninterrupted weights (SMoES under FSDP2
and under `--ep 2 --lora 2`, OmniMoE-VL under DDP). The token experts' load-balancing loss (`router_aux_loss_coef`)
is computed on each process's batch, as transformers does, so the OmniMoE-VL model is compared without it. Tiny
models, two steps, one thread per process; the helpers are those of tests/test_distributed_training.py.

Run as a script, this file is the training command of every process: `torchrun ... test_distributed_training_vlm.py
ARCH MODEL DATA OUT [--stage S] [--fsdp N] [--ep N] [--ep-implementation NAME] [--lora R] [--smoes]
[--save-steps N] [--resume] [--stop-at STEP]`, or `--scenarios PLAN DONE` (conftest's `Scenarios`): the runs that
train from the start (`RUNS`) and the interrupted runs share one launch, since starting the processes costs more
than a tiny run, and the resumptions share another.
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from moezoo.training import omnimoe_vl, smoes
from moezoo.training.arguments import trainer_options
from moezoo.training.sharded_checkpoints import DISTRIBUTED_CHECKPOINT
from moezoo.training.smoes import SmoesTrainingOptions, train_smoes
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

from conftest import Scenarios, resume_interrupted, run_scenarios
from test_distributed_training import (
    GLOBAL_BATCH,
    INTERRUPTED,
    LEARNING_RATE,
    STEPS,
    WORLD,
    assert_same_losses,
    assert_same_weights,
    interrupt_at,
)
from test_omnimoe_vl_training import QUESTIONS, image
from test_smoes_hosts import settings as smoes_settings


# Answers of one length (3 tokens each), as the captions of `write_shape_captions` (6): the language-model loss, a
# mean over each process's answer tokens, then averages over the processes to the loss of the global batch.
ANSWERS = ("red", "yes", "two", "one")


def train(arch: str, model, data, out, batch_size: int, stage: str = "I", smoes: bool = False, **options) -> dict:
    """One run of `moezoo train ARCH`, deterministic: fixed data, no dropout, the same seed everywhere. `options`:
    the sharding, checkpointing and LoRA options of the training options; `smoes`: OmniMoE-VL's `--smoes` (the tiny
    settings of tests/test_smoes_hosts.py)."""
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, **options)
    if arch == "omnimoe_vl":
        options = omnimoe_vl.OmniMoeVlTrainingOptions(**common, stage=stage, smoes=smoes_settings() if smoes else None)
        return omnimoe_vl.train_omnimoe_vl(model, data, out, options)
    return train_smoes(model, data, out, SmoesTrainingOptions(**common))  # `smoes` is the flag here


TRAINER_CLASSES = {"omnimoe_vl": omnimoe_vl.OmniMoeVlTrainer, "smoes": smoes.SmoesTrainer}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("arch", "model", "data", "out"):
        parser.add_argument(name)
    parser.add_argument("--stage", default="I")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--ep-implementation", default="auto")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--smoes", action="store_true")
    parser.add_argument("--deepspeed", help="a DeepSpeed config (tests/test_deepspeed_training.py)")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-at", type=int, help="interrupt the run at this optimizer step, as Ctrl-C would")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # the EP implementation the run asked for (transformers' "auto" trains with "all_to_all") must carry its tokens
    name = "all_to_all" if args.ep_implementation == "auto" else args.ep_implementation
    implementation, dispatches = EPImplementationInterface()[name], []
    dispatch = implementation._dispatch_tokens

    def counted_dispatch(self, *dispatch_args):
        dispatches.append(None)
        return dispatch(self, *dispatch_args)

    implementation._dispatch_tokens = counted_dispatch
    try:
        with interrupt_at(TRAINER_CLASSES[args.arch], args.stop_at):
            train(args.arch, args.model, args.data, args.out, GLOBAL_BATCH // WORLD, args.stage, args.smoes,
                  fsdp=args.fsdp, ep=args.ep, ep_implementation=args.ep_implementation, lora_r=args.lora,
                  save_steps=args.save_steps, resume=args.resume, deepspeed=args.deepspeed)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    finally:  # the next scenario of the launch counts its own dispatches, and loads its model whole
        implementation._dispatch_tokens = dispatch
        # transformers holds the DeepSpeed config of the run's TrainingArguments globally while they live (a weak
        # reference), and would partition the next scenario's model while loading it under a ZeRO-3 one
        unset_hf_deepspeed_config()
    assert bool(dispatches) == (args.ep > 1), f"{name}: {len(dispatches)} dispatches"


def distributed_arguments(folders, out, arch: str, stage: str, lora_r: int, smoes: bool, flags: tuple) -> list:
    """The script's arguments for a run of `arch` (Stage `stage`, LoRA rank `lora_r`, `--smoes`) with `flags`."""
    return [arch, *folders[arch], out, "--stage", stage, "--lora", lora_r, *flags, *(("--smoes",) if smoes else ())]


# The runs on two processes that train from the start, by test and case (the test's id): (arch, stage, LoRA rank,
# --smoes, flags). One launch (`launched`) runs them all in turn.
RUNS = {
    "ddp": {
        "omnimoe_vl-stage-I": ("omnimoe_vl", "I", 0, False, ()),
        "omnimoe_vl-stage-IV": ("omnimoe_vl", "IV", 0, False, ()),
        "smoes": ("smoes", "I", 0, False, ()),
    },
    "sharded_smoes": {
        "fsdp": ("smoes", "I", 0, False, ("--fsdp", WORLD)),
        "ep": ("smoes", "I", 0, False, ("--ep", WORLD)),
        "ep-dedup": ("smoes", "I", 0, False, ("--ep", WORLD, "--ep-implementation", "dedup")),
    },
    "lora_sharded": {
        "omnimoe_vl-stage-II-fsdp": ("omnimoe_vl", "II", 2, False, ("--fsdp", WORLD)),
        "omnimoe_vl-stage-IV-ep": ("omnimoe_vl", "IV", 2, False, ("--ep", WORLD)),
        "smoes-fsdp": ("smoes", "I", 2, False, ("--fsdp", WORLD)),
        "smoes-ep": ("smoes", "I", 2, False, ("--ep", WORLD)),
    },
    "sharded_omnimoe_vl": {
        "stage-I-fsdp": ("omnimoe_vl", "I", 0, False, ("--fsdp", WORLD)),
        "stage-IV-ep": ("omnimoe_vl", "IV", 0, False, ("--ep", WORLD)),
    },
    "omnimoe_vl_with_smoes_sharded": {
        "stage-II-fsdp": ("omnimoe_vl", "II", 0, True, ("--fsdp", WORLD)),
        "stage-IV-ep": ("omnimoe_vl", "IV", 0, True, ("--ep", WORLD)),
    },
}  # fmt: skip

# The runs interrupted after their checkpoint at step 1 of 2 and then resumed, by case (the test's id): (arch, LoRA
# rank, flags). They run last in `launched`, as `interrupted-CASE`, and their resumptions in a launch of their own.
INTERRUPTED_RUNS = {
    "smoes-fsdp": ("smoes", 0, ("--fsdp", WORLD)),
    "smoes-ep-lora": ("smoes", 2, ("--ep", WORLD)),
    "omnimoe_vl-ddp": ("omnimoe_vl", 0, ()),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each architecture's tiny preset (seed 0) and a data file of two global batches."""
    root = tmp_path_factory.mktemp("vlm")
    with open(root / "vqa.jsonl", "w") as file:
        for index in range(STEPS * GLOBAL_BATCH):
            image(index).save(root / f"{index}.png")
            file.write(json.dumps({"image": f"{index}.png", "question": QUESTIONS[index % 4],
                                   "answer": ANSWERS[index % 4]}) + "\n")  # fmt: skip
    omnimoe = create_from_preset("tiny-omnimoe_vl", root / "omnimoe_vl", seed=0)
    # The token experts' load balancing is each process's own (module docstring): off, to compare with one process
    config = json.loads((omnimoe / "config.json").read_text())
    for stack in ("text_config", "vision_config"):
        config[stack]["router_aux_loss_coef"] = 0.0
    (omnimoe / "config.json").write_text(json.dumps(config))
    return {
        "omnimoe_vl": (omnimoe, root / "vqa.jsonl"),
        "smoes": (create_from_preset("tiny-smoes", root / "smoes", seed=0),
                  write_shape_captions(root / "captions", STEPS * GLOBAL_BATCH)),
    }  # fmt: skip


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory):
    """`(arch, stage, lora rank, smoes) -> (folder, training summary)` of the one-process run on the global batch,
    each run once."""
    runs = {}

    def run(arch: str, stage: str, lora_r: int = 0, smoes: bool = False):
        key = arch, stage, lora_r, smoes
        if key not in runs:
            out = tmp_path_factory.mktemp("-".join(map(str, key))) / "one"
            runs[key] = out, train(arch, *folders[arch], out, GLOBAL_BATCH, stage, smoes, lora_r=lora_r)
        return runs[key]

    return run


def interrupted_run_arguments(folders, out, case: str, *flags) -> list:
    """The script's arguments for `INTERRUPTED_RUNS[case]` (Stage I, checkpoints every step) with `flags`."""
    arch, lora_r, sharding = INTERRUPTED_RUNS[case]
    return distributed_arguments(folders, out, arch, "I", lora_r, False, (*sharding, "--save-steps", 1, *flags))


@pytest.fixture(scope="module")
def launched(folders, tmp_path_factory):
    """Every run of `RUNS` in one launch of two processes, each named `TEST-CASE`, then the interrupted runs of
    `INTERRUPTED_RUNS`, named `interrupted-CASE`."""
    root = tmp_path_factory.mktemp("launched")
    scenarios = {f"{test}-{case}": distributed_arguments(folders, root / f"{test}-{case}", *run)
                 for test, runs in RUNS.items() for case, run in runs.items()}  # fmt: skip
    for case in INTERRUPTED_RUNS:
        scenarios[f"interrupted-{case}"] = interrupted_run_arguments(folders, root / f"interrupted-{case}", case,
                                                                     "--stop-at", 2)  # fmt: skip
    return Scenarios(Path(__file__), scenarios, root, nproc=WORLD)


@pytest.fixture(scope="module")
def resumed(folders, launched):
    """The interrupted runs of `launched` resumed, in one launch: `interrupted-CASE-resumed`."""
    return resume_interrupted(launched, {
        f"interrupted-{case}": interrupted_run_arguments(folders, launched.root / f"interrupted-{case}-resumed", case,
                                                         "--resume")  # fmt: skip
        for case in INTERRUPTED_RUNS
    })


def check_same_as_one_process(launched, one_process, test: str, case: str) -> Path:
    """The run `RUNS[test][case]` on two processes ends with the weights and losses of one process; its folder."""
    arch, stage, lora_r, smoes, _ = RUNS[test][case]
    reference, summary = one_process(arch, stage, lora_r, smoes)
    many = launched.check(f"{test}-{case}")
    assert_same_weights(many, reference)
    assert_same_losses(many, summary)
    return many


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNS["ddp"])
def test_ddp_trains_as_one_process_on_the_global_batch(case, launched, one_process):
    """OmniMoE-VL's Stage I (the projector) and Stage IV (everything: both stacks' experts and routers too)."""
    check_same_as_one_process(launched, one_process, "ddp", case)


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNS["sharded_smoes"])
def test_sharded_smoes_trains_as_one_process(case, launched, one_process):
    """SMoES trained in full (routers included): FSDP2 shards every layer; EP gives each process half of every
    layer's experts, reached by transformers' all-to-all or by moezoo's dedup EP (one copy of a token per process
    holding any of its experts)."""
    check_same_as_one_process(launched, one_process, "sharded_smoes", case)


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNS["lora_sharded"])
def test_lora_sharded_trains_as_one_process(case, launched, one_process):
    """The LoRA adapters (one per expert on the fused experts, `expert_lora`, and PEFT's on attention: SMoES and
    OmniMoE-VL's Stage IV) are attached before the sharding (`adapted_sharding`): FSDP2 shards them with their
    layers, and under EP each process adds its own experts' adapters to its half of the experts (Stage IV: of both
    stacks, the vision tower's GELU experts too); the merged weights and the losses are those of one process."""
    check_same_as_one_process(launched, one_process, "lora_sharded", case)


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERRUPTED_RUNS)
def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(case, launched, resumed, one_process):
    """Stopped after its checkpoint at step 1 of 2 and resumed with the same launch, the run ends with the weights of
    one uninterrupted process: SMoES under FSDP2 and under EP with `--lora 2` from its distributed checkpoint
    (`ShardedCheckpointsMixin`: model, SMoES buffers and optimizer state; with `--lora`, the expert adapters, which
    PEFT's files do not hold, are in it too), OmniMoE-VL's Stage I under DDP from the Trainer's checkpoint (the depth
    router's routing step included)."""
    arch, lora_r, _ = INTERRUPTED_RUNS[case]
    reference, summary = one_process(arch, "I", lora_r)
    stopped = launched.check(f"interrupted-{case}", exit_status=INTERRUPTED)
    assert not stopped.exists()
    checkpoint = stopped.with_name(f"{stopped.name}.checkpoints") / "checkpoint-1"
    assert (checkpoint / DISTRIBUTED_CHECKPOINT / ".metadata").is_file() == (arch == "smoes")
    if lora_r:
        saved = FileSystemReader(checkpoint / DISTRIBUTED_CHECKPOINT).read_metadata().state_dict_metadata
        assert any(".experts.parametrizations." in name and name.endswith(".lora_A") for name in saved)
    out = resumed.check(f"interrupted-{case}-resumed")
    assert not out.with_name(f"{out.name}.checkpoints").exists()
    assert_same_weights(out, reference)
    step = {"smoes": "smoes_step", "omnimoe_vl": "routing_step"}[arch]  # the model's own clock, a buffer
    assert json.loads((out / "moezoo.json").read_text())["training"][step] == summary[step] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNS["sharded_omnimoe_vl"])
def test_sharded_omnimoe_vl_trains_as_one_process(case, launched, one_process):
    """Sharded after loading (`adapted_sharding`): the projector's 0-d `fusion_output_scale`, which FSDP2 cannot shard,
    stays whole on every process. Stage I trains the projector alone under FSDP2; Stage IV trains everything with
    each process holding half of both stacks' experts (8 per MoE layer)."""
    check_same_as_one_process(launched, one_process, "sharded_omnimoe_vl", case)


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNS["omnimoe_vl_with_smoes_sharded"])
def test_omnimoe_vl_with_smoes_sharded_trains_as_one_process(case, launched, one_process):
    """SMoES on the language experts (`--smoes`), its hooks attached before the sharding: they read each layer's
    input, the attention's queries and keys and each MoE block's router input and logits inside the gathered FSDP2
    units, and under EP the router runs on every process for its own tokens. The SMoES statistics and bin balance are
    summed over the processes, so the weights, the SMoES buffers (saved with them) and the losses are those of one
    process."""
    many = check_same_as_one_process(launched, one_process, "omnimoe_vl_with_smoes_sharded", case)
    saved = json.loads((many / "moezoo.json").read_text())["training"]
    stage = RUNS["omnimoe_vl_with_smoes_sharded"][case][1]
    assert saved["smoes_step"] == one_process("omnimoe_vl", stage, 0, True)[1]["smoes_step"] > 0


def test_an_ep_implementation_without_ep_is_refused(folders, tmp_path):
    options = smoes.SmoesTrainingOptions(steps=1, batch_size=1, ep_implementation="dedup")
    with pytest.raises(ValueError, match="--ep-implementation dedup chooses how tokens reach the experts under expert "
                                         "parallelism, which this run does not use: add --ep N"):  # fmt: skip
        smoes.train_smoes(*folders["smoes"], tmp_path / "out", options)
    with pytest.raises(ValueError, match="--ep-implementation 'nope' is not one of .*: auto, all_to_all, .*dedup"):
        smoes.train_smoes(*folders["smoes"], tmp_path / "out", replace(options, ep=WORLD, ep_implementation="nope"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("module", "options_class"), [(omnimoe_vl, omnimoe_vl.OmniMoeVlTrainingOptions),
                                                      (smoes, smoes.SmoesTrainingOptions)])
def test_the_sharding_flags_reach_the_options(module, options_class):
    parser = argparse.ArgumentParser()
    module.add_train_arguments(parser)
    required = ["--model", "m", "--data", "d", "--out", "o"]
    args = parser.parse_args([*required, "--fsdp", "2", "--ep", "2", "--ep-implementation", "dedup"])
    options = options_class(**trainer_options(args))
    assert (options.fsdp, options.ep, options.ep_implementation) == (2, 2, "dedup")
    with pytest.raises(SystemExit):  # argparse: not a registered EP implementation
        parser.parse_args([*required, "--ep-implementation", "nope"])

if __name__ == "__main__":
    run_scenarios(main, sys.argv[1:])
