"""`moezoo eval moemb`: the MMEB and MRMR protocols (spec moemb.md §6.2, §9).

- **MMEB** (`--benchmark mmeb`): every query ranks its own candidate set, whose first candidate is the positive;
  the score of a task is its hit@1 (the positive ranked first). Data in MMEB's evaluation format (VLM2Vec /
  `TIGER-Lab/MMEB-eval`): one table per task with `qry_text`, `qry_img_path`, `tgt_text` (a list) and
  `tgt_img_path` (a list), and for MMEB-V2's video tasks `qry_video_path` / `tgt_video_path` (folders of decoded
  frames), paths relative to `--image-root`. Tasks are grouped into MMEB-V2's categories (image CLS / QA / RET / GD,
  video CLS / QA / RET / MRT); a table's optional `category` column names others. MMEB-V2's visual-document tasks
  (ViDoRe, VisRAG, ...) rank a corpus of page images, a subfolder of `query`, `corpus` and `qrels` tables as MRMR's
  below, scored by NDCG@5.
- **MRMR** (`--benchmark mrmr`): every query ranks its task's whole corpus; NDCG@10 with graded relevance from the
  qrels (trec_eval's linear gains), except the Negation subtask, scored by Hit@1 (Table 3's caption). Data in
  MRMR's format: per task a folder of `query`, `corpus` and `qrels` tables (`id`, `text`, `image`, `image 1`, ...,
  a `category` per query; `query_id`, `corpus_id`, `score`). The summary is the mean over subtasks (categories).

With `--action` (one or several, one per family), the model runs with inference-time adaptive computation (spec
§3.3-3.9, §3.12: `moezoo.configuration.moemb_adaptive`, packed varlen execution unless `--execution masked`) and the
results report its logical FLOPs saving S(a) over every forward of the evaluation beside the scores. `--action` may
be given several times: the evaluation then runs once at full compute and once per `--action`, and one table puts
each run's overall score, FLOPs saving, embeddings per second and speedup over full compute side by side (the paper's
Table 6). Every evaluation reports its throughput: the inputs embedded per second of model forward (the processor's
time left out).

Ranks break ties against the model: a wrong candidate scoring exactly as high as a right one ranks before it, so a
collapsed model (all embeddings equal) scores 0. Identical inputs are embedded once (MMEB repeats candidates).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from ..configuration.moemb_adaptive import AdaptiveSettings, check_adaptive_settings
from ..hub.sources import model_folder
from ..processors.moemb import mmeb_input, normalize_input
from ..processors.qwen_tokens import IMAGE_TOKEN
from ..terminal import console, print_table, progress_bar
from . import positive_int

BENCHMARKS = ("mmeb", "mrmr")
TABLE_SUFFIXES = (".parquet", ".jsonl", ".json")
NDCG_K = 10
VISDOC_NDCG_K = 5  # MMEB-V2 scores its visual-document tasks by NDCG@5
VISDOC_CATEGORY = "visual document"
HIT_AT_1_CATEGORIES = ("negation",)
# MMEB-V2's image and video tasks by category (paper Table 14; MMEB-V1's grouping of the 36 image tasks).
MMEB_CATEGORIES = {
    "image CLS": ("Country211", "HatefulMemes", "ImageNet-1K", "ImageNet-A", "ImageNet-R", "N24News", "ObjectNet",
                  "Place365", "SUN397", "VOC2007"),
    "image QA": ("A-OKVQA", "ChartQA", "DocVQA", "GQA", "InfographicsVQA", "OK-VQA", "ScienceQA", "TextVQA",
                 "Visual7W", "VizWiz"),
    "image RET": ("VisDial", "CIRR", "VisualNews_t2i", "VisualNews_i2t", "MSCOCO_t2i", "MSCOCO_i2t", "NIGHTS", "WebQA",
                  "FashionIQ", "Wiki-SS-NQ", "OVEN", "EDIS"),
    "image GD": ("MSCOCO", "RefCOCO", "RefCOCO-Matching", "Visual7W-Pointing"),
    "video CLS": ("Breakfast", "HMDB51", "Kinetics-700", "SmthSmthV2", "UCF101"),
    "video QA": ("ActivityNetQA", "EgoSchema", "MVBench", "NExTQA", "Video-MME"),
    "video RET": ("DiDeMo", "MSR-VTT", "MSVD", "VATEX", "YouCook2"),
    "video MRT": ("Charades-STA", "MomentSeeker", "QVHighlight"),
}  # fmt: skip
CATEGORY_OF_TASK = {task: category for category, tasks in MMEB_CATEGORIES.items() for task in tasks}
# MRMR writes images into interleaved texts as "<image 1>", "<image 2>", ...
MRMR_IMAGE_MARKER = re.compile(r"<image (\d+)>")


# --- embeddings ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def embed(model, processor, inputs: Sequence, batch_size: int = 16, max_length: int | None = None,
          progress: bool = True) -> torch.Tensor:  # fmt: skip
    """L2-normalised float32 embeddings `(len(inputs), D)` on the CPU of MoEMB inputs (texts or dicts, see
    `moezoo.processors.moemb`), `batch_size` at a time, each distinct input once. The model runs in eval mode and is
    put back in its previous mode; a transient progress bar shows on stderr when there is more than one batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    keys = [_input_key(item, index) for index, item in enumerate(inputs)]
    first = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
    distinct = [inputs[index] for index in first.values()]
    if not distinct:
        raise ValueError("no inputs to embed")
    was_training = model.training
    model.eval()
    chunks = []
    show = progress and len(distinct) > batch_size
    try:
        with progress_bar(transient=True) if show else nullcontext() as bar:
            task = bar.add_task("embedding", total=len(distinct)) if show else None
            for start in range(0, len(distinct), batch_size):
                batch = processor(distinct[start : start + batch_size], max_length=max_length).to(model.device)
                chunks.append(model(**batch).embeddings.float().cpu())
                if show:
                    bar.update(task, advance=len(chunks[-1]))
    finally:
        model.train(was_training)
    embeddings = torch.cat(chunks)
    # NaN compares false with everything, so it would rank every right answer first: a broken model must not score 1.
    if not torch.isfinite(embeddings).all():
        raise ValueError("the model gave non-finite embeddings (NaN or inf): check its weights and dtype")
    row_of_key = {key: row for row, key in enumerate(first)}
    return torch.nn.functional.normalize(embeddings[[row_of_key[key] for key in keys]], dim=-1)


def _input_key(item, index: int) -> str:
    """Equal for inputs that are the same: same texts, same image files (or the same image objects)."""
    item = normalize_input(item, index)
    images = [image if isinstance(image, str) else id(image) for image in item["images"]]
    video = item["video"] if isinstance(item["video"], str) else id(item["video"])
    return repr((item["instruction"], item["text"], images, video))


# --- metrics ------------------------------------------------------------------------------------------------------


def ranking(scores: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """Candidate indices `(Q, C)` best first: by score, ties broken against the model (less relevant first)."""
    by_relevance = torch.argsort(relevance, dim=-1, stable=True)
    by_score = torch.argsort(scores.gather(-1, by_relevance), dim=-1, descending=True, stable=True)
    return by_relevance.gather(-1, by_score)


def hit_at_1(scores: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """`(Q,)` 1.0 where the top-ranked candidate is relevant."""
    top = ranking(scores, relevance)[:, 0]
    return (relevance.gather(-1, top[:, None])[:, 0] > 0).float()


def ndcg_at_k(scores: torch.Tensor, relevance: torch.Tensor, k: int = NDCG_K) -> torch.Tensor:
    """`(Q,)` NDCG@k with linear gains, `sum_i rel_i / log2(i + 2)` over the top k over its ideal value (trec_eval's
    ndcg_cut); queries must have a relevant candidate."""
    k = min(k, scores.shape[-1])
    discounts = 1.0 / torch.log2(torch.arange(k, dtype=torch.float64) + 2)
    ranked = relevance.double().gather(-1, ranking(scores, relevance)[:, :k])
    ideal = relevance.double().sort(dim=-1, descending=True).values[:, :k]
    if (ideal[:, 0] <= 0).any():
        raise ValueError("NDCG needs at least one relevant candidate per query")
    return (ranked @ discounts) / (ideal @ discounts)


# --- MMEB ---------------------------------------------------------------------------------------------------------


def _load_table(path: Path):
    # Imported here: datasets is an optional extra (moezoo[train]) that only loading evaluation sets needs.
    from ..training.data import load_table

    return load_table(path)


def mmeb_tasks(source: str | Path, tasks: Sequence[str] | None = None) -> dict:
    """MMEB's tasks in `source` by name: candidate-set tables (a table file, or the table files of a folder, named
    after the file) and visual-document tasks (the folder's subfolders of `query`, `corpus` and `qrels` tables,
    ranked as a corpus)."""
    path = Path(source)
    if path.is_dir():
        tables = {p.stem: p for p in sorted(path.iterdir()) if p.is_file() and p.suffix in TABLE_SUFFIXES}
        corpora = {p.name: p for p in sorted(path.iterdir()) if is_corpus_task(p)}
    else:
        tables = {path.stem: path} if path.is_file() and path.suffix in TABLE_SUFFIXES else {}
        corpora = {}
    found = tables | corpora
    if not found:
        raise FileNotFoundError(
            f"{source}: expected a {'/'.join(TABLE_SUFFIXES)} table, or a folder of them (one per task) and of "
            "visual-document task folders (query, corpus and qrels tables)"
        )
    _check_task_names(found, tasks, source)
    return {
        name: item if name in corpora else _load_table(item)
        for name, item in found.items() if tasks is None or name in tasks
    }  # fmt: skip


def mmeb_inputs(table, image_root: str | Path | None, limit: int | None = None) -> tuple[list, list[list]]:
    """The queries of an MMEB evaluation table and each query's candidates (the positive first). `qry_text` and
    `tgt_text` (a list) are required; images (`qry_img_path`, `tgt_img_path`) and MMEB-V2's videos (`qry_video_path`,
    `tgt_video_path`: folders of frames) are optional columns, with an empty path for none."""
    columns = set(table.column_names)
    missing = [c for c in ("qry_text", "tgt_text") if c not in columns]
    if missing:
        raise ValueError(
            f"an MMEB evaluation table needs qry_text and tgt_text (and media paths: qry_img_path, tgt_img_path, "
            f"qry_video_path, tgt_video_path); missing {', '.join(missing)} (columns: {', '.join(table.column_names)})"
        )
    media = [column for column in ("tgt_img_path", "tgt_video_path") if column in columns]
    queries, candidates = [], []
    for index, row in enumerate(table.select(range(min(limit or len(table), len(table))))):
        count = len(row["tgt_text"]) if isinstance(row["tgt_text"], list) else 0
        # A null media list means no media for any candidate.
        lists = [row[column] for column in media if row[column] is not None]
        if count < 2 or any(not isinstance(value, list) or len(value) != count for value in lists):
            raise ValueError(
                f"query {index}: tgt_text and {' and '.join(media) or 'its media'} must be lists of the same "
                f"length, at least 2 candidates (got {', '.join(f'{c}={row[c]!r:.80}' for c in ['tgt_text', *media])})"
            )
        query = mmeb_input(row["qry_text"], row.get("qry_img_path"), image_root, row.get("qry_video_path"))
        images, videos = (row.get(column) or [None] * count for column in ("tgt_img_path", "tgt_video_path"))
        group = [mmeb_input(text, image, image_root, video)
                 for text, image, video in zip(row["tgt_text"], images, videos)]  # fmt: skip
        # Named here by query and candidate: the embedder would only count the distinct inputs of the whole task.
        for what, item in [("its query", query), *((f"candidate {i}", item) for i, item in enumerate(group))]:
            if item["text"] is None and "images" not in item and "video" not in item:
                raise ValueError(f"query {index}: {what} has no text, image or video")
        queries.append(query)
        candidates.append(group)
    return queries, candidates


def evaluate_mmeb(model, processor, source, image_root=None, tasks: Sequence[str] | None = None,
                  limit: int | None = None, batch_size: int = 16, max_length: int | None = None,
                  progress: bool = True) -> dict:  # fmt: skip
    """Per MMEB task and per category, and their means: hit@1 over each query's candidates for image and video tasks,
    NDCG@5 over the corpus for visual-document tasks (MMEB-V2's conventions). `image_root` defaults to the data's
    folder."""
    image_root = image_root if image_root is not None else _folder_of(source)
    rows = []
    for task, table in mmeb_tasks(source, tasks).items():
        if isinstance(table, Path):
            queries, scores, relevance = rank_corpus(model, processor, table, task, limit, batch_size, max_length,
                                                     progress)  # fmt: skip
            rows.append({"task": task, "category": VISDOC_CATEGORY, "metric": f"ndcg@{VISDOC_NDCG_K}",
                         "queries": len(queries), "score": float(ndcg_at_k(scores, relevance, VISDOC_NDCG_K).mean())})
            continue
        queries, candidates = mmeb_inputs(table, image_root, limit)
        query_embeds = embed(model, processor, queries, batch_size, max_length, progress)
        flat = [candidate for group in candidates for candidate in group]
        candidate_embeds = embed(model, processor, flat, batch_size, max_length, progress)
        hits, start = [], 0
        for query, group in zip(query_embeds, candidates):
            scores = candidate_embeds[start : start + len(group)] @ query
            relevance = torch.zeros(len(group))
            relevance[0] = 1
            hits.append(hit_at_1(scores[None], relevance[None]))
            start += len(group)
        category = table["category"][0] if "category" in table.column_names else CATEGORY_OF_TASK.get(task, "other")
        rows.append({"task": task, "category": category, "metric": "hit@1", "queries": len(queries),
                     "score": float(torch.cat(hits).mean())})  # fmt: skip
    return {"benchmark": "mmeb", "tasks": rows, **_summaries(rows)}


# --- ranking a corpus (MRMR, MMEB-V2's visual documents) ----------------------------------------------------------


def is_corpus_task(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f"qrels{suffix}").is_file() for suffix in TABLE_SUFFIXES)


def load_corpus_task(folder: str | Path) -> tuple:
    """The `query`, `corpus` and `qrels` tables of a task folder, checked: the columns the protocol reads, and ids that
    name one query or document each (a repeated document id would leave all its rows but one irrelevant, so a
    perfect model would lose points)."""
    folder = Path(folder)
    tables = {}
    for name, needed in (("query", ("id",)), ("corpus", ("id",)), ("qrels", ("query_id", "corpus_id", "score"))):
        found = [folder / f"{name}{suffix}" for suffix in TABLE_SUFFIXES if (folder / f"{name}{suffix}").is_file()]
        if not found:
            raise FileNotFoundError(f"{folder} has no {name} table ({', '.join(name + s for s in TABLE_SUFFIXES)})")
        tables[name] = _load_table(found[0])
        missing = [column for column in needed if column not in tables[name].column_names]
        if missing:
            raise ValueError(
                f"{found[0]} has no column {', '.join(missing)} (columns: {', '.join(tables[name].column_names)})"
            )
        if name != "qrels":
            repeated = [key for key, count in Counter(map(str, tables[name]["id"])).items() if count > 1]
            if repeated:
                raise ValueError(f"{found[0]} repeats the id(s) {', '.join(map(repr, repeated[:5]))}: make ids unique")
    return tables["query"], tables["corpus"], tables["qrels"]


def rank_corpus(model, processor, folder: Path, task: str, limit: int | None, batch_size: int,
                max_length: int | None, progress: bool) -> tuple[list, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The queries of a task folder that have a relevant document, their scores against the whole corpus `(Q, D)`
    and the graded relevance from the qrels `(Q, D)`."""
    query_table, corpus_table, qrels_table = load_corpus_task(folder)
    qrels = defaultdict(dict)
    for qrel in qrels_table:
        qrels[str(qrel["query_id"])][str(qrel["corpus_id"])] = float(qrel["score"])
    queries = [row for row in query_table if any(score > 0 for score in qrels[str(row["id"])].values())]
    queries = queries[:limit] if limit else queries
    if not queries:
        raise ValueError(f"task {task}: no query has a relevant document in the qrels")
    doc_ids = [str(row["id"]) for row in corpus_table]
    query_embeds, doc_embeds = (
        embed(model, processor, [mrmr_input(row, folder) for row in rows], batch_size, max_length, progress)
        for rows in (queries, corpus_table)
    )
    scores = query_embeds @ doc_embeds.t()
    column = {doc_id: index for index, doc_id in enumerate(doc_ids)}
    relevance = torch.zeros(scores.shape)
    for index, row in enumerate(queries):
        for doc_id, score in qrels[str(row["id"])].items():
            if doc_id not in column:
                raise ValueError(f"task {task}: the qrels name document {doc_id!r}, absent from the corpus")
            relevance[index, column[doc_id]] = score
    return queries, scores, relevance


# --- MRMR ---------------------------------------------------------------------------------------------------------


def mrmr_input(row: dict, base: Path | None) -> dict:
    """An MRMR query or document: its text and its images (`image`, `image 1`, `image 2`, ... columns: opened
    images, or paths relative to `base`), placed where the text's `<image N>` markers are, else before the text."""
    columns = [column for column in row if column == "image" or re.fullmatch(r"image \d+", column)]
    images = {column: row[column] for column in columns if row[column] not in (None, "")}
    text = row.get("text") or ""
    markers = [int(number) for number in MRMR_IMAGE_MARKER.findall(text)]
    if markers:
        ordered = [images.pop(f"image {number}") for number in markers if f"image {number}" in images]
        text = MRMR_IMAGE_MARKER.sub(IMAGE_TOKEN, text)
        images = ordered + list(images.values())
    else:
        images = list(images.values())
    images = [str(base / image) if isinstance(image, str) and base is not None else image for image in images]
    return {"text": text or None, "images": images}


def evaluate_mrmr(model, processor, source, tasks: Sequence[str] | None = None, limit: int | None = None,
                  batch_size: int = 16, max_length: int | None = None, hit_at_1_categories=HIT_AT_1_CATEGORIES,
                  progress: bool = True) -> dict:  # fmt: skip
    """NDCG@10 (Hit@1 for `hit_at_1_categories`) per MRMR task and per subtask (query category), and the mean over
    subtasks. `source` is a task folder or a folder of task folders."""
    source = Path(source)
    expected = "expected an MRMR task folder (query, corpus and qrels tables) or a folder of them"
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: {expected}")
    if is_corpus_task(source):
        folders = {source.name: source}
    else:
        folders = {p.name: p for p in sorted(source.iterdir()) if p.is_dir()}
    if not folders:
        raise FileNotFoundError(f"{source} holds no task folder: {expected}")
    _check_task_names(folders, tasks, source)
    hit_categories = {category.lower() for category in hit_at_1_categories}
    rows, per_category = [], defaultdict(list)
    for task, folder in folders.items():
        if tasks is not None and task not in tasks:
            continue
        queries, scores, relevance = rank_corpus(model, processor, folder, task, limit, batch_size, max_length,
                                                 progress)  # fmt: skip
        ndcg, hits = ndcg_at_k(scores, relevance), hit_at_1(scores, relevance)
        for index, row in enumerate(queries):
            category = row.get("category") or task
            per_category[task, category].append((ndcg[index].item(), hits[index].item()))
        rows.append({"task": task, "category": "all", "metric": f"ndcg@{NDCG_K}", "queries": len(queries),
                     "score": float(ndcg.mean())})  # fmt: skip
    subtasks = []
    for (task, category), values in per_category.items():
        use_hit = category.lower() in hit_categories
        scores = [hit if use_hit else ndcg for ndcg, hit in values]
        subtasks.append({"task": task, "category": category, "metric": "hit@1" if use_hit else f"ndcg@{NDCG_K}",
                         "queries": len(values), "score": sum(scores) / len(scores)})  # fmt: skip
    return {"benchmark": "mrmr", "tasks": rows, "categories": subtasks,
            "overall": sum(row["score"] for row in subtasks) / len(subtasks)}  # fmt: skip


# --- shared -------------------------------------------------------------------------------------------------------


def _summaries(rows: list[dict]) -> dict:
    """Per-category means of the task scores and the mean over all tasks."""
    by_category = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row["score"])
    categories = [{"category": category, "tasks": len(scores), "score": sum(scores) / len(scores)}
                  for category, scores in by_category.items()]  # fmt: skip
    return {"categories": categories, "overall": sum(row["score"] for row in rows) / len(rows)}


def _check_task_names(found: dict, tasks: Sequence[str] | None, source) -> None:
    unknown = sorted(set(tasks or ()) - set(found))
    if unknown:
        raise ValueError(f"{source} has no task {', '.join(unknown)}; it has {', '.join(sorted(found))}")


def _folder_of(source) -> Path:
    path = Path(source)
    return path if path.is_dir() else path.parent


def print_evaluation(results: dict) -> None:
    """Results of `evaluate_mmeb` / `evaluate_mrmr` as per-task and per-category tables with the overall score."""
    name = results["benchmark"].upper()
    print_table(f"{name} per task", ["task", "category", "metric", "queries", "score"],
                [[r["task"], r["category"], r["metric"], r["queries"], r["score"]] for r in results["tasks"]])
    if results["benchmark"] == "mmeb":
        print_table(f"{name} per category", ["category", "tasks", "mean score"],
                    [[r["category"], r["tasks"], r["score"]] for r in results["categories"]])
    else:
        print_table(f"{name} per subtask", ["task", "subtask", "metric", "queries", "score"],
                    [[r["task"], r["category"], r["metric"], r["queries"], r["score"]] for r in results["categories"]])
    over = "tasks" if results["benchmark"] == "mmeb" else "subtasks"
    console.print(f"{name} overall (mean over {over}): {results['overall']:.4f}")


# --- adaptive computation -----------------------------------------------------------------------------------------

# `--action` name -> (AdaptiveSettings family, method)
ACTIONS = {
    "gdn-prune": ("token_pruning", "gdn_beta"),
    "beta-skip": ("expert_skip", "beta_rank"),
    "beta-threshold": ("expert_skip", "beta_threshold"),
    "otsu-beta": ("expert_skip", "otsu_beta"),
    "otsu-logit": ("expert_skip", "otsu_router_logit"),
    "topk": ("top_k", "uniform"),
    "modes": ("top_k", "modes"),
    "threshold": ("top_k", "threshold"),
    # the trained gates of the model (`config.gates`, `moezoo train moemb --adaptive-recipe` / `--grpo`)
    "learned-prune": ("token_pruning", "learned"),
    "learned-skip": ("expert_skip", "learned"),
    "null-experts": ("top_k", "null_experts"),
    "layer-skip": ("layer_skip", "learned"),
    "greedy-policy": ("efficiency_policy", "greedy"),
}
# command-line option -> AdaptiveSettings field
ACTION_OPTIONS = {
    "keep": "keep_ratio",
    "prune_after_layer": "prune_after_layer",
    "skip_fraction": "skip_fraction",
    "beta_threshold": "beta_threshold",
    "otsu_min_cv": "otsu_min_cv",
    "k": "experts_per_token",
    "score_threshold": "score_threshold",
    "min_experts": "min_experts_per_token",
}


def action_settings(args: argparse.Namespace, actions: Sequence[str], model, processor) -> dict:
    """The adaptive settings of one `--action` (its methods, one per family, and the budget options), on top of the
    model's own (a MoEMB folder may store calibrated MoDES settings). `--target-skip` calibrates MoDES on
    `--calibration`."""
    settings = {}
    for action in actions:
        family, method = ACTIONS[action]
        if family in settings:
            raise ValueError(f"--action takes one {family} method, got {settings[family]!r} and {method!r}")
        settings[family] = method
    settings |= {field: getattr(args, option) for option, field in ACTION_OPTIONS.items()
                 if getattr(args, option) is not None}  # fmt: skip
    settings["execution"] = args.execution
    if settings.get("top_k") == "modes":
        settings |= modes_settings(args, model, processor)
    check_adaptive_settings(
        AdaptiveSettings.from_dict(settings), model.config.text_config, model.config.moe_variant, "--action: ",
        gates=model.config.gate_modules(),
    )
    return settings


def modes_settings(args: argparse.Namespace, model, processor) -> dict:
    """MoDES thresholds and layer scales: calibrated for `--target-skip` on `--calibration`, else the model's."""
    from ..conversion.moemb_expert_pruning import calibration_inputs
    from ..modeling.moemb_adaptive import calibrate_modes

    if args.target_skip is None:
        stored = AdaptiveSettings.from_dict(model.config.adaptive) or AdaptiveSettings()
        if stored.modes_thresholds is None:
            raise ValueError(
                "--action modes needs --target-skip and --calibration (MMEB training-format data with text and "
                "images) to calibrate MoDES, or a model whose config holds calibrated MoDES settings"
            )
        return {"modes_thresholds": stored.modes_thresholds, "modes_layer_scales": stored.modes_layer_scales}
    if not 0 <= args.target_skip < 1:
        raise ValueError(f"--target-skip {args.target_skip} must lie in [0, 1): the share of routed slots MoDES skips")
    if args.calibration is None:
        raise ValueError("--target-skip calibrates MoDES on --calibration FILE (MMEB training format): pass it")
    if args.modes_grid_points < 2:
        raise ValueError(f"--modes-grid-points {args.modes_grid_points} must be at least 2: each threshold grid runs "
                         "from 0 (no slot skipped) to the threshold that skips every slot")  # fmt: skip
    items = calibration_inputs(args.calibration, args.calibration_samples)
    batches = [processor(items[start : start + args.batch_size]).to(model.device)
               for start in range(0, len(items), args.batch_size)]  # fmt: skip
    calibrated = calibrate_modes(model, batches, args.target_skip, grid_points=args.modes_grid_points)
    return {key: calibrated[key] for key in ("modes_thresholds", "modes_layer_scales")}


class ForwardTally:
    """Sums, over every forward of `model` while the `with` block runs, the inputs embedded and the seconds spent
    (finished: a GPU is synchronised), and with adaptive computation the logical FLOPs and routed slots."""

    def __init__(self, model):
        self.model = model
        self.embeddings = 0
        self.seconds = self.flops = self.full_flops = self.routed_slots = self.executed_slots = 0.0

    def __enter__(self) -> ForwardTally:
        self.handles = [self.model.register_forward_pre_hook(self._start), self.model.register_forward_hook(self._stop)]
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, module, inputs) -> None:
        self._synchronize()
        self.started = time.perf_counter()

    def _stop(self, module, inputs, output) -> None:
        self._synchronize()
        self.seconds += time.perf_counter() - self.started
        self.embeddings += output.embeddings.shape[0]
        report = output.adaptive
        if report is not None:
            self.flops += report.flops.total
            self.full_flops += report.full_flops.total
            self.routed_slots += report.routed_slots
            self.executed_slots += report.executed_slots

    def _synchronize(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def throughput(self) -> dict:
        return {"embeddings": self.embeddings, "seconds": self.seconds,
                "embeddings_per_second": self.embeddings / self.seconds}  # fmt: skip

    def summary(self) -> dict:
        """The adaptive computation's logical FLOPs and slots over the forwards."""
        return {
            "flops_saving": 1 - self.flops / self.full_flops,
            "logical_gflops": self.flops / 1e9,
            "full_gflops": self.full_flops / 1e9,
            "slot_skip_ratio": 1 - self.executed_slots / self.routed_slots,
        }


# --- command line -------------------------------------------------------------------------------------------------


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo eval moemb`."""
    parser.add_argument("--model", required=True, metavar="DIR", help="a MoEMB model folder with its processor")
    parser.add_argument("--benchmark", choices=BENCHMARKS, required=True,
                        help="mmeb: hit@1 over each query's candidates (NDCG@5 for visual documents); mrmr: "
                             "NDCG@10 (Hit@1 for negation)")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="mmeb: a table (parquet/jsonl/json) in MMEB's evaluation format or a folder of them, one "
                             "per task, and of visual-document task folders; mrmr: a task folder with query, corpus "
                             "and qrels tables, or a folder of them")
    parser.add_argument("--image-root", metavar="DIR", help="mmeb: folder the image and video paths are relative to "
                        "(default: the data's folder); corpus tasks' paths are relative to their task folder")
    parser.add_argument("--tasks", nargs="+", metavar="TASK", help="evaluate these tasks only (default: all)")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="the first N queries of every task")
    parser.add_argument("--batch-size", type=positive_int, default=16, metavar="N")
    parser.add_argument("--max-length", type=positive_int, metavar="N", help="longest input in tokens")
    parser.add_argument("--hit-at-1-categories", nargs="+", default=list(HIT_AT_1_CATEGORIES), metavar="NAME",
                        help="mrmr: subtasks scored by Hit@1 instead of NDCG@10 (default: negation)")
    parser.add_argument("--device", help="where the model runs (default: cuda when available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    adaptive = parser.add_argument_group(
        "adaptive computation", "inference-time actions (spec §3); the results add the logical FLOPs saving"
    )
    adaptive.add_argument("--action", nargs="+", action="append", choices=list(ACTIONS), metavar="ACTION",
                          help="one per family: token pruning gdn-prune, learned-prune; expert skip beta-skip, "
                               "beta-threshold, otsu-beta, otsu-logit, learned-skip; top-k topk, modes, threshold, "
                               "null-experts; layer-skip; greedy-policy (e.g. modes gdn-prune; the learned ones need "
                               "the model's trained gates). Given several times: full compute and each one, compared "
                               "in one table")
    adaptive.add_argument("--execution", choices=["packed", "masked"], default="packed",
                          help="packed: the actions' savings become wall-clock time (spec §3.14); masked: the "
                               "reference, same embeddings")
    adaptive.add_argument("--keep", type=float, metavar="RHO", help="gdn-prune: share of visual tokens kept (0.5)")
    adaptive.add_argument("--prune-after-layer", type=int, metavar="K",
                          help="gdn-prune: the Gated DeltaNet block whose β ranks the tokens (4)")
    adaptive.add_argument("--skip-fraction", type=float, metavar="Q",
                          help="beta-skip: share of each input's tokens skipping the routed experts (0.3)")
    adaptive.add_argument("--beta-threshold", type=float, metavar="THETA", help="beta-threshold: θ (0.5)")
    adaptive.add_argument("--otsu-min-cv", type=float, metavar="C", help="otsu-*: the CV gate (0.1)")
    adaptive.add_argument("--k", type=int, metavar="K'", help="topk: routed experts kept per token")
    adaptive.add_argument("--score-threshold", type=float, metavar="TAU", help="threshold: τ on the routing weight")
    adaptive.add_argument("--min-experts", type=int, metavar="N", help="threshold: slots kept whatever their weight")
    adaptive.add_argument("--target-skip", type=float, metavar="T",
                          help="modes: calibrate MoDES for this share of routed slots skipped (needs --calibration)")
    adaptive.add_argument("--calibration", metavar="FILE", help="modes: MMEB training-format data with text and images")
    adaptive.add_argument("--calibration-samples", type=positive_int, default=16, metavar="N",
                          help="modes: calibration inputs, half text, half image (16)")
    adaptive.add_argument("--modes-grid-points", type=int, default=100, metavar="N",
                          help="modes: thresholds per grid of the calibration's frontier search, at most 2N passes "
                               "over the calibration inputs (100, the paper's)")


def run_eval(args: argparse.Namespace) -> int:
    from ..modeling.moemb import MoEmbForEmbedding
    from ..processors.moemb import MoEmbProcessor

    folder, _ = model_folder(args.model, "`moezoo eval moemb`", ["moemb"])
    model = MoEmbForEmbedding.from_pretrained(folder)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    processor = MoEmbProcessor.from_pretrained(folder)
    # Full compute first: the baseline of the actions' speedups.
    runs = [([], None)] + [(actions, action_settings(args, actions, model, processor))
                           for actions in args.action or []]  # fmt: skip
    options = {"tasks": args.tasks, "limit": args.limit, "batch_size": args.batch_size, "max_length": args.max_length}
    stored = model.config.adaptive
    evaluated = []
    for actions, settings in runs:
        model.config.adaptive = settings if settings is not None else stored  # what every forward runs with
        with ForwardTally(model) as tally:
            if args.benchmark == "mmeb":
                results = evaluate_mmeb(model, processor, args.data, image_root=args.image_root, **options)
            else:
                results = evaluate_mrmr(model, processor, args.data, hit_at_1_categories=args.hit_at_1_categories,
                                        **options)  # fmt: skip
        results = {"model": str(args.model), "data": str(args.data), **results, "throughput": tally.throughput()}
        if settings is not None:
            results["adaptive"] = {"actions": actions, "settings": settings, **tally.summary()}
        evaluated.append(results)
    model.config.adaptive = stored
    # One --action: its results (the full-compute run only feeds the table); none: the full-compute results.
    results = evaluated[-1] if len(evaluated) <= 2 else {"runs": evaluated}
    if len(evaluated) > 1:
        results["table"] = actions_table(evaluated)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for run in evaluated if len(evaluated) > 2 else evaluated[-1:]:
        print_evaluation(run)
        summary = run.get("adaptive")
        if summary is not None:
            console.print(
                f"adaptive computation ({' + '.join(summary['actions'])}): logical FLOPs saving S(a) = "
                f"{summary['flops_saving']:.1%} ({summary['logical_gflops']:.4g} of {summary['full_gflops']:.4g} "
                f"GFLOPs), routed slots skipped {summary['slot_skip_ratio']:.1%}"
            )
    if len(evaluated) > 1:
        print_table("adaptive computation: accuracy, FLOPs and throughput",
                    ["actions", "overall", "FLOPs saving", "embeddings/s", "speedup"],
                    [[row["actions"], row["overall"], f"{row['flops_saving']:.1%}", row["embeddings_per_second"],
                      f"{row['speedup']:.2f}×"] for row in results["table"]])  # fmt: skip
    return 0


def actions_table(evaluated: list[dict]) -> list[dict]:
    """One row per run (the first at full compute): overall score, FLOPs saving, embeddings per second and the
    speedup over the full-compute run's embeddings per second (the paper's Table 6)."""
    full_speed = evaluated[0]["throughput"]["embeddings_per_second"]
    rows = []
    for run in evaluated:
        adaptive = run.get("adaptive") or {"actions": [], "flops_saving": 0.0}
        speed = run["throughput"]["embeddings_per_second"]
        rows.append({"actions": " + ".join(adaptive["actions"]) or "full compute", "overall": run["overall"],
                     "flops_saving": adaptive["flops_saving"], "embeddings_per_second": speed,
                     "speedup": speed / full_speed})  # fmt: skip
    return rows
