"""`moezoo train ARCH` on two gloo processes: DDP (a plain distributed launch, all three architectures) and FSDP2
(`--fsdp 2`, MoTE) give the loss and the weights of one process on the same global batch; the saved folder loads in a
fresh process; `--resume` continues a DDP run; MoEMB's model under the EP plan the core derives (`ep_size=2`) gives
the loss and gradients of one process; what cannot run distributed is refused before loading. Tiny models, two
steps, one thread per process.

Run as a script, this file is the training command of every process: `torchrun ... test_distributed_training.py ARCH
MODEL OUT [--fsdp N] [--ep N] [--save-steps N] [--resume] [--stop-at STEP]` (or `expert-parallel-moemb MODEL`), or
`--scenarios PLAN DONE` (conftest's `Scenarios`): the runs of `RUNS`, the interrupted run and the EP check share one
launch, since starting the processes costs more than a tiny run; the resumption has another.
"""

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoImageProcessor

from moezoo.configuration.mote import VideoLlmMoteConfig
from moezoo.processors.mote import VideoLlmMoteFrameProcessor
from moezoo.training import moe_vie, moemb, mote
from moezoo.training.moemb_synthetic import ShapeRetrieval
from moezoo.training.mote_synthetic import ProcedureVideos
from moezoo.training.synthetic import ColouredShapes

from conftest import Scenarios, resume_interrupted, run_processes, run_python, run_scenarios

# Fixtures of the MoTE training tests: imported, pytest uses them in this module too (hence the noqa: F401 and F811).
from test_mote_training import procedure_videos, videollm_folder  # noqa: F401

STEPS, GLOBAL_BATCH, LEARNING_RATE = 2, 4, 1e-3
WORLD = 2
# Summed in another order, a gradient differs in its last bits; Adam divides it by its own magnitude, so where a
# gradient is almost zero that rounding moves a weight by up to ~learning rate per step. 1e-4 tolerates it, and is
# still far below what a wrong batch or an unsynchronised gradient changes (the learning rate itself).
WEIGHT_ATOL = 1e-4
# The exit status of a run that `interrupt_at` stopped, as a scenario of a launch marks it (conftest's `Scenarios`).
INTERRUPTED = 3


def shapes_dataset():
    return ColouredShapes(image_size=16, colours=("red", "blue"), held_out=()).image_text_dataset(
        16, torch.Generator().manual_seed(0))


def train(arch: str, model, out, batch_size: int, fsdp: int = 1, ep: int = 1, save_steps: int = 0,
          resume: bool = False) -> dict:
    """One run of `moezoo train ARCH`, deterministic: fixed data, no dropout, the same seed everywhere."""
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, fsdp=fsdp, ep=ep,
                  save_steps=save_steps, resume=resume)  # fmt: skip
    if arch == "moe_vie":
        return moe_vie.train_moe_vie(model, shapes_dataset(), out, moe_vie.MoeVieTrainingOptions(**common))
    if arch == "moemb":
        data = ShapeRetrieval().training_dataset(16, torch.Generator().manual_seed(0))
        lora = moemb.LoraOptions(rank=2, alpha=4, dropout=0.0)
        return moemb.train_moemb(model, data, out, moemb.MoEmbTrainingOptions(**common, warmup_steps=0, lora=lora))
    # VideoLLM-MoTE: its frame processor is known to AutoImageProcessor once registered
    AutoImageProcessor.register(VideoLlmMoteConfig, image_processor_classes={"pil": VideoLlmMoteFrameProcessor},
                                exist_ok=True)  # fmt: skip
    data = ProcedureVideos().dataset({"step": 8, "next": 8}, torch.Generator().manual_seed(0))
    return mote.train_mote(model, data, out, mote.MoteTrainingOptions(**common))


TRAINER_CLASSES = {"moe_vie": moe_vie.MoeVieTrainer, "moemb": moemb.MoEmbTrainer, "mote": mote.MoteTrainer}
# The script's first argument that runs `check_expert_parallel_moemb` instead of a training run.
EXPERT_PARALLEL_CHECK = "expert-parallel-moemb"


def main(argv: list[str]) -> None:
    if argv[:1] == [EXPERT_PARALLEL_CHECK]:
        check_expert_parallel_moemb(argv[1])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("arch")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-at", type=int, help="interrupt the run at this optimizer step, as Ctrl-C would")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        with interrupt_at(TRAINER_CLASSES[args.arch], args.stop_at):
            train(args.arch, args.model, args.out, GLOBAL_BATCH // WORLD, args.fsdp, args.ep, args.save_steps,
                  args.resume)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)


@contextmanager
def interrupt_at(trainer_class, step: int | None):
    """Within the block, make `trainer_class` raise KeyboardInterrupt at its `step`-th training step, as Ctrl-C
    would (no `step`: leave it alone). Undone after the block, for the next scenario of a launch."""
    if not step:
        yield
        return
    training_step, own, calls = trainer_class.training_step, trainer_class.__dict__.get("training_step"), []

    def interrupted_training_step(self, *step_args, **step_kwargs):
        calls.append(None)
        if len(calls) == step:
            raise KeyboardInterrupt
        return training_step(self, *step_args, **step_kwargs)

    trainer_class.training_step = interrupted_training_step
    try:
        yield
    finally:
        if own is None:  # inherited
            del trainer_class.training_step
        else:
            trainer_class.training_step = own


def assert_same_weights(folder, reference) -> None:
    weights, expected = load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors")
    # FSDP2's gathered state dict also writes tied weights (the tied lm_head): the reference's keys must all be there
    assert expected.keys() <= weights.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


def assert_same_losses(folder, reference: dict) -> None:
    """The loss summary of the run that wrote `folder` (rounded to 4 decimals) is the reference run's."""
    training = json.loads((folder / "moezoo.json").read_text())["training"]
    for key in ("initial_loss", "final_loss", "mean_loss"):
        assert training[key] == pytest.approx(reference[key], abs=2e-4), key


@pytest.fixture(scope="module")
def moe_vie_folder(tmp_path_factory):
    from moezoo.zoo import create_from_preset

    return create_from_preset("tiny-moe_vie", tmp_path_factory.mktemp("moe_vie") / "model", seed=0)


@pytest.fixture(scope="module")
def folders(moe_vie_folder, tiny_moemb, videollm_folder):  # noqa: F811
    return {"moe_vie": moe_vie_folder, "moemb": tiny_moemb, "mote": videollm_folder}


# The runs on two processes that are not interrupted, by name: ARCH and the flags after ARCH MODEL OUT. One launch
# (`launched`) runs them all in turn.
RUNS = {
    "ddp-moe_vie": ("moe_vie",),
    "ddp-moemb": ("moemb",),
    "ddp-mote": ("mote",),
    "fsdp-mote": ("mote", "--fsdp", WORLD),
}
# MoE-ViE's DDP run checkpointing every step: interrupted at step 2 of 2 last in `launched`, resumed in a launch of
# its own (`resumed`).
CHECKPOINTED = ("moe_vie", "--save-steps", 1)


@pytest.fixture(scope="module")
def launched(folders, tmp_path_factory):
    """Every run of `RUNS` in one launch of two processes, writing `ROOT/NAME`, then the interrupted run and
    `check_expert_parallel_moemb`."""
    root = tmp_path_factory.mktemp("launched")
    scenarios = {name: [arch, folders[arch], root / name, *flags] for name, (arch, *flags) in RUNS.items()}
    arch, *flags = CHECKPOINTED
    scenarios["interrupted"] = [arch, folders[arch], root / "interrupted", *flags, "--stop-at", 2]
    scenarios[EXPERT_PARALLEL_CHECK] = [EXPERT_PARALLEL_CHECK, folders["moemb"]]
    return Scenarios(Path(__file__), scenarios, root, nproc=WORLD)


@pytest.fixture(scope="module")
def resumed(folders, launched):
    """The interrupted run of `launched` resumed: `interrupted-resumed`."""
    arch, *flags = CHECKPOINTED
    return resume_interrupted(launched, {
        "interrupted": [arch, folders[arch], launched.root / "interrupted-resumed", *flags, "--resume"],
    })


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["moe_vie", "moemb", "mote"])
def test_ddp_trains_as_one_process_on_the_global_batch(arch, folders, launched, tmp_path):
    reference = train(arch, folders[arch], tmp_path / "one", GLOBAL_BATCH)
    ddp = launched.check(f"ddp-{arch}")
    assert not ddp.with_name(f"{ddp.name}.checkpoints").exists()
    assert_same_weights(ddp, tmp_path / "one")
    assert_same_losses(ddp, reference)


@pytest.mark.slow
def test_fsdp_trains_as_one_process_and_its_folder_loads_in_a_fresh_process(videollm_folder, launched,  # noqa: F811
                                                                            tmp_path):  # fmt: skip
    """MoTE, whose task experts are whole FFNs chosen per example: FSDP2 shards every layer, experts included."""
    reference = train("mote", videollm_folder, tmp_path / "one", GLOBAL_BATCH)
    fsdp = launched.check("fsdp-mote")
    assert_same_weights(fsdp, tmp_path / "one")
    assert_same_losses(fsdp, reference)
    run_python(f"""
        import torch
        from safetensors.torch import load_file
        from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
        model = VideoLlmMoteForConditionalGeneration.from_pretrained({str(fsdp)!r})
        saved = load_file({str(fsdp / "model.safetensors")!r})
        assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())
        assert model.lm_head.weight is model.get_input_embeddings().weight  # tied again
    """)


@pytest.mark.slow
def test_a_ddp_run_resumes_from_its_checkpoint(launched, resumed):
    """Stopped after its checkpoint at step 1 of 2 and resumed, it ends with the weights of an uninterrupted run (the
    DDP run of `RUNS`)."""
    uninterrupted = launched.check("ddp-moe_vie")
    stopped = launched.check("interrupted", exit_status=INTERRUPTED)
    assert not stopped.exists()
    assert [path.name for path in stopped.with_name("interrupted.checkpoints").iterdir()] == ["checkpoint-1"]
    out = resumed.check("interrupted-resumed")
    assert not out.with_name(f"{out.name}.checkpoints").exists()
    assert_same_weights(out, uninterrupted)


def test_checkpoints_of_a_sharded_run_are_refused_where_the_trainer_cannot_write_them(monkeypatch):
    """A trainer without `ShardedCheckpointsMixin` hands its --save-steps to `load_for_training`: transformers'
    Trainer alone cannot checkpoint the optimizer state of a model sharded at load, so they are refused before
    loading. (The moe_vie, moemb and mote trainers write them: tests/test_distributed_adapters.py resumes one.)"""
    from moezoo.training.distributed import distributed_config

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))  # as torchrun sets it; the refusal comes before any collective
    with pytest.raises(ValueError, match="--save-steps 1 with --fsdp / --ep: .* cannot be resumed"):
        distributed_config(WORLD, 1, save_steps=1)


def check_expert_parallel_moemb(folder) -> None:
    """On every process of a launch: MoEMB's model at `folder` under the EP plan the core derives (`ep_size=WORLD`)
    computes the loss of one process on this process's batch, and the gradients of one process on both batches."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    from moezoo.modeling.moemb import MoEmbForEmbedding

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    reference = MoEmbForEmbedding.from_pretrained(folder)
    input_ids = torch.randint(0, 100, (WORLD, 2, 6), generator=generator)  # one batch of 2 sequences per process
    input_ids[..., -1] = reference.config.emb_token_id  # the token MoEMB pools

    def loss_of(model, ids):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).embeddings.pow(2).sum(-1).mean()

    reference_losses = [loss_of(reference, ids) for ids in input_ids]
    torch.stack(reference_losses).mean().backward()

    config = DistributedConfig(fsdp_size=WORLD, ep_size=WORLD)
    model = MoEmbForEmbedding.from_pretrained(folder, distributed_config=config)
    rank = torch.distributed.get_rank()
    experts = model.model.language_model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, DTensor)
    assert experts.num_experts == reference.config.text_config.num_experts // WORLD
    loss = loss_of(model, input_ids[rank])
    loss.backward()
    torch.testing.assert_close(loss, reference_losses[rank], rtol=0, atol=1e-6)
    for name, parameter in model.named_parameters():
        gradient = parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad
        expected = reference.get_parameter(name).grad
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.slow
def test_expert_parallel_moemb_computes_the_loss_and_gradients_of_one_process(launched):
    """The EP plan the core derives for MoEMB's `SparseMoeBlock`s: each process holds half of every layer's experts
    (a contiguous range), tokens reach them through transformers' all-to-all, and the loss and every gradient
    (gathered) are those of one process on both batches (`check_expert_parallel_moemb`, the last scenario of
    `launched`)."""
    launched.check(EXPERT_PARALLEL_CHECK)


def test_sharding_flags_need_a_distributed_launch(moe_vie_folder, tmp_path):
    options = moe_vie.MoeVieTrainingOptions(steps=1, batch_size=2, fsdp=2)
    with pytest.raises(ValueError, match=r"--fsdp 2 .* this is a single process: launch the command with `torchrun"):
        moe_vie.train_moe_vie(moe_vie_folder, shapes_dataset(), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_what_cannot_be_sharded_is_refused_before_loading(moe_vie_folder, tiny_moemb, videollm_folder):  # noqa: F811
    from moezoo.modeling.moe_vie import MoeVieModel
    from moezoo.modeling.moemb import MoEmbForEmbedding
    from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
    from moezoo.training.distributed import check_shardable

    with pytest.raises(ValueError, match=r"0-d parameters \(logit_scale\), which FSDP2 cannot shard"):
        check_shardable(MoeVieModel, MoeVieModel.config_class.from_pretrained(moe_vie_folder), ep=1)
    mote_config = VideoLlmMoteConfig.from_pretrained(videollm_folder)
    with pytest.raises(ValueError, match="has no routed experts to distribute"):
        check_shardable(VideoLlmMoteForConditionalGeneration, mote_config, ep=2)
    dense = MoeVieModel.config_class.from_pretrained(moe_vie_folder)
    dense.vision_config.moe_layers = []  # a dense vision tower: no MoE layer
    with pytest.raises(ValueError, match=r"--ep 2: MoeVieModel has no routed experts .* train it with --fsdp or plain"):
        check_shardable(MoeVieModel, dense, ep=2, replicated_scalars=True)
    moemb_config = MoEmbForEmbedding.config_class.from_pretrained(tiny_moemb)
    num_experts = moemb_config.text_config.num_experts
    check_shardable(MoEmbForEmbedding, moemb_config, ep=num_experts)
    with pytest.raises(ValueError, match=rf"\({num_experts}\) do not split evenly over {num_experts + 1} processes"):
        check_shardable(MoEmbForEmbedding, moemb_config, ep=num_experts + 1)


def test_sizes_and_data_that_do_not_fit_the_launch_are_refused(monkeypatch):
    from moezoo.training.distributed import check_enough_examples, distributed_config

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))  # as torchrun sets it; the checks come before any collective
    for fsdp, ep in ((WORLD + 1, 1), (WORLD, WORLD + 1)):
        with pytest.raises(ValueError, match=rf"--fsdp {fsdp} --ep {ep} does not fit the {WORLD} processes of this "
                                             rf"launch: --fsdp must equal the number of processes \({WORLD}\)"):
            distributed_config(fsdp, ep)
    assert distributed_config(1, WORLD).ep_size == WORLD  # --ep alone shards the rest with FSDP2 over every process
    check_enough_examples(2 * WORLD, 2)
    with pytest.raises(ValueError, match=rf"the data set has 3 examples, fewer than one batch of 2 on each of {WORLD} "
                                         "processes"):
        check_enough_examples(3, 2)


def test_recipes_sharded_after_loading_refuse_uneven_experts_before_reading_a_weight(moe_vie_folder, monkeypatch):
    """`adapted_sharding` loads the whole model before sharding it: the EP check comes first, as for a sharded load.
    (The tiny MoE-ViE has 7 experts per MoE layer.)"""
    from moezoo.modeling.moe_vie import MoeVieModel
    from moezoo.training.adapted_sharding import load_adapted_for_training

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))  # as torchrun sets it; the check comes before any collective

    def read_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the check")

    monkeypatch.setattr(MoeVieModel, "from_pretrained", read_weights)
    with pytest.raises(ValueError, match=rf"\(7\) do not split evenly over {WORLD} processes"):
        load_adapted_for_training(MoeVieModel, moe_vie_folder, None, ep=WORLD)


@pytest.mark.slow
def test_processes_loading_different_dtypes_fail_at_the_start(tmp_path):
    script = tmp_path / "dtypes.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from moezoo.training.distributed import check_same_dtype_everywhere\n"
        "dist.init_process_group('gloo')\n"
        "check_same_dtype_everywhere(torch.float32 if dist.get_rank() == 0 else torch.bfloat16)\n"
    )
    result = run_processes(script, nproc=WORLD, check=False)
    assert result.returncode != 0
    assert "load the model in different dtypes (torch.float32, torch.bfloat16, by rank)" in result.stderr


if __name__ == "__main__":
    run_scenarios(main, sys.argv[1:])
