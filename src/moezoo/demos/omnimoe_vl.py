"""Demo stage: OmniMoE-VL learns which visual depth to read.

A model of the `tiny-omnimoe_vl` size (4 streams here, one per depth) trains on the synthetic depth tasks of
`training/omnimoe_vl_synthetic.py` (spec §9.11-9.12): every stream of an "image" carries its own random bit, and the
answer is the bit of one stream, so the model answers well only if its route exposes that depth.

1. A fixed depth carries the answer: the route must learn to favour it (with exploration, which lets it find a depth
   its initial scores leave out).
2. The question names the depth: the route must follow the prompt. It learns to with the router utility
   supervision L_util on (`router_utility="grad"`, off by default).

For each, the accuracy of the greedy answer and the route's hit rates on fresh samples go into a small table, and
the mean route weight per depth (per question, for the second) into a heatmap PNG. `quick` runs the first only (a
few seconds; the second trains for minutes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from ..terminal import console, print_table
from ..training.omnimoe_vl import plot_depth_routes
from ..training.omnimoe_vl_synthetic import (
    SELECT,
    DepthTask,
    answers_from_the_depth,
    depth_task_config,
    train_depth_task,
)


FIXED_STREAM = 2


def new_model(steps: int, seed: int = 0, **config) -> OmniMoeVlForConditionalGeneration:
    """A fresh model for a run of `steps` steps, exploring for the first 60% of them (spec §9.11)."""
    torch.manual_seed(seed)
    return OmniMoeVlForConditionalGeneration(depth_task_config(exploration_steps=int(0.6 * steps), **config))


@torch.no_grad()
def routes_per_question(model: OmniMoeVlForConditionalGeneration, task: DepthTask, num_images: int = 128) -> dict:
    """The mean route weight per depth when the prompt asks for stream J, for every J, over the same images."""
    model.eval()
    generator = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 2, (num_images, task.num_streams), generator=generator)
    streams = task.streams(bits, generator)
    routes = {}
    for asked in range(task.num_streams):
        prompt = task.prompt(torch.full((num_images,), SELECT + asked))
        routes[f"asks for stream {asked}"] = model(**task.inputs(streams, prompt)).depth_route.mean(dim=0)
    return routes


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    fixed_steps, selected_steps = 60, 500
    console.print(
        "4 visual streams (depths) of 16 patches, each carrying its own random bit; the model answers one bit: of "
        f"stream {FIXED_STREAM} always (task 1, trained until it answers from that depth), or of the stream the "
        "question names (task 2). The route keeps the top 2 of 4 depths."
    )
    fixed_task = DepthTask(selected_stream=FIXED_STREAM)
    fixed = train_depth_task(new_model(fixed_steps), fixed_task, fixed_steps, eval_every=10,
                             stop=lambda result: answers_from_the_depth(result, FIXED_STREAM))[-1]  # fmt: skip
    rows = [[f"1: stream {FIXED_STREAM} always", fixed["step"], fixed["accuracy"], fixed["argmax_hit"],
             fixed["support_hit"]]]  # fmt: skip
    routes = {f"task 1 (stream {FIXED_STREAM})": torch.tensor(fixed["mean_route"])}
    results = {"fixed_depth": fixed}
    if quick:
        console.print(f"(--quick: task 2, {selected_steps} steps with one more backward each, runs without --quick)")
    else:
        # Following the question takes the paper's utility supervision L_util (one more backward per step).
        model = new_model(selected_steps, router_utility="grad", router_utility_coef=0.35)
        selected_task = DepthTask(selected_stream=None)
        selected = train_depth_task(model, selected_task, selected_steps)[-1]
        rows.append(["2: the question names the stream", selected["step"], selected["accuracy"],
                     selected["argmax_hit"], selected["support_hit"]])  # fmt: skip
        per_question = routes_per_question(model, selected_task)
        routes |= {f"task 2, {question}": route for question, route in per_question.items()}
        results["question_selects_depth"] = selected
    print_table(
        "after training (fresh samples, evaluation routing; chance: argmax 0.25, in the route 0.5)",
        ["task", "steps", "accuracy", "route's argmax on the answer's depth", "answer's depth in the route"], rows,
    )
    heatmap = plot_depth_routes(routes, out_dir / "depth_routes.png", title="mean route weight per depth")
    console.print(f"wrote {heatmap}")
    return results
