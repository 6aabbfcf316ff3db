"""Image-text and video-text data sets from `datasets`, normalised to `image` / `frames` and `text` columns.

Accepted sources (`load_image_text_dataset`):
- an image folder with a `metadata.jsonl` / `metadata.csv` naming `file_name` and a caption column (datasets'
  "imagefolder" layout);
- a JSON / JSON Lines / CSV / Parquet file whose rows hold an image path (relative to the file, not to the working
  directory) and a caption;
- webdataset shards (`.tar` files, a folder of them or a glob) pairing `<key>.jpg|png|webp` with `<key>.txt`;
- a `datasets.Dataset` already in memory, or the name of a Hub data set (when online).
Videos (`load_video_text_dataset`) are folders of frames: a column holding a list of frame paths, or a folder path
whose image files, sorted by name, are the frames.

Every row needs its image (or frames) and a non-empty caption: rows without are reported, by number, when the data
is loaded rather than skipped. Images are opened as they display (`open_image`): EXIF orientation applied,
transparency on white, whatever the source format.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, List, Value, load_dataset
from datasets import Image as ImageFeature
from datasets.exceptions import DatasetGenerationError

from ..hub.sources import is_hub_repo_id, locate
from ..processors.images import open_image

TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
WEBDATASET_TEXT_KEYS = ("txt", "text", "caption")
# How `datasets` types a column of strings: CSV files and Polars' Parquet files give large strings.
STRING_TYPES = ("string", "large_string")
# At most this many rows are named in an error.
ROWS_SHOWN = 5


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
    _require_values(dataset, image_column, text_column, source)
    dataset = dataset.rename_columns({k: v for k, v in ((image_column, "image"), (text_column, "text")) if k != v})
    if base is not None and _is_string(dataset.features["image"]):
        dataset = dataset.map(lambda row: {"image": str(base / row["image"])})
    dataset = _undecoded(dataset, "image")
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
    _require_values(dataset, frames_column, text_column, source)
    dataset = dataset.rename_columns({k: v for k, v in ((frames_column, "frames"), (text_column, "text")) if k != v})
    if base is not None:
        dataset = dataset.map(lambda row: {"frames": frame_paths(row["frames"], base)})
    dataset = _undecoded(dataset, "frames")
    return dataset.select_columns(["frames", "text"]).with_transform(_open_frames)


def load_table(path: str | Path, split: str = "train") -> Dataset:
    """A JSON / JSON Lines / CSV / Parquet file (`TABLE_FORMATS`, any case) as a dataset of at least one row; an
    empty or malformed file is an error naming it (datasets raises a bare StopIteration or "Instruction 'train'
    corresponds to no data!" for the first, a generic "An error occurred while generating the dataset" for the
    second)."""
    path = Path(path)
    table_format = TABLE_FORMATS.get(path.suffix.lower())
    if table_format is None:
        raise ValueError(f"{path}: expected a {', '.join(TABLE_FORMATS)} file")
    try:
        dataset = load_dataset(table_format, data_files={split: str(path)}, split=split)
    except StopIteration as error:
        raise ValueError(f"{path} holds no examples: the file is empty") from error
    except DatasetGenerationError as error:  # the cause says what and where (the line of a JSON error)
        raise ValueError(f"{path} is not a valid {table_format.upper()} file: {error.__cause__}") from error
    except ValueError as error:
        if "corresponds to no data" not in str(error):
            raise
        raise ValueError(f"{path} holds no examples: the file has no rows") from error
    if len(dataset) == 0:
        raise ValueError(f"{path} holds no examples")
    return dataset


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
        if path.suffix.lower() not in TABLE_FORMATS:
            raise ValueError(f"{path}: expected {', '.join(TABLE_FORMATS)}, webdataset .tar shards or an image folder")
        return load_table(path, split), path.parent
    if not is_hub_repo_id(str(source)):
        raise FileNotFoundError(f"no data at {source}")
    # A Hub data set from the Hub cache, or downloaded once the Hub answered; offline, named at once.
    folder = locate(source, "the data set", "give a local data file or folder", repo_type="dataset")
    return load_dataset(str(folder), split=split), None


def _webdataset_columns(dataset: Dataset, image_column: str, text_column: str) -> Dataset:
    """Webdataset shards name columns by file extension; map them to the requested names. datasets decodes `.txt`
    and `.text` files, not `.caption` ones: those are decoded here."""
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
    dataset = dataset.rename_columns(renames)
    feature = dataset.features.get(text_column)
    if isinstance(feature, Value) and feature.dtype in ("binary", "large_binary"):
        dataset = dataset.cast_column(text_column, Value("string"))  # UTF-8, as datasets decodes `.txt`
    return dataset


def _require_columns(dataset: Dataset, columns: tuple[str, ...], source) -> None:
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{source} has no column {', '.join(map(repr, missing))} (columns: {', '.join(dataset.column_names)}); "
            "name the right ones with --image-column / --frames-column / --text-column"
        )


def _require_values(dataset: Dataset, media_column: str, text_column: str, source) -> None:
    """Every row needs its media and a caption (or label): an empty one would fail deep in the processor mid-training,
    or an empty caption would silently train on nothing."""
    if len(dataset) == 0:
        raise ValueError(f"{source} holds no examples")
    for column in (media_column, text_column):
        rows = empty_rows(dataset, column)
        if rows:
            raise empty_rows_error(source, sorted(rows), f"an empty {column!r}")


def empty_rows(dataset: Dataset, column: str) -> set[int]:
    """The rows whose `column` is missing, a blank string or an empty list, read from the stored Arrow data: images
    are neither decoded nor copied, whatever the size of the data set."""
    values = dataset.with_format("arrow")[column]
    empty = pc.is_null(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        empty = pc.or_(empty, pc.equal(pc.utf8_trim_whitespace(values), ""))
    elif pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        empty = pc.or_(empty, pc.equal(pc.list_value_length(values), 0))
    return set(pc.indices_nonzero(pc.fill_null(empty, True)).to_pylist())


def empty_rows_error(source, rows: list[int], what: str) -> ValueError:
    """The error for data rows that lack something, naming the first of them."""
    shown = ", ".join(map(str, rows[:ROWS_SHOWN])) + (", ..." if len(rows) > ROWS_SHOWN else "")
    return ValueError(f"{source}: {len(rows)} row(s) have {what} (rows {shown}, counting from 0); fill or remove them")


def stored_values(dataset: Dataset, column: str) -> list:
    """A column as stored, without decoding or opening any image."""
    return dataset.with_format("arrow")[column].to_pylist()


def _is_string(feature) -> bool:
    return isinstance(feature, Value) and feature.dtype in STRING_TYPES


def _undecoded(dataset: Dataset, column: str) -> Dataset:
    """Image features (image folders, webdataset shards, in-memory images) left as `{"bytes", "path"}` records, so that
    `open_image` decodes them as it does files, naming the file when one cannot be read."""
    feature = dataset.features[column]
    if isinstance(feature, ImageFeature):
        return dataset.cast_column(column, ImageFeature(decode=False))
    if isinstance(feature, List) and isinstance(feature.feature, ImageFeature):
        return dataset.cast_column(column, List(ImageFeature(decode=False)))
    return dataset


def frame_paths(frames, base: Path) -> list[str]:
    """A video's frame paths: a list of paths relative to `base`, or a folder (relative to `base`) of frame images,
    sorted by name."""
    if isinstance(frames, str):
        folder = base / frames
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not paths:
            raise ValueError(f"the video folder {folder} holds no frames ({', '.join(IMAGE_SUFFIXES)})")
        return [str(p) for p in paths]
    return [str(base / frame) for frame in frames]


def _open_images(batch: dict) -> dict:
    return {"image": [open_image(image) for image in batch["image"]], "text": batch["text"]}


def _open_frames(batch: dict) -> dict:
    return {"frames": [[open_image(frame) for frame in frames] for frames in batch["frames"]], "text": batch["text"]}
