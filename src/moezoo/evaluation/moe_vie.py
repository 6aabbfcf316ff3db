"""`moezoo eval moe_vie`: zero-shot classification and image/video-text retrieval, the protocol of the MoE-ViE paper
(spec moe_vie.md §8 "Evaluation": CLIP_benchmark with prompt templates).

- Zero-shot classification (CLIP's prompt ensembling): each class is embedded as the mean of the L2-normalised text
  embeddings of `template.format(class_name)` over all templates, normalised again; an image gets the class of
  highest cosine similarity. Reported: top-1 and top-5 accuracy, per-class accuracy and its mean.
- Retrieval: recall@1/5/10 in both directions, with several captions per image or video as in COCO and Flickr30k.
  Text->image is a hit when a caption's own item is in its top k; image->text when any of the item's captions is.

Ranks break ties against the model: a wrong candidate that scores exactly as high as the right one ranks before it,
so a collapsed model (every embedding equal) scores 0, not 1. Recall@k is reported only for k up to the number of
candidates, with a note for each k left out. The paper reports the better of square and centre-crop preprocessing
(`--resize-mode`); the InternVL reweighting of retrieval scores the spec mentions is not applied: recalls here are
plain cosine-similarity recalls.
"""

from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ..hub.sources import model_folder
from ..processors.moe_vie import RESIZE_MODES
from ..terminal import console, print_table, progress_bar
from . import positive_int

# CLIP's plain prompt, then the 7 of CLIP's 80 ImageNet prompts that OpenAI's prompt-engineering notebook selected as
# an ensemble almost as good as all 80. The paper uses PE's per-data-set templates: pass those to reproduce its numbers.
DEFAULT_TEMPLATES = (
    "a photo of a {}.",
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)
TOP_KS = (1, 5)
RECALL_KS = (1, 5, 10)
RETRIEVAL_TASKS = {"image": "retrieval", "video": "video-retrieval"}
TASKS = ("zero-shot", *RETRIEVAL_TASKS.values())
# For each modality, the processor argument that takes it and the model method that embeds it.
ENCODERS = {
    "text": ("text", "get_text_features"),
    "image": ("images", "get_image_features"),
    "video": ("videos", "get_video_features"),
}


# --- Embeddings ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def embed(
    model, processor, inputs: Sequence, modality: str, batch_size: int = 64, progress: bool = True
) -> torch.Tensor:
    """L2-normalised embeddings `(len(inputs), D)`, float32 on the CPU, of texts, images or videos (lists of frames).

    `model` is a MoE-ViE model, or any model whose `get_text_features` / `get_image_features` / `get_video_features`
    return the projected embeddings as `pooler_output`. `inputs` may be any sequence that slices, such as a `datasets`
    column that opens its images lazily: one batch at a time is in memory. The model runs in eval mode and goes back
    to its previous mode afterwards, so that evaluating in the middle of training leaves it training. A progress bar
    (on stderr) shows when there is more than one batch.
    """
    if modality not in ENCODERS:
        raise ValueError(f"modality must be one of {', '.join(ENCODERS)}, got {modality!r}")
    if len(inputs) == 0:
        raise ValueError(f"no {modality}s to embed")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    argument, method = ENCODERS[modality]
    was_training = model.training
    model.eval()
    embeddings = []
    try:
        with _progress(f"embedding {modality}s", len(inputs), show=progress and len(inputs) > batch_size) as advance:
            for start in range(0, len(inputs), batch_size):
                batch = list(inputs[start : start + batch_size])
                features = processor(**{argument: batch}, return_tensors="pt")
                features = features.to(device=model.device, dtype=model.dtype)  # dtype: floating tensors only
                embeddings.append(getattr(model, method)(**features).pooler_output.float().cpu())
                advance(len(batch))
    finally:
        model.train(was_training)
    embeddings = torch.cat(embeddings)
    # NaN compares false with everything, so it would rank every right answer first: a broken model must not score 1.
    if not torch.isfinite(embeddings).all():
        raise ValueError(f"the model gave non-finite {modality} embeddings (NaN or inf): check its weights and dtype")
    return F.normalize(embeddings, dim=-1)


@contextmanager
def _progress(description: str, total: int, show: bool) -> Iterator[Callable[[int], None]]:
    """A function that advances a transient progress bar, or does nothing when `show` is false."""
    if not show:
        yield lambda count: None
        return
    with progress_bar(transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda count: bar.update(task, advance=count)


# --- Zero-shot classification ----------------------------------------------------------------------------------------


def load_templates(templates: Sequence[str] | str | Path = DEFAULT_TEMPLATES) -> list[str]:
    """Prompt templates, each with one `{}` where the class name goes: a list, or a file with one per line."""
    templates = _read_list(templates, "templates")
    if not templates:
        raise ValueError("no prompt templates: give at least one, such as 'a photo of a {}.'")
    bad = [template for template in templates if not isinstance(template, str) or template.count("{}") != 1]
    if bad:
        raise ValueError(f"every template needs exactly one '{{}}' where the class name goes; these do not: {bad[:5]}")
    return templates


def zero_shot_classifier(
    model, processor, class_names: Sequence[str] | str | Path,
    templates: Sequence[str] | str | Path = DEFAULT_TEMPLATES, batch_size: int = 64, progress: bool = True,
) -> torch.Tensor:
    """Class embeddings `(num_classes, D)`: for each class, the mean over `templates` of the L2-normalised text
    embeddings of `template.format(class_name)`, normalised again."""
    templates = load_templates(templates)
    class_names = _check_class_names(class_names)
    prompts = [template.format(name) for name in class_names for template in templates]
    text = embed(model, processor, prompts, "text", batch_size, progress)
    return F.normalize(text.view(len(class_names), len(templates), -1).mean(1), dim=-1)


def zero_shot_classification(
    model, processor, images: Sequence, labels: Sequence[int | str], class_names: Sequence[str] | str | Path,
    templates: Sequence[str] | str | Path = DEFAULT_TEMPLATES, batch_size: int = 64, progress: bool = True,
) -> dict:
    """Zero-shot accuracy of `model` on `images`, whose `labels` are class indices or class names.

    `class_names` and `templates` are lists, or files with one entry per line. Returns a JSON-serialisable dict (see
    `classification_metrics`) with the number of templates added. Every input is checked before anything is embedded.
    """
    templates = load_templates(templates)
    class_names = _check_class_names(class_names)
    targets = label_indices(labels, class_names)
    if len(images) != len(targets):
        raise ValueError(f"{len(images)} images but {len(targets)} labels: give one label per image")
    classifier = zero_shot_classifier(model, processor, class_names, templates, batch_size, progress)
    image_embeds = embed(model, processor, images, "image", batch_size, progress)
    return {**classification_metrics(image_embeds @ classifier.T, targets, class_names), "templates": len(templates)}


def label_indices(labels: Sequence[int | str], class_names: Sequence[str]) -> torch.Tensor:
    """Labels as class indices: integer labels index `class_names`, string labels are looked up in it."""
    if len(labels) == 0:
        raise ValueError("no labels: the evaluation set is empty")
    index_of = {name: index for index, name in enumerate(class_names)}
    indices, unknown = [], []
    for label in labels:
        index = _label_index(label, index_of, len(class_names))
        if index is None:
            unknown.append(label)
        else:
            indices.append(index)
    if unknown:
        examples = ", ".join(map(repr, list(dict.fromkeys(unknown))[:5]))
        raise ValueError(
            f"{len(unknown)} of {len(labels)} labels are not among the {len(class_names)} classes ({examples}): labels "
            f"must be class indices 0 to {len(class_names) - 1} or class names; check the class names (--class-names)"
        )
    return torch.tensor(indices)


def _label_index(label, index_of: dict[str, int], num_classes: int) -> int | None:
    if isinstance(label, str):
        return index_of.get(label)
    try:
        index = operator.index(label)  # Python, numpy and 0-d torch integers alike
    except TypeError:
        return None
    return index if 0 <= index < num_classes else None


def _check_class_names(class_names: Sequence[str] | str | Path) -> list[str]:
    class_names = _read_list(class_names, "class names")
    if len(class_names) < 2:
        raise ValueError(f"zero-shot classification needs at least 2 class names, got {len(class_names)}")
    bad = [name for name in class_names if not isinstance(name, str) or not name.strip()]
    if bad:
        raise ValueError(f"class names must be non-empty strings, got {bad[:5]}")
    return class_names


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor, class_names: Sequence[str]) -> dict:
    """Accuracy from `logits (num_examples, num_classes)` and the target class of each example.

    Keys: `top1`, `top5` (only with at least 5 classes), `per_class` (a list of {class, examples, accuracy}, accuracy
    None for classes without examples; a list because class names may repeat, as ImageNet's "crane" does),
    `mean_per_class_accuracy` (over the classes with examples), and `notes`.
    """
    num_classes = len(class_names)
    ranks = _first_hit_ranks(logits, F.one_hot(targets, num_classes).bool())
    accuracy, left_out = _hit_rates(ranks, TOP_KS, num_classes)
    counts = torch.bincount(targets, minlength=num_classes).tolist()
    hits = torch.bincount(targets[ranks == 0], minlength=num_classes).tolist()
    per_class = [
        {"class": name, "examples": count, "accuracy": hit / count if count else None}
        for name, count, hit in zip(class_names, counts, hits)
    ]
    seen = [row["accuracy"] for row in per_class if row["examples"]]
    return {
        "task": "zero-shot",
        "examples": len(targets),
        "classes": num_classes,
        **{f"top{k}": value for k, value in accuracy.items()},
        "mean_per_class_accuracy": sum(seen) / len(seen),
        "per_class": per_class,
        "notes": [f"top-{k} accuracy left out: there are only {num_classes} classes" for k in left_out],
    }


# --- Retrieval -------------------------------------------------------------------------------------------------------


def retrieval(
    model, processor, items: Sequence, captions: Sequence[str | Sequence[str]], modality: str = "image",
    ks: Sequence[int] = RECALL_KS, batch_size: int = 64, progress: bool = True,
) -> dict:
    """Recall@k of image-text (`modality="image"`) or video-text (`"video"`, items are lists of frames) retrieval.

    `captions[i]` is the caption of `items[i]`, or the list of its captions. Returns a JSON-serialisable dict (see
    `retrieval_metrics`). The captions and `ks` are checked before anything is embedded.
    """
    _check_modality(modality)
    caption_items, texts = _flatten_captions(captions, len(items))
    _check_ks(ks, len(items))
    item_embeds = embed(model, processor, items, modality, batch_size, progress)
    text_embeds = embed(model, processor, texts, "text", batch_size, progress)
    return retrieval_metrics(text_embeds @ item_embeds.T, caption_items, modality, ks)


def retrieval_metrics(
    scores: torch.Tensor, caption_items: torch.Tensor, modality: str = "image", ks: Sequence[int] = RECALL_KS
) -> dict:
    """Recall@k in both directions from `scores (num_captions, num_items)` and the item of each caption.

    Keys: `task`, `modality`, `items`, `captions`, `<modality>_to_text` and `text_to_<modality>` ({"recall@k": value}
    for each k up to the number of candidates of that direction), and `notes` naming the ks left out.
    """
    num_captions, num_items = scores.shape
    _check_modality(modality)
    _check_ks(ks, num_items)
    if caption_items.shape != (num_captions,) or caption_items.min() < 0 or caption_items.max() >= num_items:
        raise ValueError(f"caption_items must give each of the {num_captions} captions an item index below {num_items}")
    if torch.bincount(caption_items, minlength=num_items).min() == 0:
        raise ValueError("every item needs at least one caption")
    correct = caption_items[:, None] == torch.arange(num_items)  # (captions, items)
    results = {"task": RETRIEVAL_TASKS[modality], "modality": modality, "items": num_items, "captions": num_captions}
    notes = []
    for direction, direction_scores, direction_correct, candidates in (
        (f"{modality}_to_text", scores.T, correct.T, "captions"),
        (f"text_to_{modality}", scores, correct, f"{modality}s"),
    ):
        num_candidates = direction_scores.shape[1]
        recalls, left_out = _hit_rates(_first_hit_ranks(direction_scores, direction_correct), ks, num_candidates)
        results[direction] = {f"recall@{k}": value for k, value in recalls.items()}
        notes += [f"{direction} recall@{k} left out: there are only {num_candidates} {candidates}" for k in left_out]
    return {**results, "notes": notes}


def _flatten_captions(captions: Sequence[str | Sequence[str]], num_items: int) -> tuple[torch.Tensor, list[str]]:
    """The item index of every caption, and the captions in one list."""
    if num_items < 2:
        raise ValueError(f"retrieval needs at least 2 items to rank, got {num_items}")
    if len(captions) != num_items:
        raise ValueError(
            f"{num_items} items but {len(captions)} caption entries: give each item its caption or list of captions"
        )
    caption_items, texts = [], []
    for index, item_captions in enumerate(captions):
        item_captions = list(item_captions) if isinstance(item_captions, (list, tuple)) else [item_captions]
        if not item_captions or not all(isinstance(text, str) and text.strip() for text in item_captions):
            raise ValueError(f"item {index} needs at least one caption, all non-empty strings; got {item_captions!r}")
        caption_items += [index] * len(item_captions)
        texts += item_captions
    return torch.tensor(caption_items), texts


def _check_modality(modality: str) -> None:
    if modality not in RETRIEVAL_TASKS:
        raise ValueError(f"retrieval modality must be one of {', '.join(RETRIEVAL_TASKS)}, got {modality!r}")


def _check_ks(ks: Sequence[int], num_items: int) -> None:
    if not ks or not all(isinstance(k, int) and k >= 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    # Text->image ranks the items, the shorter candidate list (every item has at least one caption).
    if min(ks) > num_items:
        raise ValueError(
            f"recall@k needs k <= the number of items ranked, and there are only {num_items}: use smaller ks (got "
            f"{list(ks)}) or more data"
        )


# --- Ranks shared by both tasks --------------------------------------------------------------------------------------


def _first_hit_ranks(scores: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """For each query (a row of `scores` over the candidates; `correct` marks the right ones), the 0-based rank of its
    best right candidate: the number of wrong candidates that score at least as high. A top-k hit is a rank below k."""
    best_correct = scores.masked_fill(~correct, float("-inf")).amax(-1, keepdim=True)
    return (scores.ge(best_correct) & ~correct).sum(-1)


def _hit_rates(ranks: torch.Tensor, ks: Sequence[int], num_candidates: int) -> tuple[dict[int, float], list[int]]:
    """The fraction of queries with a hit in their top k for each k up to `num_candidates`, and the ks left out."""
    kept = [k for k in ks if k <= num_candidates]
    return {k: (ranks < k).float().mean().item() for k in kept}, [k for k in ks if k > num_candidates]


# --- Evaluation data -------------------------------------------------------------------------------------------------


@dataclass
class ClassificationData:
    """Images (opened lazily, a batch at a time), the class index of each, and the class names."""

    images: Sequence
    labels: list[int]
    class_names: list[str]


@dataclass
class RetrievalData:
    """Images, or videos as lists of frames (opened lazily, a batch at a time), and the list of captions of each."""

    items: Sequence
    captions: list[list[str]]


def load_classification_data(
    source, image_column: str = "image", label_column: str = "label",
    class_names: Sequence[str] | str | Path | None = None, limit: int | None = None,
) -> ClassificationData:
    """An image classification set from an image folder with one sub-folder per class (datasets' "imagefolder"), a
    JSON / JSON Lines / CSV / Parquet file of image paths (relative to the file) and labels, or a `datasets.Dataset`.

    Labels are integers or strings. The class names are `class_names` (a list, or a file with one per line: line i
    names label i), else the names of the label feature (an image folder's sub-folder names), else the distinct string
    labels, sorted. Labels outside the class names are reported here, before any model is loaded. `limit` keeps that
    many examples, spread evenly over the set.
    """
    # Imported here: datasets is an optional extra (moezoo[train]) that only loading evaluation sets needs.
    from datasets import ClassLabel

    from ..training.data import load_image_text_dataset, stored_values

    # The loader resolves image paths and opens images lazily for any set of images with one more column, which it
    # calls "text" whatever it holds: here, the labels.
    dataset = load_image_text_dataset(source, image_column=image_column, text_column=label_column)
    labels = stored_values(dataset, "text")
    label_feature = dataset.features["text"]
    if class_names is not None:
        class_names = _read_list(class_names, "class names")
    elif isinstance(label_feature, ClassLabel):
        class_names = label_feature.names
    elif all(isinstance(label, str) for label in labels):
        class_names = sorted(set(labels))
    else:
        raise ValueError(
            f"{source}: the labels of column {label_column!r} are not class names, so the class names must be given: "
            "pass --class-names FILE with one class name per line (line i names label i)"
        )
    labels = label_indices(labels, class_names).tolist()
    keep = _spread(len(dataset), limit)
    return ClassificationData(
        images=dataset.select(keep)["image"], labels=[labels[i] for i in keep], class_names=list(class_names)
    )


def load_retrieval_data(
    source, modality: str = "image", item_column: str | None = None, text_column: str = "text",
    limit: int | None = None,
) -> RetrievalData:
    """An image-text (`modality="image"`) or video-text (`"video"`) retrieval set, one caption per row, in the formats
    of `moezoo.training.data.load_image_text_dataset` / `load_video_text_dataset`.

    Rows naming the same image file (or the same frame files) are one item with several captions, as in COCO and
    Flickr30k; rows whose images are embedded (bytes: in-memory images, webdataset shards) are items of their own. `item_column` defaults to
    "image" or "frames". `limit` keeps that many items, spread evenly over the set, with all their captions.
    """
    # Imported here: datasets is an optional extra (moezoo[train]) that only loading evaluation sets needs.
    from ..training.data import load_image_text_dataset, load_video_text_dataset, stored_values

    _check_modality(modality)
    if modality == "image":
        dataset = load_image_text_dataset(source, image_column=item_column or "image", text_column=text_column)
        column = "image"
    else:
        dataset = load_video_text_dataset(source, frames_column=item_column or "frames", text_column=text_column)
        column = "frames"
    keys, texts = _item_keys(stored_values(dataset, column)), stored_values(dataset, "text")
    item_of_key, item_rows, captions = {}, [], []
    for row, (key, text) in enumerate(zip(keys, texts)):
        if key not in item_of_key:
            item_of_key[key] = len(item_rows)
            item_rows.append(row)
            captions.append([])
        captions[item_of_key[key]].append(text)
    keep = _spread(len(item_rows), limit)
    return RetrievalData(
        items=dataset.select([item_rows[i] for i in keep])[column], captions=[captions[i] for i in keep]
    )


def _item_keys(stored_items: list) -> list:
    """A key per row that rows showing the same item share: its image path or the tuple of its frame paths, or the
    row number when an image is embedded in the data (its bytes stored: in-memory images, webdataset members, whose
    names repeat from shard to shard and name no file)."""
    keys = []
    for row, value in enumerate(stored_items):
        # Stored images are paths (table files) or {"bytes", "path"} records (image features); videos are lists.
        frames = value if isinstance(value, list) else [value]
        paths = [
            frame if isinstance(frame, str) else (frame or {}).get("path") if (frame or {}).get("bytes") is None else None
            for frame in frames
        ]
        keys.append(tuple(paths) if all(paths) else row)
    return keys


def _spread(count: int, limit: int | None) -> list[int]:
    """`limit` indices spread evenly over `count`, or all of them: image folders list their classes in order, so the
    first `limit` examples would cover only the first classes."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if limit is None or limit >= count:
        return list(range(count))
    return [i * count // limit for i in range(limit)]


def _read_list(value: Sequence[str] | str | Path, what: str) -> list:
    """A list given as such, or as a file with one entry per line (blank lines skipped)."""
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"no {what} file {path}: give a text file with one entry per line")
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return list(value)


# --- Output ----------------------------------------------------------------------------------------------------------


def print_evaluation(results: dict) -> None:
    """Print the results of `zero_shot_classification` or `retrieval` as tables, then their notes."""
    if results["task"] == "zero-shot":
        print_table(
            "zero-shot classification",
            ["images", "classes", "templates", "top-1 accuracy", "top-5 accuracy", "mean per-class accuracy"],
            [[results["examples"], results["classes"], results["templates"], results["top1"], results.get("top5"),
              results["mean_per_class_accuracy"]]],
        )
        print_table(
            "per class", ["class", "examples", "top-1 accuracy"],
            [[row["class"], row["examples"], row["accuracy"]] for row in results["per_class"]],
        )
    else:
        modality = results["modality"]
        directions = {
            f"{modality}_to_text": (f"{modality} → text", results["items"], results["captions"]),
            f"text_to_{modality}": (f"text → {modality}", results["captions"], results["items"]),
        }
        recalls = list(dict.fromkeys(key for direction in directions for key in results[direction]))
        print_table(
            f"{modality}-text retrieval",
            ["direction", "queries", "candidates", *recalls],
            [[*row, *(results[direction].get(key) for key in recalls)] for direction, row in directions.items()],
        )
    for note in results["notes"]:
        console.print(f"note: {note}")


# --- Command line ----------------------------------------------------------------------------------------------------


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo eval moe_vie`."""
    parser.add_argument(
        "--model", required=True, metavar="DIR",
        help="a MoE-ViE model with its processor, as `moezoo create` / `convert` / training write them",
    )
    parser.add_argument(
        "--data", required=True, metavar="PATH",
        help="zero-shot: an image folder with one sub-folder per class, or a JSON/JSONL/CSV/Parquet file of image "
        "paths and labels; retrieval: image-text data as moezoo's training reads it (rows sharing an image are one "
        "image with several captions); video-retrieval: the same with a column of frame paths or frame folders",
    )
    parser.add_argument("--task", choices=TASKS, default="zero-shot", help="what to measure (default: zero-shot)")
    parser.add_argument(
        "--templates", metavar="FILE", help="zero-shot: prompt templates, one per line, '{}' marking the class name "
        f"(default: {len(DEFAULT_TEMPLATES)} CLIP templates such as {DEFAULT_TEMPLATES[0]!r})",
    )
    parser.add_argument(
        "--class-names", metavar="FILE", help="zero-shot: class names, one per line, line i naming label i (default: "
        "the sub-folder names, or the labels themselves when they are strings)",
    )
    parser.add_argument(
        "--image-column", metavar="NAME", help="the column of images (default: image), or of video frames for "
        "video-retrieval (default: frames)",
    )
    parser.add_argument("--text-column", default="text", metavar="NAME", help="retrieval: the column of captions")
    parser.add_argument("--label-column", default="label", metavar="NAME", help="zero-shot: the column of labels")
    parser.add_argument(
        "--resize-mode", choices=RESIZE_MODES,
        help="override the processor's resizing (the paper reports the better of square and center_crop)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="N", help="inputs per forward pass (default: 64)"
    )
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="evaluate N examples (items for retrieval), spread evenly"
    )
    parser.add_argument("--device", help="where the model runs (default: cuda when available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run_eval(args: argparse.Namespace) -> int:
    """`moezoo eval moe_vie` with the options of `add_eval_arguments`: results as tables, or as JSON with `--json`."""
    from transformers import AutoModel, AutoProcessor

    if args.task != "zero-shot" and (args.templates or args.class_names):
        raise ValueError("--templates and --class-names apply to --task zero-shot only")
    # The data (labels included) and templates are loaded and checked before the model, which takes longer to load.
    if args.task == "zero-shot":
        data = load_classification_data(
            args.data, args.image_column or "image", args.label_column, args.class_names, args.limit
        )
        evaluate = partial(
            zero_shot_classification, images=data.images, labels=data.labels, class_names=data.class_names,
            templates=load_templates(args.templates or DEFAULT_TEMPLATES), batch_size=args.batch_size,
        )
    else:
        modality = "video" if args.task == "video-retrieval" else "image"
        data = load_retrieval_data(args.data, modality, args.image_column, args.text_column, args.limit)
        evaluate = partial(
            retrieval, items=data.items, captions=data.captions, modality=modality, batch_size=args.batch_size
        )

    folder, _ = model_folder(args.model, "`moezoo eval moe_vie`", ["moe_vie"])
    model = AutoModel.from_pretrained(folder).to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    processor = AutoProcessor.from_pretrained(folder)
    if args.resize_mode:
        processor.image_processor.resize_mode = args.resize_mode
    results = {"model": str(args.model), "data": str(args.data), **evaluate(model, processor)}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_evaluation(results)
    return 0
