"""MoEMB evaluation: the metrics against their formulas, the MMEB and MRMR protocols on synthetic sets in those
benchmarks' formats (with an embedder whose answers are known, and with the tiny model), and the command."""

import argparse
import json
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.evaluation.moemb import (
    add_eval_arguments,
    embed,
    evaluate_mmeb,
    evaluate_mrmr,
    hit_at_1,
    mmeb_inputs,
    mrmr_input,
    ndcg_at_k,
    run_eval,
)
from moezoo.modeling import moemb_adaptive
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.processors.qwen_tokens import IMAGE_TOKEN
from moezoo.training.moemb_synthetic import ShapeRetrieval

CONFIG = MoEmbConfig(**TINY_MOEMB)
COLOURS = ("red", "green", "blue", "yellow")


@pytest.fixture(scope="module")
def processor():
    return make_moemb_processor(CONFIG)


class ColourWords(torch.nn.Module):
    """An embedder with known answers: the counts of the colour words in each input's text, or one constant vector
    (`collapsed`), whatever the images."""

    def __init__(self, processor, collapsed: bool = False):
        super().__init__()
        self.tokenizer, self.collapsed = processor.tokenizer, collapsed

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, input_ids, **inputs):
        texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        counts = torch.tensor([[float(text.count(colour)) for colour in COLOURS] for text in texts])
        return SimpleNamespace(embeddings=torch.ones_like(counts) if self.collapsed else counts)


# --- metrics ---------------------------------------------------------------------------------------------------------


def test_ndcg_and_hit_at_1_follow_their_formulas():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4]])
    relevance = torch.tensor([[0.0, 2.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # Row 0 ranks 0, 1, 2, 3: gains 0, 2, 0, 1; ideal 2, 1. Row 1 ranks the relevant document last.
    dcg = 2 / math.log2(3) + 1 / math.log2(5)
    ideal = 2 / math.log2(2) + 1 / math.log2(3)
    expected = torch.tensor([dcg / ideal, (1 / math.log2(5)) / 1.0], dtype=torch.float64)
    torch.testing.assert_close(ndcg_at_k(scores, relevance, k=10), expected)
    assert ndcg_at_k(scores, relevance, k=1).tolist() == [0.0, 0.0]
    assert hit_at_1(scores, relevance).tolist() == [0.0, 0.0]
    assert hit_at_1(scores, relevance.flip(-1)).tolist() == [1.0, 1.0]
    # Ties go against the model: equal scores rank the relevant candidates last.
    tied = torch.zeros(1, 4)
    assert hit_at_1(tied, relevance[:1]).item() == 0.0
    torch.testing.assert_close(
        ndcg_at_k(tied, relevance[:1]),
        torch.tensor([(1 / math.log2(4) + 2 / math.log2(5)) / ideal], dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="at least one relevant"):
        ndcg_at_k(scores, torch.zeros(2, 4))


def test_embed_batches_deduplicates_and_restores_the_mode(tiny_moemb, processor):
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb).train()
    texts = ["a red circle", "a blue square", "a red circle", "a green cross", "a blue square"]
    embeddings = embed(model, processor, texts, batch_size=2, progress=False)
    assert model.training
    model.eval()
    with torch.no_grad():
        direct = model(**processor(texts)).embeddings
    torch.testing.assert_close(embeddings, direct, atol=1e-5, rtol=1e-4)
    assert torch.equal(embeddings[0], embeddings[2])
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(5))


# --- MMEB ------------------------------------------------------------------------------------------------------------


def colour_task(num_queries=6):
    """Text queries naming a colour against the 4 colour captions, the positive first (MMEB's format)."""
    rows = []
    for index in range(num_queries):
        order = [COLOURS[(index + shift) % 4] for shift in range(4)]
        rows.append({"qry_text": f"Find the caption: {order[0]}", "qry_img_path": "",
                     "tgt_text": [f"a {colour} thing" for colour in order], "tgt_img_path": [""] * 4})  # fmt: skip
    return Dataset.from_list(rows)


def test_mmeb_protocol_scores_hit_at_1_per_task_and_category(processor, tmp_path):
    colour_task().to_json(tmp_path / "ImageNet-1K.jsonl")
    # The same queries with the candidates rotated: the positive (first) is now always the wrong colour.
    wrong = colour_task().map(lambda row: {"tgt_text": row["tgt_text"][1:] + row["tgt_text"][:1]})
    wrong.to_json(tmp_path / "MSCOCO_t2i.jsonl")
    results = evaluate_mmeb(ColourWords(processor), processor, tmp_path, progress=False)
    scores = {row["task"]: (row["category"], row["score"], row["queries"]) for row in results["tasks"]}
    assert scores == {"ImageNet-1K": ("image CLS", 1.0, 6), "MSCOCO_t2i": ("image RET", 0.0, 6)}
    assert {row["category"]: row["score"] for row in results["categories"]} == {"image CLS": 1.0, "image RET": 0.0}
    assert results["overall"] == 0.5
    collapsed = evaluate_mmeb(ColourWords(processor, collapsed=True), processor, tmp_path, progress=False)
    assert collapsed["overall"] == 0.0  # all candidates tie: the positive never ranks first
    limited = evaluate_mmeb(ColourWords(processor), processor, tmp_path, tasks=["ImageNet-1K"], limit=2,
                            progress=False)  # fmt: skip
    assert [(row["task"], row["queries"]) for row in limited["tasks"]] == [("ImageNet-1K", 2)]
    with pytest.raises(ValueError, match="has no task Missing"):
        evaluate_mmeb(ColourWords(processor), processor, tmp_path, tasks=["Missing"])


def test_mmeb_images_and_bad_tables(tiny_moemb, processor, tmp_path):
    data = ShapeRetrieval()
    generator = torch.Generator().manual_seed(0)
    for direction in ("image_to_text", "text_to_image"):
        data.mmeb_eval_task(direction, 3, 4, generator, tmp_path / "images").to_json(tmp_path / f"{direction}.jsonl")
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb)
    results = evaluate_mmeb(model, processor, tmp_path, progress=False)
    assert [row["category"] for row in results["tasks"]] == ["image RET", "image RET"]
    assert all(0.0 <= row["score"] <= 1.0 and row["queries"] == 3 for row in results["tasks"])
    bad = tmp_path / "bad"
    bad.mkdir()
    Dataset.from_list([{"qry_text": "a", "tgt_img_path": ["b", "c"]}]).to_json(bad / "Task.jsonl")
    with pytest.raises(ValueError, match="needs qry_text and tgt_text .* missing tgt_text"):
        evaluate_mmeb(model, processor, bad)
    Dataset.from_list([{"qry_text": "a", "tgt_text": ["b", "c"], "tgt_img_path": ["d"]}]).to_json(bad / "Task.jsonl")
    with pytest.raises(ValueError, match="tgt_text and tgt_img_path must be lists of the same length"):
        evaluate_mmeb(model, processor, bad)


def test_mmeb_v2_video_tasks_read_folders_of_frames(tiny_moemb, processor, tmp_path):
    generator = torch.Generator().manual_seed(0)
    shapes = ShapeRetrieval().shapes
    for clip, label in enumerate((0, 5)):
        (tmp_path / "clips" / f"{clip}").mkdir(parents=True)
        for frame in range(2):
            shapes.draw(label, generator).save(tmp_path / "clips" / f"{clip}" / f"{frame:03d}.png")
    captions = [shapes.caption(0), shapes.caption(5)]
    rows = [
        {"qry_text": "Find the caption of the video.", "qry_video_path": f"clips/{clip}",
         "tgt_text": captions[clip:] + captions[:clip], "tgt_video_path": ["", ""]}
        for clip in range(2)
    ]  # fmt: skip
    Dataset.from_list(rows).to_json(tmp_path / "MSR-VTT.jsonl")
    results = evaluate_mmeb(MoEmbForEmbedding.from_pretrained(tiny_moemb), processor, tmp_path, progress=False)
    assert [(row["task"], row["category"], row["metric"], row["queries"]) for row in results["tasks"]] == [
        ("MSR-VTT", "video RET", "hit@1", 2)]
    queries, candidates = mmeb_inputs(Dataset.from_list(rows), tmp_path)
    assert queries[0] == {"text": "Find the caption of the video.", "video": str(tmp_path / "clips" / "0")}
    assert candidates[1] == [{"text": captions[1]}, {"text": captions[0]}]


def test_mmeb_v2_visual_document_tasks_rank_a_corpus_by_ndcg_at_5(processor, tmp_path):
    colour_task().to_json(tmp_path / "ImageNet-1K.jsonl")
    write_colour_mrmr(tmp_path / "ViDoRe_arxivqa")
    results = evaluate_mmeb(ColourWords(processor), processor, tmp_path, progress=False)
    tasks = {row["task"]: row for row in results["tasks"]}
    ndcg = (2 + 1 / math.log2(5)) / (2 + 1 / math.log2(3))  # as in the MRMR test: 4 documents, k = 5 keeps them all
    assert (tasks["ViDoRe_arxivqa"]["category"], tasks["ViDoRe_arxivqa"]["metric"]) == ("visual document", "ndcg@5")
    assert tasks["ViDoRe_arxivqa"]["score"] == pytest.approx(ndcg) and tasks["ViDoRe_arxivqa"]["queries"] == 4
    assert results["overall"] == pytest.approx((1.0 + ndcg) / 2)
    only = evaluate_mmeb(ColourWords(processor), processor, tmp_path, tasks=["ViDoRe_arxivqa"], progress=False)
    assert [row["task"] for row in only["tasks"]] == ["ViDoRe_arxivqa"]


# --- MRMR ------------------------------------------------------------------------------------------------------------


def write_colour_mrmr(folder, negation: bool = False):
    """Queries naming colours against one document per colour (graded: 2 for the exact one, 1 for a second one)."""
    folder.mkdir(parents=True)
    corpus = [{"id": f"d{i}", "text": f"a text about {colour}"} for i, colour in enumerate(COLOURS)]
    queries = [{"id": f"q{i}", "text": f"which is {colour}?", "category": "Negation" if negation else colour}
               for i, colour in enumerate(COLOURS)]  # fmt: skip
    qrels = [{"query_id": f"q{i}", "corpus_id": f"d{i}", "score": 2} for i in range(4)]
    qrels += [{"query_id": f"q{i}", "corpus_id": f"d{(i + 1) % 4}", "score": 1} for i in range(4)]
    qrels += [{"query_id": "q0", "corpus_id": "d2", "score": 0}]  # judged, not relevant
    for name, rows in (("query", queries), ("corpus", corpus), ("qrels", qrels)):
        Dataset.from_list(rows).to_json(folder / f"{name}.jsonl")


def test_mrmr_protocol_ndcg_per_subtask_and_hit_at_1_for_negation(processor, tmp_path):
    write_colour_mrmr(tmp_path / "knowledge")
    write_colour_mrmr(tmp_path / "contradiction", negation=True)
    results = evaluate_mrmr(ColourWords(processor), processor, tmp_path, progress=False)
    # The exact document ranks first; the second relevant one ties with the others and so ranks last of 4.
    ndcg = (2 + 1 / math.log2(5)) / (2 + 1 / math.log2(3))
    tasks = {row["task"]: row for row in results["tasks"]}
    assert tasks["knowledge"]["metric"] == "ndcg@10"
    assert tasks["knowledge"]["score"] == pytest.approx(ndcg)
    subtasks = {(row["task"], row["category"]): (row["metric"], row["score"]) for row in results["categories"]}
    assert subtasks[("contradiction", "Negation")] == ("hit@1", 1.0)
    assert subtasks[("knowledge", "red")] == ("ndcg@10", pytest.approx(ndcg))
    assert len(subtasks) == 5
    assert results["overall"] == pytest.approx((4 * ndcg + 1.0) / 5)
    only = evaluate_mrmr(ColourWords(processor), processor, tmp_path / "knowledge", progress=False)
    assert [row["task"] for row in only["tasks"]] == ["knowledge"]


def test_mrmr_inputs_place_images_at_their_markers(tmp_path):
    first, second = object(), object()
    item = mrmr_input({"text": "compare <image 2> with <image 1>", "image 1": first, "image 2": second,
                       "image 3": None}, None)  # fmt: skip
    assert item == {"text": f"compare {IMAGE_TOKEN} with {IMAGE_TOKEN}", "images": [second, first]}
    document = mrmr_input({"text": "", "image": "doc.png"}, tmp_path)
    assert document == {"text": None, "images": [str(tmp_path / "doc.png")]}


def test_mrmr_with_images_and_broken_qrels(tiny_moemb, processor, tmp_path):
    ShapeRetrieval().write_mrmr_task(tmp_path / "shapes", 4, torch.Generator().manual_seed(0))
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb)
    results = evaluate_mrmr(model, processor, tmp_path, progress=False)
    assert results["tasks"][0]["queries"] == 4 and 0.0 < results["tasks"][0]["score"] <= 1.0
    with (tmp_path / "shapes" / "qrels.jsonl").open("a") as qrels:
        qrels.write(json.dumps({"query_id": "q0", "corpus_id": "missing", "score": 1}) + "\n")
    with pytest.raises(ValueError, match="absent from the corpus"):
        evaluate_mrmr(model, processor, tmp_path, progress=False)


# --- the command -----------------------------------------------------------------------------------------------------


def test_eval_command(tiny_moemb, tmp_path, capsys):
    colour_task().to_json(tmp_path / "ImageNet-1K.jsonl")
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert run_eval(parser.parse_args(["--model", str(tiny_moemb), "--benchmark", "mmeb", "--data", str(tmp_path),
                                       "--json", "--batch-size", "3"])) == 0  # fmt: skip
    results = json.loads(capsys.readouterr().out)
    assert results["benchmark"] == "mmeb" and results["tasks"][0]["task"] == "ImageNet-1K"
    write_colour_mrmr(tmp_path / "mrmr" / "knowledge")
    assert run_eval(parser.parse_args(["--model", str(tiny_moemb), "--benchmark", "mrmr", "--data",
                                       str(tmp_path / "mrmr")])) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "MRMR per subtask" in printed and "MRMR overall (mean over subtasks)" in printed


def test_eval_command_with_adaptive_actions_reports_the_flops_saving(tiny_moemb, tmp_path, capsys, monkeypatch):
    # The command calibrates MoDES on the default 100-point grids (up to 200 forwards); a 10-point grid reaches the
    # same target here in a tenth of the forwards (calibrate_modes' own search is tested in test_moemb_adaptive.py).
    monkeypatch.setattr(moemb_adaptive, "calibrate_modes", partial(moemb_adaptive.calibrate_modes, grid_points=10))
    data = ShapeRetrieval()
    data.mmeb_eval_task("image_to_text", 3, 4, torch.Generator().manual_seed(0), tmp_path / "images").to_json(
        tmp_path / "image_to_text.jsonl"
    )
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)

    def evaluate(*options):
        arguments = ["--model", str(tiny_moemb), "--benchmark", "mmeb", "--data", str(tmp_path), "--json", *options]
        assert run_eval(parser.parse_args(arguments)) == 0
        return json.loads(capsys.readouterr().out)

    full = evaluate()
    assert "adaptive" not in full and "table" not in full  # no action: the evaluation as before, and its throughput
    assert 0 < full["throughput"]["embeddings"] <= 3 + 3 * 4  # queries and candidates, each distinct one once
    assert full["throughput"]["embeddings_per_second"] == pytest.approx(
        full["throughput"]["embeddings"] / full["throughput"]["seconds"]
    )
    keep_all = evaluate("--action", "topk", "--k", str(TINY_MOEMB["text_config"]["num_experts_per_tok"]))
    assert keep_all["tasks"] == full["tasks"] and keep_all["adaptive"]["flops_saving"] == 0.0
    baseline, action = keep_all["table"]  # full compute, run again as the baseline, and the action
    assert baseline["actions"] == "full compute" and baseline["speedup"] == 1.0 and baseline["flops_saving"] == 0.0
    assert action["actions"] == "topk" and action["overall"] == full["overall"]
    assert action["speedup"] == pytest.approx(action["embeddings_per_second"] / baseline["embeddings_per_second"])
    combined = evaluate("--action", "topk", "gdn-prune", "--k", "2", "--keep", "0.5")
    summary = combined["adaptive"]
    assert summary["settings"] == {"top_k": "uniform", "token_pruning": "gdn_beta", "experts_per_token": 2,
                                   "keep_ratio": 0.5, "execution": "packed"}  # fmt: skip
    assert 0 < summary["flops_saving"] < 1 and summary["slot_skip_ratio"] >= 0.5
    assert summary["logical_gflops"] == pytest.approx((1 - summary["flops_saving"]) * summary["full_gflops"])

    # MoDES calibrated on MMEB training rows (two image queries, two text targets) outside the evaluation data
    rows = [{"qry": "<|image_1|> Find a caption.", "qry_image_path": str(path), "pos_text": "a shape",
             "pos_image_path": ""} for path in sorted((tmp_path / "images").iterdir())[:2]]  # fmt: skip
    calibration = tmp_path / "calibration" / "rows.jsonl"
    calibration.parent.mkdir()
    calibration.write_text("".join(json.dumps(row) + "\n" for row in rows))
    modes = evaluate("--action", "modes", "--target-skip", "0.3", "--calibration", str(calibration),
                     "--calibration-samples", "4", "--batch-size", "4", "--modes-grid-points", "8")  # fmt: skip
    assert set(modes["adaptive"]["settings"]) == {"top_k", "modes_thresholds", "modes_layer_scales", "execution"}
    assert modes["adaptive"]["flops_saving"] > 0
    # The paper's Table 6 in one run: full compute and each --action, accuracy beside FLOPs saving and throughput
    table = evaluate("--action", "gdn-prune", "--action", "topk", "gdn-prune", "--k", "2")
    actions = [run.get("adaptive", {}).get("actions") for run in table["runs"]]
    assert actions == [None, ["gdn-prune"], ["topk", "gdn-prune"]]
    rows = table["table"]
    assert [row["actions"] for row in rows] == ["full compute", "gdn-prune", "topk + gdn-prune"]
    assert [row["overall"] for row in rows] == [run["overall"] for run in table["runs"]]
    assert rows[2]["flops_saving"] > rows[1]["flops_saving"] > 0
    assert all(row["embeddings_per_second"] > 0 for row in rows)
    arguments = ["--model", str(tiny_moemb), "--benchmark", "mmeb", "--data", str(tmp_path), "--action", "topk",
                 "--k", "2", "--execution", "masked"]  # fmt: skip
    assert run_eval(parser.parse_args(arguments)) == 0
    assert "adaptive computation: accuracy, FLOPs and throughput" in capsys.readouterr().out
    text_only = tmp_path / "calibration" / "text_only.jsonl"
    text_only.write_text("".join(json.dumps({"qry": f"query {i}", "qry_image_path": "", "pos_text": f"target {i}",
                                             "pos_image_path": ""}) + "\n" for i in range(4)))  # fmt: skip
    bad_options = [
        (["--action", "topk", "modes", "--k", "2"], "--action takes one top_k method, got 'uniform' and 'modes'"),
        (["--action", "modes"], "--action modes needs --target-skip and --calibration"),
        (["--action", "topk", "--k", "9"], "--action: adaptive.experts_per_token=9"),
        (["--action", "modes", "--target-skip", "1.0", "--calibration", str(calibration)],
         r"--target-skip 1.0 must lie in \[0, 1\)"),
        (["--action", "modes", "--target-skip", "-0.1", "--calibration", str(calibration)],
         r"--target-skip -0.1 must lie in \[0, 1\)"),
        (["--action", "modes", "--target-skip", "0.3", "--calibration", str(calibration), "--modes-grid-points", "1"],
         "--modes-grid-points 1 must be at least 2"),
        # MoDES calibrates a text and a visual threshold: data with text inputs only is refused, naming the option
        (["--action", "modes", "--target-skip", "0.3", "--calibration", str(text_only), "--calibration-samples", "4"],
         r"--calibration .*text_only.jsonl.* holds only 0 image input"),
    ]  # fmt: skip
    for options, message in bad_options:
        with pytest.raises(ValueError, match=message):
            run_eval(parser.parse_args(["--model", str(tiny_moemb), "--benchmark", "mmeb", "--data", str(tmp_path),
                                        *options]))  # fmt: skip


# --- the benchmark ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["cpu", "tiny", "a3b"])
def test_bench_default_options_fit_every_size(size):
    """`moezoo bench moemb --size SIZE` without other options: the image+text batch it builds (the longest) fits the
    model's context, which the size's default image size sees to; checked without building the model."""
    from moezoo.bench.moemb import IMAGE_SIZES, SIZES, add_bench_arguments, bench_configs
    from moezoo.bench.moemb_inputs import bench_inputs

    assert set(SIZES) == {"cpu", "tiny", "a3b"}
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--size", size])
    assert args.image_size is None  # run_bench then takes IMAGE_SIZES[size]
    config, qwen_config = bench_configs(size)
    assert qwen_config.image_token_id == config.image_token_id
    inputs = bench_inputs(config, "image+text", args.batch_size, args.text_tokens, IMAGE_SIZES[size])
    assert inputs["input_ids"].shape[1] <= config.text_config.max_position_embeddings


def test_bench_rows_compare_moemb_with_transformers_on_the_same_weights(capsys):
    from moezoo.bench.moemb import add_bench_arguments, run_bench

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--size", "tiny", "--batch-size", "2", "--text-tokens", "8", "--image-size", "32",
                              "--impl", "eager", "moezoo", "--seconds-per-case", "0.2", "--threads", "1", "--json"])
    assert run_bench(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["inputs"], row["model"], row["impl"]) for row in rows} == {
        (kind, model, impl) for kind in ("text", "image+text") for model in ("moemb", "transformers")
        for impl in ("eager", "moezoo")
    }  # fmt: skip
    for row in rows:
        assert row["ms"] > 0 and row["embeddings_per_second"] == pytest.approx(2 * 1000 / row["ms"], rel=1e-6)
        if row["model"] == "moemb":
            reference = next(r for r in rows if r["model"] == "transformers" and r["impl"] == row["impl"]
                             and r["inputs"] == row["inputs"])  # fmt: skip
            assert row["overhead_vs_transformers"] == pytest.approx(row["ms"] / reference["ms"] - 1, rel=1e-6)
            assert row["max_abs_diff_vs_transformers"] <= 1e-5
