"""Weight initialisation of the core's modules, for the `_init_weights` of every architecture.

transformers calls `_init_weights` on each module that owns parameters; the core's routers and fused experts own
3D or custom parameters that its generic rule does not cover. The `transformers.initialization` functions skip
tensors already loaded from a checkpoint.
"""

from __future__ import annotations

from torch import nn
from transformers import initialization as init

from .experts import GeluExperts, SwiGLUExperts
from .router import TopKRouter
from .smoes.host import SmoesHost
from .smoes.state import SmoesLayerState


def init_moe_module(module: nn.Module, std: float) -> bool:
    """Initialise `module` if it is a router, an experts module or SMoES state of the core; returns whether it was
    one."""
    if isinstance(module, TopKRouter):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)
        if module.e_score_correction_bias is not None:
            init.zeros_(module.e_score_correction_bias)
        return True
    if isinstance(module, SwiGLUExperts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
        return True
    if isinstance(module, GeluExperts):
        init.normal_(module.up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
        init.zeros_(module.up_proj_bias)
        init.zeros_(module.down_proj_bias)
        return True
    if isinstance(module, SmoesLayerState):
        module.init_buffers()
        return True
    if isinstance(module, SmoesHost):
        init.zeros_(module.step)
        return True
    return False
