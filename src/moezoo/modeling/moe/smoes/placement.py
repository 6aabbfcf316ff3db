"""Bins on expert-parallel devices (SMoES spec §3): where each expert runs, what routing costs in cross-device traffic,
and the export step that makes transformers' contiguous expert sharding put whole bins on one device.

transformers' expert parallelism gives rank r of D the contiguous expert range `[r E/D, (r+1) E/D)`. SMoES bins are
logical during training (experts are not migrated when bins change), so an expert's device under bin placement is
that of its index once each bin occupies a contiguous range, bin 0 first, experts of a bin in index order:

    E = 8, 4 bins, bins = [3, 0, 1, 0, 1, 2, 3, 2]
    bin-aligned order    = [1, 3, 2, 4, 5, 7, 0, 6]     experts of bin 0, then bin 1, ...
    D = 2 devices        :  device 0 holds bins 0-1 (experts 1 3 2 4), device 1 holds bins 2-3 (experts 5 7 0 6)

With D <= N_bins each device holds N_bins / D adjacent (similar) bins; with D > N_bins each bin spans D / N_bins
devices. `smoes_export_bin_aligned` applies that order to the weights, so the exported model routes identically and
its default sharding is the bin placement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .bins import contiguous_bins
from .host import SmoesHost
from .state import SmoesLayerState


def check_placement(num_experts: int, num_bins: int, num_devices: int) -> None:
    """Raise a `ValueError` unless `num_bins` bins of `num_experts` experts map to `num_devices` expert-parallel
    devices with whole bins per device (or whole devices per bin)."""
    if num_experts % num_bins:
        raise ValueError(
            f"smoes_num_bins={num_bins} must divide the {num_experts} experts of a layer: bins are equal groups"
        )
    if num_experts % num_devices:
        raise ValueError(
            f"{num_devices} expert-parallel devices must divide the {num_experts} experts of a layer (transformers "
            "gives every rank the same number of experts)"
        )
    if num_devices > num_bins and num_devices % num_bins:
        raise ValueError(
            f"{num_devices} expert-parallel devices for smoes_num_bins={num_bins} bins: with more devices than bins, "
            "each bin spans devices, so the bin count must divide the device count; choose a number of bins that "
            f"divides {num_devices}, or at least {num_devices} bins"
        )
    if num_devices <= num_bins and num_bins % num_devices:
        raise ValueError(
            f"smoes_num_bins={num_bins} bins on {num_devices} expert-parallel devices: the device count must divide "
            "the bin count so that each device holds whole bins (smoes_ep_devices)"
        )


def bin_aligned_order(bins: torch.LongTensor) -> torch.LongTensor:
    """(E,) the experts listed bin by bin (bin 0 first, index order within a bin): `order[i]` is the expert that
    takes index i at export."""
    return torch.sort(bins, stable=True).indices


def device_of_expert(bins: torch.LongTensor, num_bins: int, num_devices: int) -> torch.LongTensor:
    """(E,) the device each expert runs on under bin placement: the device transformers' contiguous sharding gives
    its bin-aligned index. With `contiguous_bins` this is the plain sharding `arange(E) // (E / D)`."""
    num_experts = bins.numel()
    check_placement(num_experts, num_bins, num_devices)
    aligned_index = torch.empty_like(bins)
    aligned_index[bin_aligned_order(bins)] = torch.arange(num_experts, device=bins.device)
    return aligned_index // (num_experts // num_devices)


@dataclass
class DispatchMetrics:
    """Cross-device dispatch of one layer's routing under a placement (spec §3.2), per valid token.

    Args:
        span_frac: share of tokens whose experts are on more than one device (the paper's cross-GPU EP ratio).
        remote_any_frac: share of tokens with at least one expert off their home device.
        remote_pair_frac: share of (token, expert) pairs off the token's home device: what transformers'
            `AllToAllEP` sends, in tokens, divided by k.
        dedup_remote_devices_per_token: remote devices hosting any of a token's experts: what moezoo's `dedup` EP
            sends, in tokens.
        device_load_share: each device's share of the (token, expert) pairs.
    """

    span_frac: float
    remote_any_frac: float
    remote_pair_frac: float
    dedup_remote_devices_per_token: float
    device_load_share: list[float]

    @property
    def load_imbalance(self) -> float:
        """The busiest device's load over the mean load (1 is perfectly balanced)."""
        return max(self.device_load_share) * len(self.device_load_share)

    def to_dict(self) -> dict:
        return {**asdict(self), "load_imbalance": self.load_imbalance}


@torch.no_grad()
def dispatch_metrics(
    top_k_index: torch.LongTensor,  # (B, T, k) the router's selection
    valid: torch.Tensor,  # (B, T) bool
    device_of_expert: torch.LongTensor,  # (E,)
    home_device: torch.LongTensor,  # (B, T) the rank holding each token (its data-parallel rank)
    num_devices: int,
) -> DispatchMetrics:
    devices = device_of_expert[top_k_index[valid]]  # (N, k)
    home = home_device[valid]  # (N,)
    remote = devices != home[:, None]
    hosts = F.one_hot(devices, num_devices).amax(dim=1)  # (N, D) the devices hosting any of a token's experts
    remote_hosts = hosts.clone()
    remote_hosts[torch.arange(home.numel(), device=home.device), home] = 0
    load = torch.bincount(devices.reshape(-1), minlength=num_devices).double()
    return DispatchMetrics(
        span_frac=(hosts.sum(dim=1) > 1).double().mean().item(),
        remote_any_frac=remote.any(dim=1).double().mean().item(),
        remote_pair_frac=remote.double().mean().item(),
        dedup_remote_devices_per_token=remote_hosts.sum(dim=1).double().mean().item(),
        device_load_share=(load / load.sum()).tolist(),
    )


def random_routing_dispatch(num_experts: int, top_k: int, num_devices: int) -> DispatchMetrics:
    """`dispatch_metrics` in expectation for routing that draws k distinct experts uniformly at random, on a
    contiguous placement, with homes spread evenly over the devices (the closed forms of spec §3.2)."""
    per_device = num_experts // num_devices
    all_choices = math.comb(num_experts, top_k)
    all_on_one_device = math.comb(per_device, top_k) / all_choices  # all k experts on a given device
    misses_a_device = math.comb(num_experts - per_device, top_k) / all_choices  # none on a given device
    return DispatchMetrics(
        span_frac=1 - num_devices * all_on_one_device,
        remote_any_frac=1 - all_on_one_device,
        remote_pair_frac=(num_devices - 1) / num_devices,
        dedup_remote_devices_per_token=(num_devices - 1) * (1 - misses_a_device),
        device_load_share=[1 / num_devices] * num_devices,
    )


def _smoes_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks holding SMoES buffers (a `smoes` child next to their `gate` router and `experts`)."""
    blocks = [module for module in model.modules() if isinstance(getattr(module, "smoes", None), SmoesLayerState)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no SMoES layer to export (no MoE block with a `smoes` child)")
    return blocks


def _permute_expert_tensors(module: nn.Module, order: torch.LongTensor) -> None:
    """Reorder dim 0 of every parameter and buffer of `module` that has one entry per expert."""
    for tensors in (module._parameters, module._buffers):
        for name, tensor in tensors.items():
            if tensor is not None and tensor.dim() >= 1 and tensor.shape[0] == order.numel():
                tensor.data = tensor.data[order.to(tensor.device)]


@torch.no_grad()
def smoes_export_bin_aligned(model: nn.Module, num_devices: int | None = None) -> nn.Module:
    """Permute every SMoES layer's experts in place so that bin k occupies indices `[k N_B, (k+1) N_B)` (spec §3.1),
    and return the model. Routing is equivariant to permuting router rows and experts jointly, so outputs are unchanged
    (up to summation order); afterwards `bins` are contiguous and the plain sharding of `num_devices` expert-parallel
    ranks (default: the settings' `smoes_ep_devices`) is the bin placement.

    Permuted per layer: the router's per-expert tensors (`gate.weight`, a bias or `e_score_correction_bias`), the
    experts' fused tensors (`gate_up_proj`, `down_proj`, their biases) and the dispatch-count EMA."""
    config = model.config.get_text_config()
    if getattr(config, "n_group", None) not in (None, 1):
        raise ValueError(
            f"n_group={config.n_group}: group-limited routing picks experts within contiguous index groups, so "
            "permuting the experts changes the routing; export needs n_group=1"
        )
    if num_devices is None:
        # The zoo's hosts keep their settings in an `SmoesHost`; transformers-based hosts on their text config.
        hosts = [module.settings for module in model.modules() if isinstance(module, SmoesHost)]
        num_devices = (hosts[0] if hosts else config).smoes_ep_devices
    for block in _smoes_blocks(model):
        state = block.smoes
        num_experts = state.bins.numel()
        check_placement(num_experts, state.num_bins, num_devices)
        order = bin_aligned_order(state.bins)
        _permute_expert_tensors(block.gate, order)
        _permute_expert_tensors(block.experts, order)
        state.expert_counts_ema.copy_(state.expert_counts_ema[:, order])
        state.bins.copy_(contiguous_bins(num_experts, state.num_bins, device=state.bins.device))
    return model
