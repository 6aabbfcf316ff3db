"""`--fsdp` / `--ep` through `moezoo.training.adapted_sharding` (the model loaded whole, adapted, then sharded), on
two gloo processes: MoEMB's LoRA recipe (PEFT adapters, the `<emb>` row, the expert adapters shared by a layer's
experts or one per expert) under FSDP2 and under EP, and with `--smoes` under FSDP2, MoTE's `--lora-r` and
`--add-expert` (a new expert) under FSDP2, MoE-ViE (its 0-d `logit_scale` kept whole) under FSDP2 and EP, and
MoE-ViE's video fine-tuning (its frozen teacher) with `--lora-r` (PEFT on attention, one expert adapter per expert)
under FSDP2 and EP give the losses and the final (merged) weights of one process on the same global batches; an
interrupted FSDP2 run resumes from its distributed checkpoint. Tiny models, two steps, one thread per process.

Run as a script, this file is the training command of every process: `torchrun ... test_distributed_adapters.py
ARCH MODEL OUT [--fsdp N] [--ep N] [--expert-lora MODE] [--smoes] [--add-expert] [--lora-r R] [--video] [--full
[--save-steps N] [--resume] [--stop-at STEP]]`, or `--scenarios PLAN DONE` (conftest's `Scenarios`): the runs of
`RUNS` and the interrupted runs share one launch, since starting the processes costs more than a tiny run, and the
resumptions share another.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoImageProcessor

from moezoo.configuration.mote import VideoLlmMoteConfig
from moezoo.modeling.moe_vie import MoeVieModel
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from moezoo.processors.mote import VideoLlmMoteFrameProcessor
from moezoo.training import moe_vie, moemb, mote
from moezoo.training.sharded_checkpoints import DISTRIBUTED_CHECKPOINT
from moezoo.training.moemb_synthetic import ShapeRetrieval
from moezoo.training.mote_synthetic import ProcedureVideos
from moezoo.training.synthetic import ColouredShapes

from conftest import Scenarios, free_port, resume_interrupted, run_python, run_scenarios
from test_distributed_training import (
    GLOBAL_BATCH,
    INTERRUPTED,
    LEARNING_RATE,
    STEPS,
    TRAINER_CLASSES,
    WORLD,
    assert_same_losses,
    assert_same_weights,
    interrupt_at,
    moe_vie_folder,  # noqa: F401 (a fixture)
    shapes_dataset,
)
from test_distributed_training import train as train_full

# Fixtures of the MoTE training tests: imported, pytest uses them in this module too (hence the noqa: F401 and F811).
from test_mote_training import procedure_videos, videollm_folder  # noqa: F401
from test_smoes_hosts import settings as smoes_settings

NEW_EXPERT = "proc"  # the expert MoTE's expert addition adds


def train(arch: str, model, out, batch_size: int, fsdp: int = 1, ep: int = 1, expert_lora: str = "shared",
          lora: bool = True, add_expert: bool = False, lora_r: int = 0, video: bool = False,
          smoes: bool = False) -> dict:  # fmt: skip
    """One run of the training command (`lora=False`: MoTE's joint training in full, as test_distributed_training's;
    `add_expert`: MoTE's expert addition of `NEW_EXPERT`, copied from the `next` expert, on its task's examples;
    `lora_r`, `video`: MoE-ViE's `--lora-r` and `--video`, which otherwise trains in full; `smoes`: MoEMB's
    `--smoes`, the tiny settings of tests/test_smoes_hosts.py)."""
    common = dict(steps=STEPS, batch_size=batch_size, learning_rate=LEARNING_RATE, logging_steps=1, fsdp=fsdp, ep=ep)
    if arch == "moe_vie" and (lora_r or video):
        shapes = ColouredShapes(image_size=16, colours=("red", "blue"), held_out=())
        # one frame per clip: the frame distilled is then the same however the batch is split over processes
        data = shapes.video_text_dataset(16, 1, torch.Generator().manual_seed(0)) if video else shapes_dataset()
        options = moe_vie.MoeVieTrainingOptions(**common, lora_r=lora_r, video=video, num_frames=1)
        return moe_vie.train_moe_vie(model, data, out, options)
    if arch == "moe_vie" or not lora:  # MoE-ViE: sharded after loading for its 0-d logit_scale
        return train_full(arch, model, out, batch_size, fsdp, ep)
    if arch == "moemb":
        data = ShapeRetrieval().training_dataset(16, torch.Generator().manual_seed(0))
        lora = moemb.LoraOptions(rank=2, alpha=4, dropout=0.0, experts=expert_lora)
        options = moemb.MoEmbTrainingOptions(**common, warmup_steps=0, lora=lora,
                                             smoes=smoes_settings() if smoes else None)  # fmt: skip
        return moemb.train_moemb(model, data, out, options)
    AutoImageProcessor.register(VideoLlmMoteConfig, image_processor_classes={"pil": VideoLlmMoteFrameProcessor},
                                exist_ok=True)  # fmt: skip
    if add_expert:
        data = ProcedureVideos().dataset({NEW_EXPERT: 8}, torch.Generator().manual_seed(0))
        options = mote.MoteTrainingOptions(**common, add_expert=NEW_EXPERT, init_from="next")
    else:
        data = ProcedureVideos().dataset({"step": 8, "next": 8}, torch.Generator().manual_seed(0))
        options = mote.MoteTrainingOptions(**common, lora_r=2)
    return mote.train_mote(model, data, out, options)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("arch")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--expert-lora", default="shared")
    parser.add_argument("--add-expert", action="store_true")
    parser.add_argument("--lora-r", type=int, default=0)
    parser.add_argument("--video", action="store_true")
    parser.add_argument("--smoes", action="store_true")
    parser.add_argument("--full", action="store_true",
                        help="train in full, as test_distributed_training's command (MoE-ViE does without it)")
    parser.add_argument("--save-steps", type=int, default=0, help="with --full")
    parser.add_argument("--resume", action="store_true", help="with --full")
    parser.add_argument("--stop-at", type=int, help="with --full: interrupt the run at this step, as Ctrl-C would")
    args = parser.parse_args(argv)
    if not args.full and (args.save_steps or args.resume or args.stop_at):
        parser.error("--save-steps, --resume and --stop-at go with --full")
    torch.set_num_threads(1)
    if not args.full:
        train(args.arch, args.model, args.out, GLOBAL_BATCH // WORLD, args.fsdp, args.ep, args.expert_lora,
              add_expert=args.add_expert, lora_r=args.lora_r, video=args.video, smoes=args.smoes)
        return
    try:
        with interrupt_at(TRAINER_CLASSES[args.arch], args.stop_at):
            train_full(args.arch, args.model, args.out, GLOBAL_BATCH // WORLD, args.fsdp, args.ep, args.save_steps,
                       args.resume)  # fmt: skip
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)


@pytest.fixture(scope="module")
def moemb_references(tiny_moemb, tmp_path_factory):
    """`(expert-adapter mode, smoes) -> (folder, losses)` of one process on the global batch, each trained once per
    module."""
    root, runs = tmp_path_factory.mktemp("moemb_references"), {}

    def reference(mode: str, smoes: bool):
        if (mode, smoes) not in runs:
            folder = root / f"{mode}-smoes-{smoes}"
            runs[mode, smoes] = folder, train("moemb", tiny_moemb, folder, GLOBAL_BATCH, expert_lora=mode, smoes=smoes)
        return runs[mode, smoes]

    return reference


# The runs on two processes that are not interrupted, by name: ARCH and the flags after ARCH MODEL OUT. One launch
# (`launched`) runs them all in turn.
RUNS = {
    "moemb-fsdp": ("moemb", "--fsdp", WORLD),
    # one expert adapter per layer: each process adds it to its own half of the experts
    "moemb-ep": ("moemb", "--ep", WORLD),
    # each process adapts its experts with their own adapters
    "moemb-ep-per-expert-adapters": ("moemb", "--ep", WORLD, "--expert-lora", "per-expert"),
    # SMoES's hooks on the language layers, attached before the sharding; its statistics summed over the processes
    "moemb-fsdp-smoes": ("moemb", "--fsdp", WORLD, "--smoes"),
    "mote-lora-fsdp": ("mote", "--fsdp", WORLD),
    "mote-expert-addition-fsdp": ("mote", "--fsdp", WORLD, "--add-expert"),
    "moe_vie-ep": ("moe_vie", "--ep", WORLD),
    "moe_vie-video-lora-fsdp": ("moe_vie", "--fsdp", WORLD, "--lora-r", 2, "--video"),
    "moe_vie-video-lora-ep": ("moe_vie", "--ep", WORLD, "--lora-r", 2, "--video"),
}
# The FSDP2 runs in full interrupted after their checkpoint at step 1 of 2, by architecture, then resumed: they run
# last in `launched`, as `interrupted-ARCH`, and their resumptions in a launch of their own (`resumed`).
INTERRUPTED_RUNS = ("moe_vie", "mote")
CHECKPOINTED = ("--full", "--fsdp", WORLD, "--save-steps", 1)


@pytest.fixture(scope="module")
def models(tiny_moemb, videollm_folder, moe_vie_even_experts):  # noqa: F811
    """The model folder of each architecture's runs (MoE-ViE: the 8-expert model)."""
    return {"moemb": tiny_moemb, "mote": videollm_folder, "moe_vie": moe_vie_even_experts}


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """Every run of `RUNS` in one launch of two processes, writing `ROOT/NAME`, then the interrupted runs."""
    root = tmp_path_factory.mktemp("launched")
    scenarios = {name: [arch, models[arch], root / name, *flags] for name, (arch, *flags) in RUNS.items()}
    for arch in INTERRUPTED_RUNS:
        name = f"interrupted-{arch}"
        scenarios[name] = [arch, models[arch], root / name, *CHECKPOINTED, "--stop-at", 2]
    return Scenarios(Path(__file__), scenarios, root, nproc=WORLD)


@pytest.fixture(scope="module")
def resumed(models, launched):
    """The interrupted runs of `launched` resumed, in one launch: `interrupted-ARCH-resumed`."""
    return resume_interrupted(launched, {
        f"interrupted-{arch}": [arch, models[arch], launched.root / f"interrupted-{arch}-resumed", *CHECKPOINTED,
                                "--resume"]  # fmt: skip
        for arch in INTERRUPTED_RUNS
    })


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp", "ep", "ep-per-expert-adapters", "fsdp-smoes"])
def test_moemb_lora_recipe_sharded_trains_as_one_process(case, moemb_references, launched):
    flags = RUNS[f"moemb-{case}"]
    folder, losses = moemb_references("per-expert" if "per-expert" in flags else "shared", "--smoes" in flags)
    out = launched.check(f"moemb-{case}")
    assert_same_weights(out, folder)
    assert_same_losses(out, losses)


@pytest.mark.slow
def test_mote_lora_under_fsdp_trains_as_one_process(videollm_folder, launched, tmp_path):  # noqa: F811
    reference = train("mote", videollm_folder, tmp_path / "one", GLOBAL_BATCH)
    fsdp = launched.check("mote-lora-fsdp")
    assert_same_weights(fsdp, tmp_path / "one")
    assert_same_losses(fsdp, reference)


@pytest.mark.slow
def test_mote_expert_addition_under_fsdp_trains_as_one_process(videollm_folder, launched, tmp_path):  # noqa: F811
    """The new expert is added before the sharding (`adapted_sharding`), so FSDP2 shards it with its layer; every
    process trains its route at every step. The losses and weights are those of one process, the new expert trained
    and every other weight unchanged (frozen), and the saved folder loads with the new expert."""
    reference = train("mote", videollm_folder, tmp_path / "one", GLOBAL_BATCH, add_expert=True)
    fsdp = launched.check("mote-expert-addition-fsdp")
    assert_same_weights(fsdp, tmp_path / "one")
    assert_same_losses(fsdp, reference)
    model = VideoLlmMoteForConditionalGeneration.from_pretrained(fsdp)
    assert model.config.text_config.mote_expert_names[-1] == NEW_EXPERT
    initial = load_file(videollm_folder / "model.safetensors")
    trained = load_file(fsdp / "model.safetensors")
    new = [name for name in trained if f".experts.{NEW_EXPERT}." in name]
    assert new and all(not torch.equal(trained[name], initial[name.replace(NEW_EXPERT, "next")]) for name in new)
    assert all(torch.equal(trained[name], tensor) for name, tensor in initial.items())


@pytest.fixture(scope="module")
def moe_vie_even_experts(moe_vie_folder, tmp_path_factory):  # noqa: F811
    """The tiny MoE-ViE with 8 routed experts per MoE layer instead of 7, so that they split over two processes."""
    folder = tmp_path_factory.mktemp("moe_vie_8") / "model"
    shutil.copytree(moe_vie_folder, folder)
    config = MoeVieModel.config_class.from_pretrained(folder)
    config.vision_config.n_routed_experts = 8
    torch.manual_seed(0)
    MoeVieModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_vie_reference(moe_vie_even_experts, tmp_path_factory):
    """One process on the global batch (trained once per module): its folder and losses."""
    folder = tmp_path_factory.mktemp("moe_vie_reference") / "one"
    return folder, train("moe_vie", moe_vie_even_experts, folder, GLOBAL_BATCH)


@pytest.mark.slow
def test_moe_vie_under_expert_parallelism_trains_as_one_process(moe_vie_even_experts, moe_vie_reference, launched):
    """The 0-d logit_scale, which FSDP2 cannot shard, stays whole on every process and trains as the rest does.
    (Under --fsdp alone: the resume test below ends with one process's weights.)"""
    folder, losses = moe_vie_reference
    out = launched.check("moe_vie-ep")
    assert_same_weights(out, folder)
    assert_same_losses(out, losses)
    initial = load_file(moe_vie_even_experts / "model.safetensors")["logit_scale"]
    assert load_file(out / "model.safetensors")["logit_scale"] != initial  # trained, not left out


@pytest.fixture(scope="module")
def moe_vie_video_lora_reference(moe_vie_even_experts, tmp_path_factory):
    """Video fine-tuning with `--lora-r 2` on one process on the global batch (trained once per module): its folder
    and losses."""
    folder = tmp_path_factory.mktemp("moe_vie_video_lora_reference") / "one"
    return folder, train("moe_vie", moe_vie_even_experts, folder, GLOBAL_BATCH, lora_r=2, video=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp", "ep"])
def test_moe_vie_video_lora_sharded_trains_as_one_process(case, moe_vie_even_experts, moe_vie_video_lora_reference,
                                                          launched):  # fmt: skip
    """`--video --lora-r`: the distillation teacher is copied and the adapters are attached before the sharding:
    PEFT's on attention, and one per expert on the fused experts (`expert_lora`), which under EP each process adds to
    its own half of the experts; the teacher stays whole under FSDP2, and under EP runs its half of the experts on
    every process. The merged folder loads."""
    folder, losses = moe_vie_video_lora_reference
    out = launched.check(f"moe_vie-video-lora-{case}")
    assert_same_weights(out, folder)
    assert_same_losses(out, losses)
    merged = load_file(out / "model.safetensors")
    base = load_file(moe_vie_even_experts / "model.safetensors")
    assert merged.keys() == base.keys()  # merged: no adapter left
    assert any(not torch.equal(merged[name], base[name]) for name in base if ".experts." in name)
    MoeVieModel.from_pretrained(out)


@pytest.mark.slow
@pytest.mark.parametrize("arch", INTERRUPTED_RUNS)
def test_a_sharded_run_resumes_from_its_distributed_checkpoint(arch, moe_vie_reference, videollm_folder,  # noqa: F811
                                                               launched, resumed, tmp_path):  # fmt: skip
    """Stopped after its checkpoint at step 1 of 2 and resumed with the same launch, an FSDP2 run ends with the
    weights of one uninterrupted process: MoE-ViE, sharded after loading (its logit_scale whole), and MoTE, sharded
    while loading, whose experts of a route not drawn before the checkpoint have no optimizer state there. MoE-ViE's
    saved folder loads in a fresh process."""
    if arch == "moe_vie":
        reference = moe_vie_reference[0]
    else:
        reference = tmp_path / "one"
        train(arch, videollm_folder, reference, GLOBAL_BATCH, lora=False)
    stopped = launched.check(f"interrupted-{arch}", exit_status=INTERRUPTED)
    assert not stopped.exists()
    checkpoint = stopped.with_name(f"{stopped.name}.checkpoints") / "checkpoint-1"
    assert (checkpoint / DISTRIBUTED_CHECKPOINT / ".metadata").is_file() and (checkpoint / "scheduler.pt").is_file()
    out = resumed.check(f"interrupted-{arch}-resumed")
    assert not out.with_name(f"{out.name}.checkpoints").exists()
    assert_same_weights(out, reference)
    if arch == "mote":
        return
    run_python(f"""
        import torch
        from safetensors.torch import load_file
        from moezoo.modeling.moe_vie import MoeVieModel
        model = MoeVieModel.from_pretrained({str(out)!r})
        saved = load_file({str(out / "model.safetensors")!r})
        assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())
    """)


def test_mote_refuses_expert_parallelism_saying_why(videollm_folder, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))  # as torchrun sets it; the refusal comes before any collective
    with pytest.raises(ValueError, match=rf"--ep {WORLD}: MoTE's task experts are whole FFNs .* --fsdp {WORLD} inst"):
        mote.train_mote(videollm_folder, ProcedureVideos().dataset({"step": 4}, torch.Generator()), tmp_path / "out",
                        mote.MoteTrainingOptions(steps=1, batch_size=1, ep=WORLD))  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_accelerate_launch_trains_as_torchrun(moe_vie_even_experts, tmp_path):
    """`accelerate launch --multi_gpu` starts its processes through torchrun, on CPUs too (gloo; its `--cpu` switch
    would start one process): the FSDP2 command it launches writes the weights and losses of the torchrun launch."""
    ColouredShapes(image_size=16, colours=("red", "blue"), held_out=()).image_text_dataset(
        16, torch.Generator().manual_seed(0)).to_parquet(tmp_path / "shapes.parquet")  # fmt: skip
    command = ["-m", "moezoo", "train", "moe_vie", "--model", str(moe_vie_even_experts), "--data",
               str(tmp_path / "shapes.parquet"), "--steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH // WORLD),
               "--lr", str(LEARNING_RATE), "--logging-steps", "1", "--fsdp", str(WORLD)]  # fmt: skip
    launches = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                     "--master_addr", "127.0.0.1", "--master_port", str(free_port())],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                       str(WORLD), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())],
    }  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for name, launch in launches.items():
        result = subprocess.run([*launch, *command, "--out", str(tmp_path / name)], env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(tmp_path / "accelerate", tmp_path / "torchrun")
    torchrun = json.loads((tmp_path / "torchrun" / "moezoo.json").read_text())["training"]
    assert_same_losses(tmp_path / "accelerate", torchrun)


if __name__ == "__main__":
    run_scenarios(main, sys.argv[1:])
