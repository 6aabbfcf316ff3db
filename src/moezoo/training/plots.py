"""Training curves as PNG files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_training_curves(
    curves: Mapping[str, Sequence[float]], path: str | Path, title: str | None = None, xlabel: str = "step"
) -> Path:
    """One panel per named curve (loss, accuracy, ...), written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {name: values for name, values in curves.items() if len(values)}
    if not curves:
        raise ValueError("no training curve has any value to plot")
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.2), squeeze=False)
    for axis, (name, values) in zip(axes[0], curves.items()):
        axis.plot(range(1, len(values) + 1), list(values))
        axis.set_title(name)
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
