"""Demo stage: a tiny Qwen3.5-MoE converted into MoEMB, checked equal, and fine-tuned for retrieval.

1. A randomly initialised tiny `Qwen3_5MoeForConditionalGeneration` (transformers' own class, the spec's §4.4
   configuration) is saved as a Qwen3.5 checkpoint and converted into MoEMB.
2. The converted model's hidden states are compared with the source model's on text, image and video inputs:
   they are equal.
3. LoRA contrastive training (the paper's recipe, shortened) on synthetic retrieval in MMEB's training format:
   image + instruction queries against caption targets, and caption queries against image targets.
4. MMEB's protocol (hit@1 of the positive among each query's candidates) on held-out queries, before and after.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from ..configuration.moemb import TINY_MOEMB, MoEmbConfig
from ..conversion.moemb_qwen3_5 import convert_qwen3_5_checkpoint
from ..evaluation.moemb import evaluate_mmeb
from ..modeling.moemb import MoEmbForEmbedding
from ..processors.build_moemb import make_moemb_processor, tiny_tokenizer_for
from ..processors.moemb import MoEmbProcessor
from ..terminal import console, print_table
from ..training.moemb import LoraOptions, MoEmbTrainingOptions, train_moemb
from ..training.moemb_synthetic import DIRECTIONS, ShapeRetrieval

NUM_CANDIDATES = 8


def build_source(folder: Path, seed: int = 0) -> None:
    """A tiny Qwen3.5-MoE checkpoint with a tokenizer, as the Hub ships the real ones. Its tokenizer already
    reserves `<emb>` at the id the tiny config uses (a real Qwen3.5 tokenizer gets it from the conversion)."""
    ids = {key: TINY_MOEMB[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id")}  # fmt: skip
    config = Qwen3_5MoeConfig(text_config=TINY_MOEMB["text_config"], vision_config=TINY_MOEMB["vision_config"], **ids)
    torch.manual_seed(seed)
    Qwen3_5MoeForConditionalGeneration(config).save_pretrained(folder)
    tiny_tokenizer_for(MoEmbConfig(**TINY_MOEMB)).save_pretrained(folder)


@torch.no_grad()
def max_hidden_state_difference(source: Path, converted: Path, processor: MoEmbProcessor) -> float:
    """max |Δ| between the source model's and MoEMB's last hidden states on a padded text, image and video batch,
    both with transformers' eager experts. `<emb>` positions are left out: the conversion gives `<emb>` a new
    embedding row (the mean of the vocabulary's), so the source model sees another token there."""
    qwen = Qwen3_5MoeForConditionalGeneration.from_pretrained(source, experts_implementation="eager").model.eval()
    moemb = MoEmbForEmbedding.from_pretrained(converted, experts_implementation="eager").eval()
    generator = np.random.default_rng(0)
    frames = list(generator.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8))
    image = generator.integers(0, 256, (24, 16, 3), dtype=np.uint8)
    batch = processor(["a red circle", {"instruction": "Find the caption.", "images": [image]},
                       {"text": "a square moving left", "video": frames}])  # fmt: skip
    inputs = {key: value for key, value in batch.items() if key != "pooled_index"}
    expected = qwen(**inputs).last_hidden_state
    got = moemb.model(**inputs).last_hidden_state
    compared = batch["attention_mask"].bool() & (batch["input_ids"] != moemb.config.emb_token_id)
    return float((expected[compared] - got[compared]).abs().max())


def write_eval_tasks(folder: Path, data: ShapeRetrieval, num_queries: int) -> Path:
    generator = torch.Generator().manual_seed(1000)
    for direction in DIRECTIONS:
        task = data.mmeb_eval_task(direction, num_queries, NUM_CANDIDATES, generator, folder / "images")
        task.to_json(folder / f"shapes_{direction}.jsonl")
    return folder


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source, converted = out_dir / "qwen3_5_moe_tiny", out_dir / "converted"
    build_source(source)
    shutil.rmtree(converted, ignore_errors=True)  # a previous run's: the converter writes into a new folder only
    report = convert_qwen3_5_checkpoint(source, converted, "native")
    processor = make_moemb_processor(MoEmbConfig.from_pretrained(converted),
                                     tokenizer=AutoTokenizer.from_pretrained(converted))  # fmt: skip
    processor.save_pretrained(converted)
    difference = max_hidden_state_difference(source, converted, processor)
    accounting = report["key_accounting"]
    console.print(
        f"converted a tiny Qwen3.5-MoE ({accounting['source_tensors']} tensors; dropped: "
        f"{', '.join(accounting['dropped']) or 'none'}) into MoEMB; <emb> is token {report['emb_token_id']}. "
        f"max |Δ| of the last hidden states against transformers' model (text, image, video): {difference:.2e}"
    )

    data = ShapeRetrieval()
    tasks = write_eval_tasks(out_dir / "mmeb_eval", data, num_queries=32 if quick else 64)
    model = MoEmbForEmbedding.from_pretrained(converted)
    before = evaluate_mmeb(model, processor, tasks, progress=False)

    steps = 120 if quick else 400
    options = MoEmbTrainingOptions(
        steps=steps, batch_size=16, learning_rate=3e-3, warmup_steps=10, logging_steps=max(1, steps // 30),
        mask_duplicate_targets=True, lora=LoraOptions(rank=8, alpha=16, dropout=0.0),
    )  # fmt: skip
    training_set = data.training_dataset(steps * options.batch_size, torch.Generator().manual_seed(0))
    console.print(f"LoRA contrastive training: {steps} steps, batch {options.batch_size}, image->text and text->image")
    training = train_moemb(converted, training_set, out_dir / "trained", options, overwrite=True)
    trained = out_dir / "trained"
    after = evaluate_mmeb(MoEmbForEmbedding.from_pretrained(trained), MoEmbProcessor.from_pretrained(trained), tasks,
                          progress=False)  # fmt: skip

    hits = {"before": {row["task"]: row["score"] for row in before["tasks"]},
            "after": {row["task"]: row["score"] for row in after["tasks"]}}  # fmt: skip
    print_table(
        f"MoEMB on synthetic retrieval: MMEB hit@1 among {NUM_CANDIDATES} candidates",
        ["task", "before training", "after training", "chance"],
        [[task, hits["before"][task], hits["after"][task], 1 / NUM_CANDIDATES] for task in hits["before"]],
    )
    console.print(f"wrote {trained / 'training_curves.png'} and {trained / 'routing_heatmap.png'}")
    return {"max_abs_diff": difference, "hit@1": hits, "training": training}
