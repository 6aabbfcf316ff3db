"""Routing statistics: tokens per expert per layer, optionally split by a per-token group id (modality, task).

    with record_routing(model, group_names=["text", "image"]) as stats:
        for batch in loader:
            stats.set_groups(batch["modality_ids"])      # (B, S) ids in [0, num_groups)
            model(**batch)
    stats.counts                    # {layer name: (num_groups, num_experts) int64 tensor}
    plot_routing_heatmap(stats, "routing.png")

Only valid tokens are counted (the blocks drop padding before routing), and a forward re-run by gradient
checkpointing is not counted twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .block import SparseMoeBlock


class RoutingStatistics:
    """Accumulates `(num_groups, num_experts)` assignment counts per MoE layer."""

    def __init__(self, layer_names: dict[SparseMoeBlock, str], group_names: Sequence[str] | None = None):
        self.layer_names = layer_names
        self.group_names = list(group_names) if group_names else ["all tokens"]
        self.counts: dict[str, torch.Tensor] = {}
        self._groups: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return len(self.group_names)

    def set_groups(self, group_ids: torch.Tensor | None) -> None:
        """Group id of every token of the next forward, shaped like its `attention_mask` (None: one group)."""
        if group_ids is not None and group_ids.numel() and (group_ids.min() < 0 or group_ids.max() >= self.num_groups):
            raise ValueError(
                f"group ids must lie in [0, {self.num_groups}) for the groups {self.group_names}; got ids from "
                f"{int(group_ids.min())} to {int(group_ids.max())}"
            )
        self._groups = group_ids

    def record(self, block: SparseMoeBlock, top_k_index: torch.Tensor, valid: torch.Tensor | None) -> None:
        num_tokens, top_k = top_k_index.shape
        if self._groups is None:
            groups = torch.zeros(num_tokens, dtype=torch.long, device=top_k_index.device)
        else:
            groups = self._groups.reshape(-1).to(top_k_index.device)
            if valid is not None:
                groups = groups[valid]
            if groups.numel() != num_tokens:
                raise ValueError(
                    f"routing statistics for MoE {block.layer_name}: {groups.numel()} group ids were set but the "
                    f"layer routed {num_tokens} tokens; call set_groups() with ids shaped like the attention mask"
                )
        cells = groups.repeat_interleave(top_k) * block.num_experts + top_k_index.reshape(-1)
        counts = torch.bincount(cells, minlength=self.num_groups * block.num_experts).view(self.num_groups, -1)
        name = self.layer_names[block]
        self.counts[name] = self.counts.get(name, 0) + counts.cpu()

    def fractions(self) -> dict[str, torch.Tensor]:
        """Per layer, each group's share of assignments going to each expert (rows sum to 1 where non-empty)."""
        return {
            name: counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1) for name, counts in self.counts.items()
        }

    def specialization(self) -> dict[str, float]:
        """Per layer, the share of assignments that go to an expert's majority group: 1.0 when every expert serves
        a single group, about 1/num_groups when routing ignores the groups."""
        return {
            name: float(counts.max(dim=0).values.sum() / counts.sum().clamp(min=1)) for name, counts in self.counts.items()
        }

    def load_imbalance(self) -> dict[str, float]:
        """Per layer, max / mean tokens per expert over all groups (1.0 = perfectly balanced)."""
        result = {}
        for name, counts in self.counts.items():
            per_expert = counts.sum(dim=0).double()
            result[name] = float(per_expert.max() / per_expert.mean()) if per_expert.sum() > 0 else float("nan")
        return result


@contextmanager
def record_routing(model: nn.Module, group_names: Sequence[str] | None = None):
    """Record routing statistics of every `SparseMoeBlock` in `model` while the context is open."""
    # A block recorded on its own is the root module, whose name is "": it goes by its layer name instead.
    blocks = {
        module: name or module.layer_name for name, module in model.named_modules() if isinstance(module, SparseMoeBlock)
    }
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no SparseMoeBlock to record routing statistics from")
    stats = RoutingStatistics(blocks, group_names)
    for block in blocks:
        block.routing_recorder = stats
    try:
        yield stats
    finally:
        for block in blocks:
            block.routing_recorder = None


def plot_routing_heatmap(stats: RoutingStatistics, path: str | Path, title: str | None = None) -> Path:
    """Write one heatmap per group (rows: MoE layers, columns: experts, colour: share of the group's
    assignments) side by side into a PNG file and return its path."""
    # Guarded: model code that records statistics is exported to Hub folders whose users may lack matplotlib.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError("plotting routing heatmaps needs matplotlib: pip install matplotlib") from error

    if not stats.counts:
        raise ValueError("no routing was recorded: run a forward pass inside record_routing() first")
    fractions = stats.fractions()
    layer_names = list(fractions)
    num_experts = max(layer.shape[1] for layer in fractions.values())
    # Layers may have different expert counts: the experts a layer lacks are blank (NaN) cells at the end of its row.
    grids = [torch.full((len(layer_names), num_experts), float("nan"), dtype=torch.float64) for _ in stats.group_names]
    for row, name in enumerate(layer_names):
        for group, grid in enumerate(grids):
            grid[row, : fractions[name].shape[1]] = fractions[name][group]
    grids = [grid.numpy() for grid in grids]
    vmax = max(float(layer.max()) for layer in fractions.values()) or 1.0
    fig, axes = plt.subplots(
        1,
        stats.num_groups,
        figsize=(max(4.0, 0.18 * num_experts) * stats.num_groups + 1.5, 0.45 * len(layer_names) + 1.8),
        squeeze=False,
    )
    for column, (axis, grid, group) in enumerate(zip(axes[0], grids, stats.group_names)):
        image = axis.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        axis.set_title(group)
        axis.set_xlabel("expert")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_yticks(range(len(layer_names)), layer_names if column == 0 else [], fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), label="share of the group's assignments")
    if title:
        fig.suptitle(title, y=1.0 + 0.35 / fig.get_size_inches()[1])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
