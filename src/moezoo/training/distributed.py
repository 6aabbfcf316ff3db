"""Collectives for contrastive training across processes."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size), (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every process concatenated along dim 0 (rank order). The backward sums the gradients that all
    processes computed for each slice and hands every process the gradient of its own slice, so a loss over the
    global batch trains each process's local embeddings (OpenCLIP's gather_with_grad)."""
    _, world_size = world()
    if world_size == 1:
        return tensor
    return torch.cat(torch.distributed.nn.functional.all_gather(tensor), dim=0)
