"""Demo stage: a tiny Qwen3.5-MoE converted into MoEMB, checked equal, and fine-tuned for retrieval.

1. A randomly initialised tiny `Qwen3_5MoeForConditionalGeneration` (transformers' own class, the spec's §4.4
   configuration) is saved as a Qwen3.5 checkpoint and converted into MoEMB.
2. The converted model's hidden states are compared with the source model's on text, image and video inputs:
   they are equal.
3. LoRA contrastive training (the paper's recipe, shortened) on synthetic retrieval in MMEB's training format:
   image + instruction queries against caption targets, and caption queries against image targets.
4. MMEB's protocol (hit@1 of the positive among each query's candidates) on held-out queries, before and after.
5. Adaptive computation on the trained model: an inference action (MoDES at 30% of the routed slots + GDN-β keeping
   half the visual tokens) and a short GRPO run over the efficiency gates, each evaluated as in 4 beside full
   compute, with its logical FLOPs saving and speed; the GRPO policy's per-layer skip and drop rates by modality
   (the paper's Fig. 9) are written as a PNG.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from ..configuration.moemb import TINY_MOEMB, MoEmbConfig
from ..conversion.moemb_qwen3_5 import convert_qwen3_5_checkpoint
from ..evaluation.moemb import ForwardTally, evaluate_mmeb
from ..modeling.moemb import MoEmbForEmbedding
from ..modeling.moemb_adaptive import calibrate_modes
from ..processors.build_moemb import make_moemb_processor, tiny_tokenizer_for
from ..processors.moemb import MoEmbProcessor
from ..terminal import console, print_table
from ..training.moemb import LoraOptions, MoEmbTrainingOptions, train_moemb
from ..training.moemb_data import load_mmeb_dataset
from ..training.moemb_grpo import GrpoOptions, train_moemb_grpo
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
    model, processor = MoEmbForEmbedding.from_pretrained(trained).eval(), MoEmbProcessor.from_pretrained(trained)
    with torch.no_grad(), ForwardTally(model) as full_compute:  # also the baseline of step 5's speedups
        after = evaluate_mmeb(model, processor, tasks, progress=False)

    hits = {"before": {row["task"]: row["score"] for row in before["tasks"]},
            "after": {row["task"]: row["score"] for row in after["tasks"]}}  # fmt: skip
    print_table(
        f"MoEMB on synthetic retrieval: MMEB hit@1 among {NUM_CANDIDATES} candidates",
        ["task", "before training", "after training", "chance"],
        [[task, hits["before"][task], hits["after"][task], 1 / NUM_CANDIDATES] for task in hits["before"]],
    )
    console.print(f"wrote {trained / 'training_curves.png'} and {trained / 'routing_heatmap.png'}")
    full = {"hit@1": after["overall"], "flops_saving": 0.0,
            "embeddings_per_second": full_compute.throughput()["embeddings_per_second"]}  # fmt: skip
    adaptive = adaptive_computation(model, processor, trained, full, data, tasks, out_dir / "grpo", quick)
    return {"max_abs_diff": difference, "hit@1": hits, "training": training, "adaptive": adaptive}


def adaptive_computation(model: MoEmbForEmbedding, processor: MoEmbProcessor, trained: Path, full: dict,
                         data: ShapeRetrieval, tasks: Path, grpo_out: Path, quick: bool) -> dict:  # fmt: skip
    """MoDES + GDN-β and a short GRPO run over the efficiency gates on the trained model (`model`, from `trained`),
    each evaluated on the tasks beside full compute (`full`, its results): mean hit@1, logical FLOPs saving,
    embeddings per second and speedup."""
    calibration = load_mmeb_dataset(data.training_dataset(8, torch.Generator().manual_seed(7)))
    batch = processor([example[side] for example in calibration for side in ("query", "target")])
    modes = calibrate_modes(model, [batch], target_skip=0.3, grid_points=6)

    steps = 4 if quick else 8
    console.print(f"GRPO over the efficiency gates: {steps} steps, 8 pairs, 4 rollouts each (learning rate raised "
                  "for so few steps)")  # fmt: skip
    options = GrpoOptions(steps=steps, batch_size=8, rollouts=4, learning_rate=0.1, logging_steps=1,
                          execution="masked")  # fmt: skip
    training_set = data.training_dataset(steps * options.batch_size, torch.Generator().manual_seed(1))
    grpo = train_moemb_grpo(trained, training_set, grpo_out, options, overwrite=True)
    policy = MoEmbForEmbedding.from_pretrained(grpo_out).eval()

    runs = {"MoDES 30% + GDN-β keep 0.5": (model, modes | {"token_pruning": "gdn_beta"}),
            "GRPO gates (greedy)": (policy, policy.config.adaptive)}  # fmt: skip
    results = {"full compute": full}
    for name, (run_model, settings) in runs.items():
        run_model.config.adaptive = settings
        with torch.no_grad(), ForwardTally(run_model) as tally:
            scores = evaluate_mmeb(run_model, processor, tasks, progress=False)
        results[name] = {"hit@1": scores["overall"], "flops_saving": tally.summary()["flops_saving"],
                         "embeddings_per_second": tally.throughput()["embeddings_per_second"]}  # fmt: skip
    full_speed = full["embeddings_per_second"]
    print_table(
        "MoEMB adaptive computation on the trained model (MMEB hit@1 over both tasks; speed on this CPU)",
        ["run", "hit@1", "FLOPs saving", "embeddings/s", "speedup"],
        [[name, row["hit@1"], row["flops_saving"], row["embeddings_per_second"],
          row["embeddings_per_second"] / full_speed] for name, row in results.items()],
    )  # fmt: skip
    console.print(f"wrote {grpo_out / 'grpo_curves.png'} and {grpo_out / 'action_rates.png'} (skip and drop rates per "
                  "layer and modality, the paper's Fig. 9)")  # fmt: skip
    return {"runs": results, "grpo": grpo}
