"""Demo stage: the shared MoE core routing synthetic multimodal tokens, and its benchmark.

A tiny stack of sparse-MoE blocks learns a different hidden function per modality (text, image, video tokens,
`moezoo.training.synthetic.MultimodalTokenTask`). Before training the router ignores the modality; after a
short training each expert serves mostly one modality, which the routing heatmap shows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..bench.moe_layer import (
    TARGET_CASE,
    check_targets,
    print_moe_layer_table,
    print_target_checks,
    run_moe_layer_bench,
)
from ..modeling.moe import (
    SORTED_EXPERTS_IMPLEMENTATION,
    MoeLayerSpec,
    SparseMoeBlock,
    load_balancing_loss,
    plot_routing_heatmap,
    record_routing,
    router_z_loss,
)
from ..terminal import console, print_table, progress_bar
from ..training.plots import plot_training_curves
from ..training.synthetic import MultimodalTokenTask


class TokenMoeModel(nn.Module):
    """Input projection, residual `x + MoE(LayerNorm(x))` layers, output projection."""

    def __init__(self, feature_dim: int, target_dim: int, spec: MoeLayerSpec, num_layers: int, experts_impl: str):
        super().__init__()
        self.config = PreTrainedConfig()
        self.config._experts_implementation = experts_impl
        self.spec = spec
        self.embed = nn.Linear(feature_dim, spec.hidden_size)
        self.norms = nn.ModuleList(nn.LayerNorm(spec.hidden_size) for _ in range(num_layers))
        self.blocks = nn.ModuleList(SparseMoeBlock(self.config, spec, layer_idx=i) for i in range(num_layers))
        self.head = nn.Linear(spec.hidden_size, target_dim)
        for block in self.blocks:
            nn.init.normal_(block.gate.weight, std=0.02)
            nn.init.normal_(block.experts.gate_up_proj, std=spec.hidden_size**-0.5)
            nn.init.normal_(block.experts.down_proj, std=spec.expert_intermediate_size**-0.5)

    def forward(self, features, attention_mask):
        hidden = self.embed(features)
        router_logits = []
        for norm, block in zip(self.norms, self.blocks):
            update, logits = block(norm(hidden), attention_mask=attention_mask)
            hidden = hidden + update
            router_logits.append(logits)
        return self.head(hidden), router_logits


def masked_mse(predictions, targets, attention_mask):
    mask = attention_mask[..., None].to(predictions.dtype)
    return ((predictions - targets) ** 2 * mask).sum() / (mask.sum() * predictions.shape[-1])


def routing_table(title, model, task, batch):
    with torch.no_grad(), record_routing(model, group_names=task.modalities) as stats:
        stats.set_groups(batch.modality_ids)
        model(batch.features, batch.attention_mask)
    specialization, imbalance = stats.specialization(), stats.load_imbalance()
    print_table(
        title,
        ["layer", "specialisation", "max/mean load", "tokens routed"],
        [
            [name, specialization[name], imbalance[name], int(counts.sum()) // model.spec.num_experts_per_tok]
            for name, counts in stats.counts.items()
        ],
    )
    return stats


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    task = MultimodalTokenTask()
    spec = MoeLayerSpec(hidden_size=64, num_experts=12, num_experts_per_tok=2, expert_intermediate_size=64)
    model = TokenMoeModel(task.feature_dim, task.target_dim, spec, num_layers=2, experts_impl=SORTED_EXPERTS_IMPLEMENTATION)
    console.print(
        f"A {len(model.blocks)}-layer MoE ({spec.num_experts} experts, top-{spec.num_experts_per_tok}, softmax router, "
        f"experts_implementation={SORTED_EXPERTS_IMPLEMENTATION!r}) learns one hidden function per modality "
        f"({', '.join(task.modalities)}) from padded token sequences."
    )
    held_out = task.batch(64, 32, torch.Generator().manual_seed(1234))
    valid_tokens = int(held_out.attention_mask.sum())
    console.print(f"held-out batch: {held_out.attention_mask.numel()} positions, {valid_tokens} tokens, the rest padding")
    routing_table("routing before training (specialisation 1/3: modality-blind, 1: one modality per expert)", model, task, held_out)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    steps = 200 if quick else 400
    curves = {"mse": [], "load-balancing loss": []}
    with progress_bar() as progress:
        task_id = progress.add_task("training", total=steps)
        for _ in range(steps):
            batch = task.batch(32, 32, generator)
            predictions, router_logits = model(batch.features, batch.attention_mask)
            mse = masked_mse(predictions, batch.targets, batch.attention_mask)
            balance = load_balancing_loss(router_logits, spec.num_experts, spec.num_experts_per_tok)
            loss = mse + 0.01 * balance + 1e-3 * router_z_loss(router_logits)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curves["mse"].append(mse.item())
            curves["load-balancing loss"].append(balance.item())
            progress.update(task_id, advance=1, description=f"training (mse {mse.item():.3f})")

    with torch.no_grad():
        held_out_mse = float(masked_mse(model(held_out.features, held_out.attention_mask)[0], held_out.targets,
                                        held_out.attention_mask))
    stats = routing_table("routing after training", model, task, held_out)
    heatmap = plot_routing_heatmap(stats, out_dir / "routing_heatmap.png", title="tokens per expert, by modality")
    curve = plot_training_curves(curves, out_dir / "training_curves.png", title="MoE core on synthetic tokens")
    console.print(f"held-out mse {curves['mse'][0]:.3f} (first step) -> {held_out_mse:.3f}")
    console.print(f"wrote {heatmap} and {curve}")

    bench_tokens = [64, 512] if quick else [64, 2048]
    shape = TARGET_CASE
    console.print(f"benchmark: one MoE layer ({shape['num_experts']} experts, top-{shape['top_k']}, hidden "
                  f"{shape['hidden']}, expert width {shape['expert_width']}), tokens {bench_tokens}")
    rows, peak = run_moe_layer_bench(tokens=bench_tokens, seconds_per_case=2.0 if quick else 5.0, max_rounds=10,
                                     **TARGET_CASE)
    print_moe_layer_table(rows, peak, "experts implementations on identical weights")
    print_target_checks(check_targets(rows, **TARGET_CASE))
    return {"specialization": stats.specialization(), "held_out_mse": held_out_mse, "heatmap": heatmap}
