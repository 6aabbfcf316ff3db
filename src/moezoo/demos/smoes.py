"""Demo stage: SMoES groups each token's experts by modality, and expert parallelism sends fewer bytes.

Two copies of the benchmark's tiny SMoES Qwen3.5-MoE VLM (`moezoo bench smoes`: `tiny-smoes` with 16 experts top-4
in 4 bins, to be split over 2 devices) train from the same initialisation for the same steps on its synthetic
captioned images (two thirds of the tokens are image tokens):

- *top-k*: SMoES off, the base model's load-balancing loss;
- *SMoES*: the SMoES losses, then `smoes_export_bin_aligned`, which places whole bins per device.

Both then route one evaluation batch. For each, a small table gives the modality specialisation index (MSI, spec
smoes.md §2.7: 0 when routing ignores modality, 1 when each modality has its own experts) of every MoE layer, and the
bytes the forward all-to-alls of expert parallelism send when that routing is replayed on 2 gloo processes, through
transformers' stock `AllToAllEP` and moezoo's `DedupAllToAllEP`. The share of each modality's dispatches per expert
goes into a heatmap PNG, the rows of both models one under the other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..bench.smoes import bench_config, measure_bytes, route, synthetic_batch, train
from ..modeling.moe.smoes.placement import smoes_export_bin_aligned
from ..modeling.moe.smoes.scores import hard_modality
from ..modeling.moe.statistics import RoutingStatistics, plot_routing_heatmap
from ..terminal import console, print_table
from ..training.smoes import MODALITIES, modality_routing


NUM_DEVICES = 2
EVAL_SAMPLES = 16  # sample i on rank i mod 2
BATCH_SIZE = 8


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = 20 if quick else 120
    config = bench_config()
    text_config = config.text_config
    console.print(
        f"the tiny SMoES Qwen3.5-MoE VLM, {text_config.num_experts} experts top-{text_config.num_experts_per_tok} in "
        f"{text_config.smoes_num_bins} bins, trained twice from the same initialisation for {steps} steps of "
        f"{BATCH_SIZE} captioned synthetic images: with SMoES off (top-k) and on"
    )
    models = {
        "top-k": train(bench_config(smoes_enabled=False), steps, BATCH_SIZE),
        "SMoES": smoes_export_bin_aligned(train(config, steps, BATCH_SIZE)),
    }
    batch = synthetic_batch(config, EVAL_SAMPLES, torch.Generator().manual_seed(10_000))
    batch_size, sequence_length = batch["input_ids"].shape
    modality = hard_modality(batch["mm_token_type_ids"], text_config.smoes_vision_token_types)  # (B, T)
    valid = batch["attention_mask"].bool()

    routings, msi, heatmap_stats = {}, {}, RoutingStatistics({}, group_names=MODALITIES)
    for name, model in models.items():
        routings[name] = route(model, batch)
        # (B*T, k) per layer -> (B, T, k)
        selections = [layer.top_k_index.view(batch_size, sequence_length, -1) for layer in routings[name]]
        stats, msi[name] = modality_routing([selections], [modality], [valid], text_config.num_experts)
        heatmap_stats.counts |= {f"{name}, {layer}": counts for layer, counts in stats.counts.items()}
    bytes_sent = measure_bytes(routings, sequence_length, NUM_DEVICES)

    results = {}
    for name in models:
        stock, dedup = bytes_sent[f"{name}/all_to_all"], bytes_sent[f"{name}/dedup"]
        results[name] = {"msi_per_layer": msi[name], "msi": sum(msi[name]) / len(msi[name]),
                         "bytes_stock_ep": stock, "bytes_dedup_ep": dedup}  # fmt: skip
    baseline = results["top-k"]["bytes_stock_ep"]
    print_table(
        f"after {steps} steps, on {EVAL_SAMPLES} unseen samples ({NUM_DEVICES} devices; EP bytes: forward "
        "all-to-alls, all ranks)",
        ["routing", "MSI per layer", "MSI mean", "stock EP bytes", "dedup EP bytes", "dedup saving vs top-k stock"],
        [[name, " ".join(f"{value:.3f}" for value in figures["msi_per_layer"]), figures["msi"],
          figures["bytes_stock_ep"], figures["bytes_dedup_ep"], f"{1 - figures['bytes_dedup_ep'] / baseline:.1%}"]
         for name, figures in results.items()],
    )  # fmt: skip
    heatmap = plot_routing_heatmap(
        heatmap_stats, out_dir / "routing_by_modality.png",
        title="share of each modality's top-k dispatches per expert (SMoES: experts in bin order)",
    )
    console.print(f"wrote {heatmap}")
    return results | {"steps": steps, "heatmap": heatmap}
