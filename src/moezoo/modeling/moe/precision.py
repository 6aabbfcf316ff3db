"""The fp32 islands of mixed-precision training. Under the Trainer's bf16/fp16 autocast a matmul runs in the low
precision whatever its inputs' dtype (`torch.autocast` casts them), so `.float()` alone does not keep the math whose
numerics need fp32 (router logits and softmax, balancing statistics, routing terms, contrastive logits) in fp32:
it runs inside `autocast_off`, on `.float()` inputs. Without autocast and on fp32 inputs both change nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

# The floating dtypes a model is converted to, loaded in or trained in, by the names `--dtype` takes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_off(tensor: torch.Tensor) -> AbstractContextManager:
    """Autocast disabled on `tensor`'s device (a no-op on devices without autocast, such as "meta")."""
    device_type = tensor.device.type
    if not torch.amp.is_autocast_available(device_type):
        return nullcontext()
    return torch.autocast(device_type, enabled=False)


def fp32_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` computed in fp32 whatever the weights' dtype or autocast: the logits of a gate (routing, skipping,
    pruning), which a softmax, a sigmoid or a threshold turns into decisions that bf16's rounding would move."""
    bias = None if linear.bias is None else linear.bias.float()
    with autocast_off(x):
        return F.linear(x.float(), linear.weight.float(), bias)


class Fp32Linear(nn.Linear):
    """An `nn.Linear` computed in fp32 (`fp32_linear`): a layer of a gate. Its own forward, so that accelerate's
    offload hooks, which load a module's weights for its forward only, bring its weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(self, x)


def scaled_similarities(queries: torch.Tensor, keys: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`(scale * queries) @ keys.T` (Q, K) in fp32 whatever the inputs' dtype or autocast: contrastive logits, where
    a logit scale of 50-100 would turn bf16's rounding of the similarities (~4e-3) into a fraction of a logit."""
    with autocast_off(queries):
        return (scale * queries.float()) @ keys.float().t()
