"""Trainer callbacks shared by every architecture."""

from __future__ import annotations

from transformers import TrainerCallback

from ..modeling.moe import update_routing_biases


class RoutingBiasCallback(TrainerCallback):
    """Applies the aux-loss-free balancing update once per optimizer step.

    `on_step_end` runs after `optimizer.step()`, once per optimizer step whatever the gradient accumulation; the
    routers have counted the assignments of every micro-batch since the previous step, and
    `update_routing_biases` sums them over all processes before the update. Frozen routers are skipped.
    """

    def __init__(self):
        self.updated_routers = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            # model.modules() reaches the routers through DDP / PEFT wrappers.
            self.updated_routers = update_routing_biases(model)
        return control
