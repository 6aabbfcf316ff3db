"""When the SMoES coefficients and bins change with the training step (spec §2.6, §2.2).

The paper gives no schedule: alpha_MI, tau and beta are constant. The optional linear warm-up of alpha_MI and the
re-binning interval and freeze are switches of this implementation. `step` counts the training forwards completed
before the current one (the `smoes_step` buffer).
"""

from __future__ import annotations


def mi_coefficient(mi_coef: float, warmup_steps: int, step: int) -> float:
    """alpha_MI at `step`: ramped linearly over the first `warmup_steps` forwards, reaching `mi_coef` at forward
    `warmup_steps - 1` (constant without a warm-up)."""
    if warmup_steps <= 0:
        return mi_coef
    return mi_coef * min(1.0, (step + 1) / warmup_steps)


def rebins_after(step: int, rebin_interval: int, freeze_bins_after: int | None) -> bool:
    """Whether adaptive bins are reassigned once forward `step` is done: every `rebin_interval` forwards, and no
    longer after `freeze_bins_after` forwards, so an exported placement is what the end of training saw."""
    completed = step + 1
    if freeze_bins_after is not None and completed > freeze_bins_after:
        return False
    return completed % rebin_interval == 0
