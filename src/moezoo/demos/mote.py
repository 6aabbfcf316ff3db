"""Demo stage: MoTE on synthetic procedure videos.

A tiny VideoLLM (random SigLIP tower, projector and Llama decoder) learns three tasks about short clips of "procedure
videos" made in-house (`training/mote_synthetic.py`): name the step shown, forecast the next step, name the procedure,
with the paper's prompts. Two models start from the same dense weights and train on the same examples for the same
number of steps (batch size, learning rate), the vision tower frozen and the whole decoder trained (the base is
random, so the paper's LoRA recipe, made to preserve a pretrained decoder, has nothing to preserve here):

- the dense model: the matched dense baseline (`dense=True`: no task experts, the base's FFNs, every task on one
  path);
- its MoTE conversion: one expert per task plus a shared expert, every route equal to the dense model at first.

Then procedure forecasting (`proc`, the numbered list of the remaining steps) is added as a new expert, copied from
`next`, and trained alone: the three old routes keep bit-identical outputs, by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

from ..configuration.mote import DEFAULT_EXPERT_DESCRIPTIONS, TINY_LLAMA, TINY_SIGLIP_VISION, TINY_VIDEOLLM_MOTE
from ..conversion.mote_llama import convert_llama_to_mote
from ..processors.build_mote import make_videollm_mote_processor
from ..terminal import console, print_table
from ..training.mote import MoteTrainingOptions, load_mote_model, train_mote
from ..training.mote_synthetic import PROCEDURES, ProcedureVideos


JOINT_TASKS = ("step", "next", "task")
NEW_TASK, NEW_TASK_FROM = "proc", "next"
# Unequal task buckets, as in COIN: the bucketed sampler keeps their proportions.
TRAIN_COUNTS = {"step": 480, "next": 320, "task": 240}
NEW_TASK_COUNT = 320
TEST_COUNT = 48  # per task


def build_base(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """The dense checkpoints converted from: a tiny Llama decoder and a tiny SigLIP vision tower (random)."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder / "llama")
    SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP_VISION)).save_pretrained(folder / "siglip")
    return folder / "llama", folder / "siglip"


def convert(llama: Path, siglip: Path, out: Path, words: tuple[str, ...], **options) -> dict:
    """Convert the base into VideoLLM-MoTE with `options` (experts, ...) and save it with its processor."""
    ids = {key: TINY_VIDEOLLM_MOTE[key] for key in ("video_token", "video_token_id", "frame_token_interval_id")}
    model, report = convert_llama_to_mote(llama, vision=siglip, **ids, **options)
    model.save_pretrained(out)
    make_videollm_mote_processor(model.config, words=words).save_pretrained(out)
    return report


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


@torch.no_grad()
def task_accuracy(folder: Path, test, tasks: tuple[str, ...]) -> dict[str, float]:
    """Greedy answers to each task's test examples, exact match after lower-casing and whitespace folding; each task
    runs on its own route (the dense model has one path for all)."""
    model, processor = load_mote_model(folder)
    model.eval()
    accuracy = {}
    for task in tasks:
        rows = test.filter(lambda name: name == task, input_columns="task")
        inputs = processor(
            text=[processor.render_prompt(prompt) for prompt in rows["prompt"]], videos=list(rows["frames"]),
            task=task, padding=True, padding_side="left", return_tensors="pt",
        )  # fmt: skip
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        answers = processor.tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct = [normalise(answer) == normalise(target) for answer, target in zip(answers, rows["answer"])]
        accuracy[task] = sum(correct) / len(correct)
    return accuracy


@torch.no_grad()
def route_logits(folder: Path, test, tasks: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The logits of a few test prompts of every task on its route: what must not change when an expert is added."""
    model, processor = load_mote_model(folder)
    model.eval()
    rows = test.select(range(8))
    logits = {}
    for task in tasks:
        inputs = processor(text=[processor.render_prompt(p) for p in rows["prompt"]], videos=list(rows["frames"]),
                           task=task, padding=True, return_tensors="pt")
        logits[task] = model(**inputs).logits
    return logits


def save_clip_strip(data: ProcedureVideos, path: Path) -> Path:
    """One clip of every procedure (its first two steps), a labelled row of frames each."""
    generator = torch.Generator().manual_seed(0)
    size, label_width = data.frame_size * 3, 150  # frames enlarged for viewing
    rows = [(f"{procedure}: {', '.join(PROCEDURES[procedure][:2])}",
             data.example("step", procedure, 0, generator)["frames"]) for procedure in PROCEDURES]
    strip = Image.new("RGB", (label_width + size * len(rows[0][1]), size * len(rows)), "white")
    draw = ImageDraw.Draw(strip)
    for row, (label, frames) in enumerate(rows):
        draw.text((6, row * size + size // 2 - 6), label, fill="black")
        for column, frame in enumerate(frames):
            strip.paste(frame.resize((size, size), Image.Resampling.NEAREST), (label_width + column * size, row * size))
    strip.save(path)
    return path


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = ProcedureVideos()
    strip = save_clip_strip(data, out_dir / "procedure_clips.png")
    console.print(
        f"{len(PROCEDURES)} procedures of 4 steps ({', '.join(PROCEDURES)}); a clip shows two consecutive steps "
        f"({data.frames_per_step} frames each at 2 fps, {data.frame_size} px; {strip}). Tasks: "
        f"{', '.join(JOINT_TASKS)}, then {NEW_TASK} as a new expert."
    )
    train = data.dataset(TRAIN_COUNTS | {NEW_TASK: NEW_TASK_COUNT}, torch.Generator().manual_seed(0))
    test = data.dataset(dict.fromkeys((*JOINT_TASKS, NEW_TASK), TEST_COUNT), torch.Generator().manual_seed(1))

    llama, siglip = build_base(out_dir / "base")
    mote_report = convert(llama, siglip, out_dir / "mote", data.words, experts=list(JOINT_TASKS))
    dense_report = convert(llama, siglip, out_dir / "dense", data.words, dense=True)
    print_table(
        "the two models (converted from the same dense checkpoints)",
        ["model", "experts", "total parameters", "active parameters", "max |logits - dense| at conversion"],
        [["dense", "none", dense_report["parameters"]["total"], dense_report["parameters"]["active"],
          dense_report["max_abs_diff"]],
         ["MoTE", f"{len(JOINT_TASKS)} + shared", mote_report["parameters"]["total"],
          mote_report["parameters"]["active"], mote_report["max_abs_diff"]]],
    )

    steps = 500 if quick else 900
    options = MoteTrainingOptions(steps=steps, batch_size=16, learning_rate=3e-3, warmup_steps=20,
                                  logging_steps=max(1, steps // 40), tasks=JOINT_TASKS)
    console.print(f"training both for {steps} steps, batch {options.batch_size}, on {sum(TRAIN_COUNTS.values())} "
                  f"examples ({', '.join(f'{n} {t}' for t, n in TRAIN_COUNTS.items())})")
    train_mote(out_dir / "mote", train, out_dir / "mote_trained", options, overwrite=True)
    train_mote(out_dir / "dense", train, out_dir / "dense_trained", options, overwrite=True)
    dense = task_accuracy(out_dir / "dense_trained", test, JOINT_TASKS)
    mote = task_accuracy(out_dir / "mote_trained", test, JOINT_TASKS)
    console.print(f"greedy answers to {TEST_COUNT} unseen clips per task, exact match:")
    print_table(
        "accuracy",
        ["task", "dense", "MoTE"],
        [[task, dense[task], mote[task]] for task in JOINT_TASKS]
        + [["mean", sum(dense.values()) / len(dense), sum(mote.values()) / len(mote)]],
    )

    before = route_logits(out_dir / "mote_trained", test, JOINT_TASKS)
    addition_steps = 400 if quick else 600
    console.print(f"adding {NEW_TASK!r} as a new expert (copied from {NEW_TASK_FROM!r}), {addition_steps} steps on "
                  f"its {NEW_TASK_COUNT} examples, everything else frozen")
    train_mote(
        out_dir / "mote_trained", train, out_dir / "mote_added",
        # Only one FFN per layer trains: it takes a larger learning rate than the whole decoder did.
        MoteTrainingOptions(steps=addition_steps, batch_size=16, learning_rate=1e-2, warmup_steps=20,
                            logging_steps=max(1, addition_steps // 40), add_expert=NEW_TASK,
                            init_from=NEW_TASK_FROM, description=DEFAULT_EXPERT_DESCRIPTIONS[NEW_TASK]),
        overwrite=True,
    )  # fmt: skip
    after = route_logits(out_dir / "mote_added", test, JOINT_TASKS)
    unchanged = {task: torch.equal(before[task], after[task]) for task in JOINT_TASKS}
    added = task_accuracy(out_dir / "mote_added", test, (*JOINT_TASKS, NEW_TASK))
    print_table(
        f"after adding {NEW_TASK!r}",
        ["task", "MoTE before", "MoTE after", "outputs bit-identical"],
        [[task, mote[task], added[task], unchanged[task]] for task in JOINT_TASKS]
        + [[NEW_TASK, None, added[NEW_TASK], "(new)"]],
    )
    console.print(f"wrote the models, their training curves (training_curves.png in each) and {strip} under {out_dir}")
    return {"dense": dense, "mote": mote, "added": added, "old_routes_bit_identical": unchanged,
            "parameters": {"dense": dense_report["parameters"], "mote": mote_report["parameters"]}}
