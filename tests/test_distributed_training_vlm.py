"""`moezoo train omnimoe_vl` and `moezoo train smoes` on two gloo processes: DDP, FSDP2 (`--fsdp 2`) and expert
parallelism (`--ep 2`, SMoES also with moezoo's `--ep-implementation dedup`) give the logged losses and the final
weights of one process on the same global batch; LoRA under sharding is refused before loading. The token experts'
load-balancing loss (`router_aux_loss_coef`) is computed on each process's batch, as transformers does, so the
OmniMoE-VL model is compared without it. Tiny models, two steps, one thread per
process; the helpers are those of tests/test_distributed_training.py.

Run as a script, this file is the training command of every process: `torchrun ... test_distributed_training_vlm.py
ARCH MODEL DATA OUT [--stage S] [--fsdp N] [--ep N] [--ep-implementation NAME]`.
"""

import argparse
import json
import sys
from dataclasses import replace

import pytest
import torch
from transformers.distributed.expert_parallel import EPImplementationInterface

from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from moezoo.training import omnimoe_vl, smoes
from moezoo.training.arguments import trainer_options
from moezoo.training.distributed import check_shardable
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

from test_distributed_training import (
    GLOBAL_BATCH,
    LEARNING_RATE,
    STEPS,
    WORLD,
    assert_same_losses,
    assert_same_weights,
    run_processes,
)
from test_omnimoe_vl_training import QUESTIONS, image


# Answers of one length (3 tokens each), as the captions of `write_shape_captions` (6): the language-model loss, a
# mean over each process's answer tokens, then averages over the processes to the loss of the global batch.
ANSWERS = ("red", "yes", "two", "one")


def train(arch: str, model, data, out, batch_size: int, stage: str = "I", **sharding) -> dict:
    """One run of `moezoo train ARCH`, deterministic: fixed data, no dropout, the same seed everywhere."""
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, **sharding)
    if arch == "omnimoe_vl":
        options = omnimoe_vl.OmniMoeVlTrainingOptions(**common, stage=stage)
        return omnimoe_vl.train_omnimoe_vl(model, data, out, options)
    return smoes.train_smoes(model, data, out, smoes.SmoesTrainingOptions(**common))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("arch", "model", "data", "out"):
        parser.add_argument(name)
    parser.add_argument("--stage", default="I")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--ep-implementation", default="auto")
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
    train(args.arch, args.model, args.data, args.out, GLOBAL_BATCH // WORLD, args.stage, fsdp=args.fsdp, ep=args.ep,
          ep_implementation=args.ep_implementation)
    assert bool(dispatches) == (args.ep > 1), f"{name}: {len(dispatches)} dispatches"


def run_distributed(arch: str, folders, out, *flags):
    return run_processes(__file__, arch, *folders[arch], out, *flags, nproc=WORLD, timeout=300)


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
    """`(arch, stage) -> (folder, training summary)` of the one-process run on the global batch, each run once."""
    runs = {}

    def run(arch: str, stage: str):
        if (arch, stage) not in runs:
            out = tmp_path_factory.mktemp(f"{arch}-{stage}") / "one"
            runs[arch, stage] = out, train(arch, *folders[arch], out, GLOBAL_BATCH, stage)
        return runs[arch, stage]

    return run


def check_same_as_one_process(arch: str, folders, one_process, tmp_path, *flags, stage: str = "I") -> None:
    reference, summary = one_process(arch, stage)
    run_distributed(arch, folders, tmp_path / "many", "--stage", stage, *flags)
    assert_same_weights(tmp_path / "many", reference)
    assert_same_losses(tmp_path / "many", summary)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "stage"), [("omnimoe_vl", "I"), ("omnimoe_vl", "IV"), ("smoes", "I")],
                         ids=["omnimoe_vl-stage-I", "omnimoe_vl-stage-IV", "smoes"])
def test_ddp_trains_as_one_process_on_the_global_batch(arch, stage, folders, one_process, tmp_path):
    """OmniMoE-VL's Stage I (the projector) and Stage IV (everything: both stacks' experts and routers too)."""
    check_same_as_one_process(arch, folders, one_process, tmp_path, stage=stage)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--fsdp", WORLD), ("--ep", WORLD), ("--ep", WORLD, "--ep-implementation", "dedup")],
                         ids=["fsdp", "ep", "ep-dedup"])
def test_sharded_smoes_trains_as_one_process(flags, folders, one_process, tmp_path):
    """SMoES trained in full (routers included): FSDP2 shards every layer; EP gives each process half of every
    layer's experts, reached by transformers' all-to-all or by moezoo's dedup EP (one copy of a token per process
    holding any of its experts)."""
    check_same_as_one_process("smoes", folders, one_process, tmp_path, *map(str, flags))


@pytest.mark.parametrize("arch", ["omnimoe_vl", "smoes"])
def test_lora_under_sharding_is_refused_before_loading(arch, folders, tmp_path, monkeypatch):
    """LoRA adds its adapters after transformers has sharded the model in `from_pretrained`: they would be neither
    sharded nor synchronised. Trained in full, the same run shards (SMoES above)."""
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))  # as torchrun sets it; the refusal comes before any collective
    options = dict(steps=1, batch_size=1, fsdp=WORLD, lora_r=2)
    with pytest.raises(ValueError, match="--fsdp / --ep shard the model while it loads, and --lora 2 adds LoRA "
                                         "adapters after that; train this recipe with plain DDP"):  # fmt: skip
        if arch == "omnimoe_vl":
            omnimoe_vl.train_omnimoe_vl(*folders[arch], tmp_path / "out",
                                        omnimoe_vl.OmniMoeVlTrainingOptions(**options, stage="II"))
        else:
            smoes.train_smoes(*folders[arch], tmp_path / "out", smoes.SmoesTrainingOptions(**options))
    assert not (tmp_path / "out").exists()


def test_omnimoe_vl_sharding_is_refused_for_its_0d_parameter(folders):
    """FSDP2 shards every parameter on dim 0: the projector's scalar `fusion_output_scale` keeps OmniMoE-VL on DDP."""
    config = OmniMoeVlForConditionalGeneration.config_class.from_pretrained(folders["omnimoe_vl"][0])
    for ep in (1, WORLD):
        with pytest.raises(ValueError, match=r"0-d parameters \(model.projector.fusion_output_scale\), which FSDP2 "
                                             "cannot shard; train it with plain DDP"):  # fmt: skip
            check_shardable(OmniMoeVlForConditionalGeneration, config, ep)


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
    main(sys.argv[1:])
