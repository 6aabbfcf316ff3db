"""Training curves as PNG files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_training_curves(
    curves: Mapping[str, Sequence[float]],
    path: str | Path,
    title: str | None = None,
    xlabel: str = "step",
    steps: Mapping[str, Sequence[int]] | None = None,
) -> Path:
    """One panel per named curve (loss, accuracy, ...), written to `path`. `steps` gives the x value of every point
    of a curve (default: 1, 2, 3, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {name: values for name, values in curves.items() if len(values)}
    if not curves:
        raise ValueError("no training curve has any value to plot")
    steps = steps or {}
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.2), squeeze=False)
    for axis, (name, values) in zip(axes[0], curves.items()):
        axis.plot(steps.get(name, range(1, len(values) + 1)), list(values))
        axis.set_title(name)
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
    return save_figure(fig, path, title)


def save_figure(fig, path: str | Path, title: str | None = None) -> Path:
    """Writes a matplotlib figure (with its `title`) to `path` as a PNG file and closes it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_log_history(
    log_history: Sequence[Mapping[str, float]], panels: Mapping[str, str], path: str | Path, title: str | None = None
) -> Path:
    """
    One panel per logged value against the optimizer step, from `trainer.state.log_history`: `panels` maps a
    panel's title to its key in the Trainer's logs (`"loss"`, `"eval_loss"`, ...); a key never logged gets no panel.
    A resumed run restores the log history of its checkpoint, so its curves cover the whole run.
    """
    curves, steps = {}, {}
    for panel, key in panels.items():
        logs = [log for log in log_history if key in log]
        curves[panel] = [log[key] for log in logs]
        steps[panel] = [log["step"] for log in logs]
    return plot_training_curves(curves, path, title, xlabel="optimizer step", steps=steps)
