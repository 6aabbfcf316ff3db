"""MoEMB's training data in MMEB's training format (VLM2Vec): the examples of the contrastive trainer (`moemb.py`), of
GRPO over the efficiency gates (`moemb_grpo.py`, which `moemb.py` runs for `--grpo`) and of expert pruning's
calibration, and the key that tells identical targets apart; below those modules, so that none imports another for
them.

A file holds `qry`, `qry_image_path`, `pos_text`, `pos_image_path` and optionally `neg_text`, `neg_image_path`.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from datasets import Dataset, concatenate_datasets

from ..processors.moemb import mmeb_input
from .data import TABLE_FORMATS, load_table

SIDES = ("query", "target", "negative")
MMEB_COLUMNS = {"query": ("qry", "qry_image_path"), "target": ("pos_text", "pos_image_path"),
                "negative": ("neg_text", "neg_image_path")}  # fmt: skip


def load_mmeb_dataset(source: str | Path | Dataset, image_root: str | Path | None = None,
                      negatives: bool = False) -> Dataset:  # fmt: skip
    """Examples `{"query", "target"[, "negative"], "task"}` of processor inputs from data in MMEB's training format.

    `source` is a table file, a folder of table files (each a task, named after the file), or a `datasets.Dataset`
    whose image columns hold paths or images. Relative image paths are resolved against `image_root` (default: the
    folder of the data). With `negatives`, the `neg_text` / `neg_image_path` columns become a hard negative per
    query. A row with an empty side (neither text nor image) fails, naming the row, when its batch is processed.
    """
    sides = SIDES if negatives else SIDES[:2]
    columns = [column for side in sides for column in MMEB_COLUMNS[side]]
    if isinstance(source, Dataset):
        parts, base = [("train", source)], None
    else:
        path = Path(source)
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in TABLE_FORMATS) if path.is_dir() else [path]
        if not files or not all(p.is_file() and p.suffix.lower() in TABLE_FORMATS for p in files):
            raise FileNotFoundError(
                f"{source}: expected an MMEB training file ({', '.join(TABLE_FORMATS)}) or a folder of them"
            )
        parts = [(p.stem, load_table(p)) for p in files]
        base = path if path.is_dir() else path.parent
    tables = []
    for task, table in parts:
        missing = [column for column in columns if column not in table.column_names]
        if missing:
            raise ValueError(
                f"{source} ({task}) has no column {', '.join(map(repr, missing))} (columns: "
                f"{', '.join(table.column_names)}); MMEB's training format has qry, qry_image_path, pos_text, "
                "pos_image_path" + (" and, for --negatives, neg_text, neg_image_path" if negatives else "")
            )
        table = table.select_columns(columns)
        # "row" only names the row in errors; the examples do not have it.
        tables.append(table.add_column("task", [task] * len(table)).add_column("row", list(range(len(table)))))
    dataset = concatenate_datasets(tables)
    if len(dataset) == 0:
        raise ValueError(f"{source} holds no examples")
    root = Path(image_root) if image_root is not None else base
    return dataset.with_transform(lambda batch: _mmeb_examples(batch, sides, root))


def _mmeb_examples(batch: dict, sides: tuple[str, ...], image_root: Path | None) -> dict:
    examples = {"task": batch["task"]}
    for side in sides:
        text_column, image_column = MMEB_COLUMNS[side]
        examples[side] = [mmeb_input(text, image, image_root) for text, image in
                          zip(batch[text_column], batch[image_column])]  # fmt: skip
        for task, row, item in zip(batch["task"], batch["row"], examples[side]):
            if item["text"] is None and "images" not in item:
                raise ValueError(
                    f"data row {row} (counting from 0) of task {task!r} has no {side}: its {text_column} and "
                    f"{image_column} are both empty"
                    + (" (--negatives takes a hard negative from every row)" if side == "negative" else "")
                )
    return examples


def target_key(item: dict) -> int:
    """A 32-bit checksum of an input's content (texts, image paths or pixels), equal for identical targets and the
    same in every process (unlike `hash`)."""
    key = zlib.crc32(repr((item.get("instruction"), item.get("text"))).encode())
    for image in item.get("images") or []:
        key = zlib.crc32(image.encode() if isinstance(image, str) else np.asarray(image).tobytes(), key)
    return key
