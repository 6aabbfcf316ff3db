"""`moezoo eval omnimoe_vl`: the OmniMoE-VL paper's evaluation protocols on a JSONL file of image questions (spec
omnimoe_vl.md §7; the format is in docs/data_formats.md).

- **VQA** (`--task vqa`, spec §7.1): multiple-choice rows are answered by the choice whose text has the lowest mean
  negative log-likelihood per token as the assistant's answer (teacher-forced: no answer parsing, the same for every
  model); open-answer rows by greedy generation, scored by normalised exact match against any reference answer or
  by VQA accuracy (`min(1, matching references / 3)`, VQAv2/TextVQA's over their ten human answers). Scores are on a
  0-100 scale per task (a row's `task`, default the file's name), and the average is the mean over tasks (Eq. 19).
- **Utilisation** (`--task utilization`, spec §7.7, paper B.6 and Figure 3): over the prompts, each MoE block's
  expert-selection frequencies normalised within the block, separately for the language and the vision stack; per
  depth the share of samples whose route selects it and its mean route weight; the route entropy. Written as PNG
  heatmaps too (`--out`).
- **Question-conditioned visual access** (`--task access`, spec §7.5, Table 5): the total-variation distance
  `D_TV = ½‖w(q) − w(q')‖₁` between the routes of two questions about one image (Eq. 15), for different questions
  and for paraphrases (rows of one image with the same `target`), averaged over the pairs of a target, then over
  the targets of an image, then over images, each image weighing the same; and route interventions (Table 5b): the
  change in teacher-forced NLL of a row's reference answer, in nats per answer token, when the fusion route, the
  injection route or both are replaced by a paraphrase's or another question's route of the same image (Eq. 16),
  through the model's `route_override`. The native route given as an override changes nothing (ΔNLL = 0, spec §9.6).

Answer tokens are the assistant answer's, without the closing `<|im_end|>`. Everything runs in eval mode, which the
model leaves afterwards in its previous mode.
"""

from __future__ import annotations

import argparse
import json
import re
import string
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import torch
from torch.nn import functional as F

from ..hub.sources import model_folder
from ..modeling.moe.statistics import plot_routing_heatmap, record_routing
from ..processors.images import open_image
from ..terminal import console, print_table, progress_bar
from . import positive_int

TASKS = ("vqa", "utilization", "access")
OPEN_METRICS = ("exact", "vqa")
# Table 5b's route interventions: (fusion route, injection route), each the row's own ("native"), a paraphrase's or
# another question's about the same image.
INTERVENTIONS = (
    ("native", "native"),
    ("paraphrase", "paraphrase"),
    ("other", "native"),
    ("native", "other"),
    ("other", "other"),
)
VQA_HUMAN_ANSWERS = 3  # VQA accuracy: an answer that 3 references give scores 1
ARTICLES = re.compile(r"\b(a|an|the)\b")
IM_END = "<|im_end|>"
IGNORE_INDEX = -100


# --- data -------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VqaExample:
    """One row of the JSONL file."""

    line: int  # 1-based line of the file, for messages
    image: Path
    question: str
    task: str  # the benchmark the row belongs to, for the per-task scores and their average (Eq. 19)
    target: str  # what the question asks about: rows of one image with the same target are paraphrases
    answers: tuple[str, ...]  # the reference answers; for a multiple-choice row the correct choice
    choices: tuple[str, ...] | None = None  # None for an open answer

    @property
    def reference(self) -> str:
        """The answer the NLL of route interventions is measured on."""
        return self.answers[0]


def load_vqa_examples(path: str | Path, limit: int | None = None) -> list[VqaExample]:
    """The rows of a JSONL file, checked: each names an existing `image` (relative to the file's folder), a
    `question`, and either `choices` (at least 2 distinct texts) with the correct `answer` (its index or its text) or
    `answers` (a text or a list of reference texts); optionally a `task` and a `target`. Errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}: give a JSONL file of image questions (docs/data_formats.md)")
    examples = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not JSON ({error.msg}): write one JSON object per line") from error
        if not isinstance(row, dict):
            raise ValueError(f"{where} must be a JSON object with image, question and choices or answers")
        examples.append(_example(row, where, number, path.parent, default_task=path.stem))
        if limit is not None and len(examples) == limit:
            break
    if not examples:
        raise ValueError(f"{path} holds no rows")
    return examples


def _example(row: dict, where: str, line: int, folder: Path, default_task: str) -> VqaExample:
    for field in ("image", "question"):
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise ValueError(f"{where}: {field!r} must be a non-empty string, got {row.get(field)!r}")
    image = folder / row["image"]
    if not image.is_file():
        raise FileNotFoundError(f"{where}: no image file {image} (image paths are relative to the data file's folder)")
    if ("choices" in row) == ("answers" in row):
        raise ValueError(
            f"{where}: give either 'choices' with the correct 'answer' (multiple choice) or 'answers' (open answer)"
        )
    task, target = row.get("task", default_task), row.get("target", f"line {line}")
    for field, value in (("task", task), ("target", target)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: {field!r} must be a non-empty string, got {value!r}")
    if "answers" in row:
        answers = [row["answers"]] if isinstance(row["answers"], str) else row["answers"]
        if not isinstance(answers, list) or not answers or not all(_is_text(answer) for answer in answers):
            raise ValueError(
                f"{where}: 'answers' must be a non-empty string or list of non-empty strings, got {row['answers']!r}"
            )
        return VqaExample(line, image, row["question"], task, target, tuple(answers))
    choices = row["choices"]
    if (
        not isinstance(choices, list) or not 2 <= len(choices) <= len(string.ascii_uppercase)
        or not all(map(_is_text, choices)) or len(set(choices)) < len(choices)
    ):
        raise ValueError(
            f"{where}: 'choices' must be a list of 2 to 26 distinct non-empty strings (options A to Z), got {choices!r}"
        )
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        answer = choices[answer]
    if answer not in choices:
        raise ValueError(
            f"{where}: 'answer' must be the index (0 to {len(choices) - 1}) or the text of the correct choice, got "
            f"{row.get('answer')!r}"
        )
    return VqaExample(line, image, row["question"], task, target, (answer,), tuple(choices))


def _is_text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def multiple_choice_prompt(example: VqaExample) -> str:
    """The question followed by its options, one per line: `A. red`."""
    options = "\n".join(f"{string.ascii_uppercase[i]}. {choice}" for i, choice in enumerate(example.choices))
    return f"{example.question}\n{options}"


def normalize_answer(text: str) -> str:
    """Lower case, without punctuation, articles and extra spaces (the VQA evaluation's normalisation, simplified)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(ARTICLES.sub(" ", text).split())


def open_answer_score(prediction: str, references: Sequence[str], metric: str = "exact") -> float:
    """1 if the prediction matches a reference ("exact"), or `min(1, matches / 3)` ("vqa"), after normalisation."""
    if metric not in OPEN_METRICS:
        raise ValueError(f"the open-answer metric must be one of {', '.join(OPEN_METRICS)}, got {metric!r}")
    matches = sum(normalize_answer(prediction) == normalize_answer(reference) for reference in references)
    return float(matches > 0) if metric == "exact" else min(1.0, matches / VQA_HUMAN_ANSWERS)


# --- model passes -----------------------------------------------------------------------------------------------------


@contextmanager
def _eval_mode(model) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _batches(items: Sequence, batch_size: int, description: str, progress: bool) -> Iterator[Sequence]:
    """`items` in chunks of `batch_size`, with a transient progress bar on stderr when there is more than one."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    show = progress and len(items) > batch_size
    with progress_bar(transient=True) if show else nullcontext() as bar:
        task = bar.add_task(description, total=len(items)) if show else None
        for start in range(0, len(items), batch_size):
            yield items[start : start + batch_size]
            if show:
                bar.update(task, advance=min(batch_size, len(items) - start))


def _inputs(model, processor, examples: Sequence[VqaExample], questions: Sequence[str], answers=None):
    """A processor batch of the examples' images and questions, with the answers as assistant turns when given (and
    then `labels` on the answer tokens, without `<|im_end|>`)."""
    texts = []
    for index, question in enumerate(questions):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        if answers is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[index]}]})
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=answers is None))
    images = [open_image(example.image) for example in examples]
    # Left padding (the processor's default, asked for all the same): batched generation needs it, and `answer_nll`
    # relies on every answer ending its row.
    inputs = processor(images=images, text=texts, padding=True, padding_side="left", return_tensors="pt",
                       return_labels=answers is not None)
    if answers is not None:
        labels = inputs["labels"]
        labels[labels == processor.tokenizer.convert_tokens_to_ids(IM_END)] = IGNORE_INDEX
    return inputs.to(model.device)


def answer_nll(model, processor, examples: Sequence[VqaExample], questions: Sequence[str], answers: Sequence[str],
               route_override: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Teacher-forced mean NLL per answer token `(B,)` of `answers` to `questions` about the examples' images, and the
    depth routes `(B, S)` of the forward (the rows' own, whatever `route_override` replaces)."""
    inputs = _inputs(model, processor, examples, questions, answers)
    labels = inputs.pop("labels")
    # Left padding puts every answer at the end: the logits of the last positions are all the loss needs.
    answer_start = int((labels != IGNORE_INDEX).float().argmax(dim=1).min())
    keep = labels.shape[1] - answer_start + 1
    outputs = model(**inputs, route_override=route_override, logits_to_keep=keep)
    logits, targets = outputs.logits[:, :-1].float(), labels[:, -keep + 1 :]
    token_nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    answer_tokens = (targets != IGNORE_INDEX).sum(dim=1)
    return (token_nll.sum(dim=1) / answer_tokens).cpu(), outputs.depth_route.float().cpu()


def prompt_routes(model, processor, examples: Sequence[VqaExample], batch_size: int = 8,
                  progress: bool = True) -> torch.Tensor:  # fmt: skip
    """The depth route w `(N, S)` of every example's prompt (its question, with the options of a multiple-choice
    row), as generation computes it at prefill."""
    routes = []
    for batch in _batches(examples, batch_size, "routes", progress):
        inputs = _inputs(model, processor, batch, [_question(example) for example in batch])
        routes.append(model(**inputs, logits_to_keep=1).depth_route.float().cpu())
    return torch.cat(routes)


def _question(example: VqaExample) -> str:
    return example.question if example.choices is None else multiple_choice_prompt(example)


# --- VQA --------------------------------------------------------------------------------------------------------------


def evaluate_vqa(model, processor, examples: Sequence[VqaExample], batch_size: int = 8, max_new_tokens: int = 16,
                 open_metric: str = "exact", progress: bool = True) -> dict:  # fmt: skip
    """Per row its prediction and score (0 or 1, VQA accuracy in [0, 1]); per task the mean score on 0-100; and the
    average over tasks (Eq. 19)."""
    rows = {}
    with _eval_mode(model):
        choice_rows = [example for example in examples if example.choices is not None]
        pairs = [(example, choice) for example in choice_rows for choice in example.choices]
        nll = []
        for batch in _batches(pairs, batch_size, "choices", progress):
            scored = [example for example, _ in batch]
            questions = [_question(example) for example in scored]
            nll.append(answer_nll(model, processor, scored, questions, [choice for _, choice in batch])[0])
        nll = torch.cat(nll) if nll else torch.empty(0)
        start = 0
        for example in choice_rows:
            # The lowest NLL wins; a tie goes to the earlier choice (stable, the same on every run).
            predicted = example.choices[int(torch.argmin(nll[start : start + len(example.choices)]))]
            rows[example.line] = {"prediction": predicted, "score": float(predicted == example.reference)}
            start += len(example.choices)
        open_rows = [example for example in examples if example.choices is None]
        tokenizer = processor.tokenizer
        for batch in _batches(open_rows, batch_size, "answers", progress):
            inputs = _inputs(model, processor, batch, [example.question for example in batch])
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            answers = processor.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            for example, answer in zip(batch, answers):
                answer = answer.strip()
                rows[example.line] = {"prediction": answer, "score": open_answer_score(answer, example.answers,
                                                                                       open_metric)}  # fmt: skip
    per_row = [{"line": example.line, "task": example.task, "kind": "open" if example.choices is None else "choice",
                **rows[example.line]} for example in examples]  # fmt: skip
    by_task = defaultdict(list)
    for row in per_row:
        by_task[row["task"]].append(row["score"])
    tasks = [{"task": task, "examples": len(scores), "score": 100 * sum(scores) / len(scores)}
             for task, scores in by_task.items()]  # fmt: skip
    return {"open_metric": open_metric, "rows": per_row, "tasks": tasks,
            "average": sum(task["score"] for task in tasks) / len(tasks)}  # fmt: skip


# --- utilisation ------------------------------------------------------------------------------------------------------


def route_entropy(routes: torch.Tensor) -> torch.Tensor:
    """`-sum_s w_s log w_s` of each route `(N, S)` in nats (`0 log 0 = 0`)."""
    return -torch.special.xlogy(routes, routes).sum(dim=-1)


def evaluate_utilization(model, processor, examples: Sequence[VqaExample], batch_size: int = 8,
                         out: str | Path | None = None, progress: bool = True) -> dict:  # fmt: skip
    """Expert-selection frequencies per MoE block (each block's row sums to 1), split into the language and the
    vision stack; per depth the selection frequency and mean weight of the route; the route entropy (mean over samples)
    and the entropy of the mean route. With `out`, heatmaps of both are written there as PNG files."""
    with _eval_mode(model), record_routing(model) as stats:
        routes = prompt_routes(model, processor, examples, batch_size, progress)
    fractions = stats.fractions()
    stacks = {"lm": "model.language_model.", "vision": "model.vision_tower."}
    experts = {stack: {name.removeprefix(prefix): fractions[name][0].tolist() for name in fractions
                       if name.startswith(prefix)} for stack, prefix in stacks.items()}  # fmt: skip
    mean_route = routes.mean(dim=0)
    result = {
        "samples": len(examples),
        "depth": {
            "selection_frequency": (routes > 0).float().mean(dim=0).tolist(),
            "mean_weight": mean_route.tolist(),
            "route_entropy": float(route_entropy(routes).mean()),
            "entropy_of_mean_route": float(route_entropy(mean_route)),
        },
        **experts,
    }
    if out is not None:
        out = Path(out)
        result["plots"] = [
            str(plot_routing_heatmap(stats, out / "experts.png", "expert-selection frequency per MoE block")),
            str(plot_depth_utilization(result["depth"], out / "depths.png")),
        ]
    return result


def plot_depth_utilization(depth: dict, path: str | Path) -> Path:
    """A heatmap of the route per depth (columns S0, S1, ...): its selection frequency and its mean weight."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plotting the depth utilisation needs matplotlib: pip install matplotlib") from error

    rows = {"selection frequency": depth["selection_frequency"], "mean weight": depth["mean_weight"]}
    grid = torch.tensor(list(rows.values())).numpy()
    num_depths = grid.shape[1]
    fig, axis = plt.subplots(figsize=(max(4.0, 0.7 * num_depths + 2), 2.4))
    image = axis.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    for (row, column), value in zip(((r, c) for r in range(grid.shape[0]) for c in range(num_depths)), grid.flat):
        axis.text(column, row, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black",
                  fontsize=8)  # fmt: skip
    axis.set_xticks(range(num_depths), [f"S{s}" for s in range(num_depths)])
    axis.set_yticks(range(len(rows)), list(rows))
    axis.set_title(f"depth route (entropy {depth['route_entropy']:.2f} nats per sample)")
    fig.colorbar(image, ax=axis)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# --- question-conditioned visual access -------------------------------------------------------------------------------


def total_variation(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Eq. 15: `½‖w − w'‖₁` over the last dimension, in [0, 1] for two routes."""
    return 0.5 * (first - second).abs().sum(dim=-1)


def route_distances(examples: Sequence[VqaExample], routes: torch.Tensor) -> dict:
    """Mean D_TV between the routes of different questions and of paraphrases (same `target`) about one image: per
    target the mean over its pairs, per image the mean over its targets, then the mean over images (Table 5a's
    aggregation), with `gap` = different - paraphrases (ΔD)."""
    per_image = {"different": [], "paraphrase": []}
    for rows in _rows_by_image(examples).values():
        per_target = {"different": [], "paraphrase": []}
        for target, members in _rows_by_target(examples, rows).items():
            others = [row for row in rows if examples[row].target != target]
            for kind, pairs in (("different", [(a, b) for a in members for b in others]),
                                ("paraphrase", list(combinations(members, 2)))):  # fmt: skip
                if pairs:
                    distances = [float(total_variation(routes[a], routes[b])) for a, b in pairs]
                    per_target[kind].append(sum(distances) / len(distances))
        for kind, values in per_target.items():
            if values:
                per_image[kind].append(sum(values) / len(values))
    if not per_image["different"] and not per_image["paraphrase"]:
        raise ValueError(
            "route distances need two questions about one image: give rows with the same image path (and, for "
            "paraphrases, the same target)"
        )
    means = {kind: sum(values) / len(values) if values else None for kind, values in per_image.items()}
    gap = None if None in means.values() else means["different"] - means["paraphrase"]
    return {"different_questions": means["different"], "paraphrases": means["paraphrase"], "gap": gap,
            "images": len(per_image["different"]), "paraphrase_images": len(per_image["paraphrase"])}  # fmt: skip


def route_interventions(model, processor, examples: Sequence[VqaExample], routes: torch.Tensor, batch_size: int = 8,
                        progress: bool = True) -> list[dict]:  # fmt: skip
    """Table 5b: per (fusion, injection) route source, the mean ΔNLL of the rows' reference answers against their
    native routes, over the rows that have such a partner (a paraphrase: another row of the image with the same
    target; another question: the image's first row with another target). The partners' routes are those of
    `prompt_routes`; "native" is the row's own route of the same forward."""
    partners = {"paraphrase": {}, "other": {}}
    for rows in _rows_by_image(examples).values():
        for row in rows:
            same = [other for other in rows if other != row and examples[other].target == examples[row].target]
            different = [other for other in rows if examples[other].target != examples[row].target]
            if same:
                partners["paraphrase"][row] = same[0]
            if different:
                partners["other"][row] = different[0]
    rows = sorted(set(partners["paraphrase"]) | set(partners["other"]))
    if not rows:
        raise ValueError("route interventions need two questions about one image: give rows with the same image path")
    deltas = defaultdict(list)
    with _eval_mode(model):
        for batch in _batches(rows, batch_size, "route interventions", progress):
            batch_examples = [examples[row] for row in batch]
            questions, answers = [_question(e) for e in batch_examples], [e.reference for e in batch_examples]
            native_nll, native = answer_nll(model, processor, batch_examples, questions, answers)
            for fusion, injection in INTERVENTIONS:
                # Rows without the partner a condition needs keep their own route and are left out of its mean.
                has_partner = torch.tensor([all(source == "native" or row in partners[source]
                                                for source in (fusion, injection)) for row in batch])  # fmt: skip
                if not has_partner.any():
                    continue
                override = {
                    use: torch.stack([routes[partners[source][row]] if source != "native" and has_partner[i]
                                      else native[i] for i, row in enumerate(batch)])  # fmt: skip
                    for use, source in (("fusion", fusion), ("injection", injection))
                }
                nll, _ = answer_nll(model, processor, batch_examples, questions, answers, override)
                deltas[fusion, injection].extend((nll - native_nll)[has_partner].tolist())
    return [{"fusion": fusion, "injection": injection, "rows": len(deltas[fusion, injection]),
             "delta_nll": sum(deltas[fusion, injection]) / len(deltas[fusion, injection])}
            for fusion, injection in INTERVENTIONS if deltas[fusion, injection]]  # fmt: skip


def _rows_by_image(examples: Sequence[VqaExample]) -> dict[Path, list[int]]:
    by_image = defaultdict(list)
    for index, example in enumerate(examples):
        by_image[example.image.resolve()].append(index)
    return by_image


def _rows_by_target(examples: Sequence[VqaExample], rows: Sequence[int]) -> dict[str, list[int]]:
    by_target = defaultdict(list)
    for row in rows:
        by_target[examples[row].target].append(row)
    return by_target


def evaluate_access(model, processor, examples: Sequence[VqaExample], batch_size: int = 8,
                    progress: bool = True) -> dict:  # fmt: skip
    """Route distances (Table 5a) and route interventions (Table 5b)."""
    with _eval_mode(model):
        routes = prompt_routes(model, processor, examples, batch_size, progress)
    return {"route_distances": route_distances(examples, routes),
            "interventions": route_interventions(model, processor, examples, routes, batch_size, progress)}


# --- output and command line ------------------------------------------------------------------------------------------


EVALUATIONS: dict[str, Callable] = {"vqa": evaluate_vqa, "utilization": evaluate_utilization,
                                    "access": evaluate_access}  # fmt: skip


def print_evaluation(results: dict) -> None:
    """The results of `run_evaluation` as tables."""
    if "vqa" in results:
        vqa = results["vqa"]
        print_table(f"VQA (open answers: {vqa['open_metric']} match)", ["task", "examples", "score (0-100)"],
                    [[t["task"], t["examples"], t["score"]] for t in vqa["tasks"]])  # fmt: skip
        console.print(f"average over {len(vqa['tasks'])} task(s) (Eq. 19): {vqa['average']:.2f}")
    if "utilization" in results:
        depth = results["utilization"]["depth"]
        print_table("depth utilisation", ["depth", "selection frequency", "mean weight"],
                    [[f"S{s}", frequency, weight] for s, (frequency, weight)
                     in enumerate(zip(depth["selection_frequency"], depth["mean_weight"]))])  # fmt: skip
        for stack in ("lm", "vision"):
            blocks = results["utilization"][stack]
            if blocks:
                num_experts = max(map(len, blocks.values()))
                print_table(f"{'language' if stack == 'lm' else 'vision'} experts: selection frequency per block",
                            ["block", *(f"e{e}" for e in range(num_experts))],
                            [[name, *shares] for name, shares in blocks.items()])  # fmt: skip
        console.print(f"route entropy: {depth['route_entropy']:.3f} nats per sample, of the mean route "
                      f"{depth['entropy_of_mean_route']:.3f}")  # fmt: skip
        for plot in results["utilization"].get("plots", []):
            console.print(f"wrote {plot}", markup=False)
    if "access" in results:
        distances = results["access"]["route_distances"]
        print_table("route distance D_TV between questions about one image (Eq. 15)",
                    ["different questions", "paraphrases", "gap", "images"],
                    [[distances["different_questions"], distances["paraphrases"], distances["gap"],
                      distances["images"]]])  # fmt: skip
        print_table("route interventions: ΔNLL of the reference answer, nats per token (Eq. 16)",
                    ["fusion route", "injection route", "rows", "ΔNLL"],
                    [[r["fusion"], r["injection"], r["rows"], r["delta_nll"]]
                     for r in results["access"]["interventions"]])  # fmt: skip


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `moezoo eval omnimoe_vl`."""
    parser.add_argument("--model", required=True, metavar="DIR", help="an OmniMoE-VL model folder with its processor")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="a JSONL file of image questions: image, question, and choices + answer or answers "
                             "(optional task and target; docs/data_formats.md)")  # fmt: skip
    parser.add_argument("--task", nargs="+", choices=TASKS, default=list(TASKS),
                        help="vqa: scores per task and their average; utilization: experts and depths selected; "
                             "access: route distances and interventions (default: all three)")  # fmt: skip
    parser.add_argument("--open-metric", choices=OPEN_METRICS, default="exact",
                        help="open answers: exact (matches a reference) or vqa (min(1, matching references / 3))")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N",
                        help="longest generated open answer")
    parser.add_argument("--out", default="omnimoe_vl_eval", metavar="DIR",
                        help="where the utilisation heatmaps are written (default: omnimoe_vl_eval)")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="the first N rows")
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="N")
    parser.add_argument("--device", help="where the model runs (default: cuda when available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run_evaluation(model, processor, examples: Sequence[VqaExample], tasks: Sequence[str] = TASKS,
                   batch_size: int = 8, max_new_tokens: int = 16, open_metric: str = "exact",
                   out: str | Path | None = None, progress: bool = True) -> dict:  # fmt: skip
    """The results of each of `tasks`, by name."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    options = {"vqa": {"max_new_tokens": max_new_tokens, "open_metric": open_metric}, "utilization": {"out": out},
               "access": {}}  # fmt: skip
    return {task: EVALUATIONS[task](model, processor, examples, batch_size=batch_size, progress=progress,
                                    **options[task]) for task in TASKS if task in tasks}  # fmt: skip


def run_eval(args: argparse.Namespace) -> int:
    """`moezoo eval omnimoe_vl` with the options of `add_eval_arguments`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    examples = load_vqa_examples(args.data, args.limit)  # checked before the model, which takes longer to load
    folder, _ = model_folder(args.model, "`moezoo eval omnimoe_vl`", ["omnimoe_vl"])
    model = AutoModelForImageTextToText.from_pretrained(folder)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    processor = AutoProcessor.from_pretrained(folder)
    results = run_evaluation(model, processor, examples, args.task, args.batch_size, args.max_new_tokens,
                             args.open_metric, args.out)  # fmt: skip
    results = {"model": str(args.model), "data": str(args.data), "examples": len(examples), **results}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_evaluation(results)
    return 0
