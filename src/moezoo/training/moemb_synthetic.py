"""Synthetic multimodal retrieval sets for MoEMB, in the formats of the real benchmarks (no downloads).

Images are `ColouredShapes` (one coloured shape on a noisy background, captioned "a photo of a red square"). Two
directions, as in MMEB's MSCOCO tasks:

- image to text: the query is an image with an instruction, the target its caption;
- text to image: the query is an instruction with a caption, the target an image of that class.

`training_dataset` / `write_mmeb_training` give MMEB's training format (VLM2Vec: `qry`, `qry_image_path`,
`pos_text`, `pos_image_path`, `<|image_1|>` marking the image), `mmeb_eval_task` MMEB's evaluation format (a
query and its candidates, the positive first), and `write_mrmr_task` MRMR's (query, corpus and qrels tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature

from ..processors.moemb import MMEB_IMAGE_TOKEN
from .synthetic import ColouredShapes

# Instructions in the style of MMEB's MSCOCO_i2t / MSCOCO_t2i tasks.
IMAGE_TO_TEXT = f"{MMEB_IMAGE_TOKEN}\nFind the caption of the image."
TEXT_TO_IMAGE = "Find the image of the caption: {}"
TARGET_IMAGE = f"{MMEB_IMAGE_TOKEN}\nRepresent the given image."
DIRECTIONS = ("image_to_text", "text_to_image")
MMEB_TRAINING_FEATURES = Features({
    "qry": Value("string"), "qry_image_path": ImageFeature(), "pos_text": Value("string"),
    "pos_image_path": ImageFeature(),
})  # fmt: skip


class ShapeRetrieval:
    """Retrieval between images of coloured shapes and their captions (see the module docstring)."""

    def __init__(self, image_size: int = 16, colours=("red", "green", "blue", "yellow"),
                 shapes=("circle", "square", "triangle", "cross")):  # fmt: skip
        self.shapes = ColouredShapes(image_size=image_size, colours=colours, shapes=shapes, held_out=())

    @property
    def num_classes(self) -> int:
        return len(self.shapes.class_names)

    def record(self, label: int, direction: str, generator: torch.Generator) -> dict:
        """One MMEB training record of class `label`, its image drawn fresh (in memory)."""
        image, caption = self.shapes.draw(label, generator), self.shapes.caption(label)
        if direction == "image_to_text":
            return {"qry": IMAGE_TO_TEXT, "qry_image_path": image, "pos_text": caption, "pos_image_path": None}
        return {"qry": TEXT_TO_IMAGE.format(caption), "qry_image_path": None, "pos_text": TARGET_IMAGE,
                "pos_image_path": image}  # fmt: skip

    def training_dataset(self, count: int, generator: torch.Generator, directions=DIRECTIONS) -> Dataset:
        """`count` MMEB training records of random classes, the directions alternating; images in memory."""
        labels = torch.randint(0, self.num_classes, (count,), generator=generator).tolist()
        records = [self.record(label, directions[i % len(directions)], generator) for i, label in enumerate(labels)]
        return Dataset.from_list(records, features=MMEB_TRAINING_FEATURES)

    def write_mmeb_training(self, folder: str | Path, count: int, generator: torch.Generator) -> Path:
        """The training set as MMEB ships it: `train.jsonl` with image paths relative to the folder, PNG images."""
        folder = Path(folder)
        (folder / "images").mkdir(parents=True, exist_ok=True)
        rows = []
        for index, record in enumerate(self.training_dataset(count, generator)):
            for column in ("qry_image_path", "pos_image_path"):
                if record[column] is not None:
                    path = f"images/{index}_{column[:3]}.png"
                    record[column].save(folder / path)
                    record[column] = path
                else:
                    record[column] = ""
            rows.append(record)
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    def mmeb_eval_task(self, direction: str, num_queries: int, num_candidates: int, generator: torch.Generator,
                       image_folder: str | Path) -> Dataset:  # fmt: skip
        """An MMEB evaluation task: per query, `num_candidates` targets of distinct classes, the positive first
        (`qry_text`, `qry_img_path`, `tgt_text`, `tgt_img_path`); images saved under `image_folder`, paths relative
        to its parent. A constant `category` column ("image RET") names the task's MMEB category."""
        if not 2 <= num_candidates <= self.num_classes:
            raise ValueError(f"num_candidates must lie in [2, {self.num_classes}], got {num_candidates}")
        image_folder = Path(image_folder)
        image_folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for query in range(num_queries):
            classes = torch.randperm(self.num_classes, generator=generator)[:num_candidates].tolist()
            images = []
            for position, label in enumerate(classes if direction == "text_to_image" else classes[:1]):
                path = image_folder / f"{direction}_{query}_{position}.png"
                self.shapes.draw(label, generator).save(path)
                images.append(f"{image_folder.name}/{path.name}")
            captions = [self.shapes.caption(label) for label in classes]
            if direction == "image_to_text":
                row = {"qry_text": IMAGE_TO_TEXT, "qry_img_path": images[0], "tgt_text": captions,
                       "tgt_img_path": [""] * num_candidates}  # fmt: skip
            else:
                row = {"qry_text": TEXT_TO_IMAGE.format(captions[0]), "qry_img_path": "",
                       "tgt_text": [TARGET_IMAGE] * num_candidates, "tgt_img_path": images}  # fmt: skip
            rows.append(row | {"category": "image RET"})
        return Dataset.from_list(rows)

    def write_mrmr_task(self, folder: str | Path, num_queries: int, generator: torch.Generator) -> Path:
        """An MRMR-format task (`query.jsonl` with a `category` per query, `corpus.jsonl`, `qrels.jsonl`): text queries
        "a photo of a red square" against a corpus of images, two of each class, both relevant; the query's category
        is its colour. Images are PNG files named in the `image` column, relative to `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        corpus, qrels, queries = [], [], []
        for label in range(self.num_classes):
            for copy in range(2):
                name = f"doc_{label}_{copy}"
                self.shapes.draw(label, generator).save(folder / f"{name}.png")
                corpus.append({"id": name, "modality": "image", "text": "", "image": f"{name}.png"})
        labels = torch.randint(0, self.num_classes, (num_queries,), generator=generator).tolist()
        for index, label in enumerate(labels):
            colour = self.shapes.colours[label // len(self.shapes.shapes)]
            queries.append({"id": f"q{index}", "modality": "text", "text": self.shapes.caption(label),
                            "category": colour})  # fmt: skip
            qrels += [{"query_id": f"q{index}", "corpus_id": f"doc_{label}_{copy}", "score": 1} for copy in range(2)]
        for name, rows in (("query", queries), ("corpus", corpus), ("qrels", qrels)):
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return folder
