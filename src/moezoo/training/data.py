"""Image-text and video-text data sets from `datasets`, normalised to `image` / `frames` and `text` columns.

Accepted sources (`load_image_text_dataset`):
- an image folder with a `metadata.jsonl` / `metadata.csv` naming `file_name` and a caption column (datasets'
  "imagefolder" layout);
- a JSON / JSON Lines / CSV / Parquet file whose rows hold an image path (relative to the file) and a caption;
- webdataset shards (`.tar` files, a folder of them or a glob) pairing `<key>.jpg|png|webp` with `<key>.txt`;
- a `datasets.Dataset` already in memory, or the name of a Hub data set (when online).
Videos (`load_video_text_dataset`) are folders of frames: a column holding a list of frame paths, or a folder path
whose image files, sorted by name, are the frames.
"""

from __future__ import annotations

import glob
from pathlib import Path

from datasets import Dataset, load_dataset
from PIL import Image


TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
WEBDATASET_TEXT_KEYS = ("txt", "text", "caption")


def load_image_text_dataset(
    source: str | Path | Dataset, image_column: str = "image", text_column: str = "text", split: str = "train"
) -> Dataset:
    """A dataset with an `image` column (PIL images) and a `text` column (captions)."""
    if isinstance(source, Dataset):
        dataset, base = source, None
    else:
        dataset, base = _load(source, split)
    dataset = _webdataset_columns(dataset, image_column, text_column)
    _require_columns(dataset, (image_column, text_column), source)
    dataset = dataset.rename_columns({k: v for k, v in ((image_column, "image"), (text_column, "text")) if k != v})
    if base is not None and dataset.features["image"].dtype == "string":
        dataset = dataset.map(lambda row: {"image": str(base / row["image"])})
    return dataset.select_columns(["image", "text"]).with_transform(_open_images)


def load_video_text_dataset(
    source: str | Path | Dataset, frames_column: str = "frames", text_column: str = "text", split: str = "train"
) -> Dataset:
    """A dataset with a `frames` column (lists of PIL images) and a `text` column."""
    if isinstance(source, Dataset):
        dataset, base = source, None
    else:
        dataset, base = _load(source, split)
    _require_columns(dataset, (frames_column, text_column), source)
    dataset = dataset.rename_columns({k: v for k, v in ((frames_column, "frames"), (text_column, "text")) if k != v})
    if base is not None:
        dataset = dataset.map(lambda row: {"frames": _frame_paths(row["frames"], base)})
    return dataset.select_columns(["frames", "text"]).with_transform(_open_frames)


def _load(source: str | Path, split: str) -> tuple[Dataset, Path | None]:
    """The raw dataset and the folder relative image paths refer to (None when images are embedded)."""
    path = Path(source)
    shards = sorted(glob.glob(str(source))) if any(c in str(source) for c in "*?[") else []
    if path.is_dir() and sorted(path.glob("*.tar")):
        shards = [str(p) for p in sorted(path.glob("*.tar"))]
    if path.is_file() and path.suffix == ".tar":
        shards = [str(path)]
    if shards:
        return load_dataset("webdataset", data_files={split: shards}, split=split), None
    if path.is_dir():
        return load_dataset("imagefolder", data_dir=str(path), split=split), None
    if path.is_file():
        if path.suffix not in TABLE_FORMATS:
            raise ValueError(f"{path}: expected {', '.join(TABLE_FORMATS)}, webdataset .tar shards or an image folder")
        return load_dataset(TABLE_FORMATS[path.suffix], data_files={split: str(path)}, split=split), path.parent
    if str(source).count("/") == 1:
        return load_dataset(str(source), split=split), None
    raise FileNotFoundError(f"no data at {source}")


def _webdataset_columns(dataset: Dataset, image_column: str, text_column: str) -> Dataset:
    """Webdataset shards name columns by file extension; map them to the requested names."""
    if "__key__" not in dataset.column_names:
        return dataset
    renames = {}
    if image_column not in dataset.column_names:
        found = [key for key in WEBDATASET_IMAGE_KEYS if key in dataset.column_names]
        if found:
            renames[found[0]] = image_column
    if text_column not in dataset.column_names:
        found = [key for key in WEBDATASET_TEXT_KEYS if key in dataset.column_names]
        if found:
            renames[found[0]] = text_column
    return dataset.rename_columns(renames)


def _require_columns(dataset: Dataset, columns: tuple[str, ...], source) -> None:
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{source} has no column {', '.join(map(repr, missing))} (columns: {', '.join(dataset.column_names)}); "
            "name the right ones with --image-column / --frames-column / --text-column"
        )


def _frame_paths(frames, base: Path) -> list[str]:
    if isinstance(frames, str):
        folder = base / frames
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not paths:
            raise ValueError(f"the video folder {folder} holds no frames ({', '.join(IMAGE_SUFFIXES)})")
        return [str(p) for p in paths]
    return [str(base / frame) for frame in frames]


def _open(image) -> Image.Image:
    return Image.open(image).convert("RGB") if isinstance(image, str) else image


def _open_images(batch: dict) -> dict:
    return {"image": [_open(image) for image in batch["image"]], "text": batch["text"]}


def _open_frames(batch: dict) -> dict:
    return {"frames": [[_open(frame) for frame in frames] for frames in batch["frames"]], "text": batch["text"]}
