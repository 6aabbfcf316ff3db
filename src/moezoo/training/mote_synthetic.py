"""A synthetic multi-task "procedure video" data set for MoTE, made in-house (no downloads).

It mimics COIN (the paper's benchmark) at toy scale. A procedure is an ordered list of steps ("make tea": boil,
pour, stir, serve); each step is drawn as its own coloured shape moving in its own direction on a noisy background,
for `frames_per_step` frames (the 2 fps stream of a one-second step). A clip shows two consecutive steps of a
procedure, and the tasks ask about it with the paper's prompts (A.5):

- `step`: the action in the video, the last step shown;
- `next`: the next action;
- `task`: the overall activity, the procedure's name;
- `proc` / `proc_plus`: the remaining actions, numbered (`proc_plus` is told the procedure's goal).

Every pair of consecutive steps belongs to one procedure only, so a clip determines its procedure and its future:
each task is learnable, but each needs a different answer from the same frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset, Features, Sequence, Value
from datasets import Image as ImageFeature
from PIL import Image, ImageDraw

from ..processors.mote import format_answer, task_prompt
from .synthetic import MOTIONS


PROCEDURES = {
    "make tea": ("boil", "pour", "stir", "serve"),
    "make soup": ("cut", "stir", "boil", "serve"),
    "bake bread": ("stir", "bake", "cut", "serve"),
    "bake pie": ("cut", "pour", "bake", "serve"),
}
# step -> (colour, shape, direction of motion): the colour alone tells the steps apart.
STEP_LOOKS = {
    "cut": ((215, 45, 45), "circle", "right"),
    "boil": ((50, 80, 220), "square", "up"),
    "pour": ((45, 170, 70), "triangle", "down"),
    "stir": ((225, 205, 40), "circle", "left"),
    "bake": ((235, 130, 30), "square", "right"),
    "serve": ((160, 60, 200), "triangle", "up"),
}
TASKS = ("step", "next", "task", "proc", "proc_plus")


@dataclass
class ProcedureVideos:
    """Clips of procedures and the task examples asked about them (see the module docstring).

    Args:
        frame_size: Side of the square frames in pixels.
        frames_per_step: Frames each step lasts.
    """

    frame_size: int = 32
    frames_per_step: int = 2

    @property
    def words(self) -> tuple[str, ...]:
        """The words of every answer, for tokenizers built offline."""
        names = [word for name in PROCEDURES for word in name.split()]
        return tuple(dict.fromkeys([*STEP_LOOKS, *names]))

    def windows(self, task: str) -> list[tuple[str, int]]:
        """(procedure, index of the clip's first step) of every clip `task` can ask about: forecasting tasks need a
        step after the clip."""
        if task not in TASKS:
            raise ValueError(f"Unknown task {task!r}; the procedure tasks are {', '.join(TASKS)}.")
        last_start = {"step": 2, "task": 2}.get(task, 1)  # a clip shows steps start and start + 1 of 4
        return [(procedure, start) for procedure in PROCEDURES for start in range(last_start + 1)]

    def example(self, task: str, procedure: str, start: int, generator: torch.Generator) -> dict:
        """One example: `task`, the user `prompt`, the target `answer`, the clip's `frames`, and its `procedure`."""
        steps = PROCEDURES[procedure]
        shown, future = steps[start : start + 2], steps[start + 2 :]
        goal = procedure[:1].upper() + procedure[1:]
        if task == "step":
            prompt, answer = task_prompt(task), format_answer(task, [shown[-1]])
        elif task == "next":
            prompt, answer = task_prompt(task), format_answer(task, [future[0]])
        elif task == "task":
            prompt, answer = task_prompt(task), format_answer(task, [procedure])
        else:
            prompt = task_prompt(task, num_steps=len(future), goal=goal)
            answer = format_answer(task, list(future))
        frames = [frame for step in shown for frame in self.step_frames(step, generator)]
        return {"task": task, "prompt": prompt, "answer": answer, "frames": frames, "procedure": procedure}

    def step_frames(self, step: str, generator: torch.Generator) -> list[Image.Image]:
        """The frames of one step: its shape moving across a noisy background from a random start."""
        colour, shape, direction = STEP_LOOKS[step]
        size = self.frame_size
        radius = size // 4
        dx, dy = MOTIONS[direction]
        travel = size // 8
        x, y = (int(v) for v in torch.randint(radius + travel, size - radius - travel + 1, (2,), generator=generator))
        frames = []
        for index in range(self.frames_per_step):
            offset = index * travel // max(self.frames_per_step - 1, 1)
            noise = torch.randint(90, 150, (size, size, 3), generator=generator, dtype=torch.uint8).numpy()
            image = Image.fromarray(noise)
            draw_shape(ImageDraw.Draw(image), shape, x + dx * offset, y + dy * offset, radius, colour)
            frames.append(image)
        return frames

    def dataset(self, counts: dict[str, int], generator: torch.Generator) -> Dataset:
        """A `datasets.Dataset` with `counts[task]` examples of each task (clips drawn uniformly), shuffled, with the
        columns `task`, `prompt`, `answer`, `frames` (lists of images) and `procedure`."""
        rows = []
        for task, count in counts.items():
            windows = self.windows(task)
            picks = torch.randint(0, len(windows), (count,), generator=generator).tolist()
            rows.extend(self.example(task, *windows[pick], generator) for pick in picks)
        order = torch.randperm(len(rows), generator=generator).tolist()
        rows = [rows[index] for index in order]
        features = Features({
            "task": Value("string"), "prompt": Value("string"), "answer": Value("string"),
            "frames": Sequence(ImageFeature()), "procedure": Value("string"),
        })  # fmt: skip
        return Dataset.from_dict({key: [row[key] for row in rows] for key in features}, features=features)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, radius: int, colour) -> None:
    box = (x - radius, y - radius, x + radius, y + radius)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(x, y - radius), (x - radius, y + radius), (x + radius, y + radius)], fill=colour)
