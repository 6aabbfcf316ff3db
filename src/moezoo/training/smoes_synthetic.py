"""The synthetic two-modality task of `moezoo train smoes`'s tests and demo: captioned images of coloured shapes
(`ColouredShapes`), written as an image folder with a JSON Lines file, the format `moezoo train smoes --data` reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .synthetic import ColouredShapes


def write_shape_captions(folder: str | Path, count: int, image_size: int = 16, seed: int = 0) -> Path:
    """`count` PNG images of one coloured shape each and `captions.jsonl` (`{"image": "0.png", "text": "a photo of a
    red square"}` per line) in `folder`; returns the JSON Lines file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    examples = ColouredShapes(image_size=image_size).sample(count, torch.Generator().manual_seed(seed), split="all")
    lines = []
    for index, example in enumerate(examples):
        example.image.save(folder / f"{index}.png")
        lines.append(json.dumps({"image": f"{index}.png", "text": example.caption}))
    path = folder / "captions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
