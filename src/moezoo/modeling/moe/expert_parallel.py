"""Deduplicated expert parallelism: one copy of a token per rank that hosts any of its experts (spec smoes.md §3.2).

transformers' `AllToAllEP` sends one copy of a token per (token, expert) pair, so a token whose k experts all live on
one remote rank crosses the network k times, and co-locating a token's experts (what SMoES' bins do) saves nothing.
`DedupAllToAllEP` sends each token once per destination rank, with the routing weights and local expert ids of the
slots that rank serves; the destination returns one vector per (token, rank), the weighted sum of its experts'
outputs, and the source adds those partial sums:

    token t picks E1 (w1), E2 (w2), E3 (w3); rank 0 holds E0 E1, rank 1 holds E2 E3; t lives on rank 0

                          AllToAllEP                          DedupAllToAllEP
    rank 0 -> rank 1      t for E2, t for E3 (2 rows)         t with ids [-, 0, 1], weights [0, w2, w3] (1 row)
    rank 1 -> rank 0      E2(t), E3(t)        (2 rows)        w2 E2(t) + w3 E3(t)                      (1 row)

It registers in transformers' `EPImplementationInterface` as `"dedup"` when moezoo is imported:

    DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="dedup")

The experts run with k slots per received row, the slots of other ranks marked by transformers' sentinel
(local id `num_local_experts`, weight 0), as in `AllReduceEP`: the experts' eager, `batched_mm` and `grouped_mm`
forwards skip or zero them.

`AllToAllTraffic` counts the bytes the all-to-alls of transformers' EP and of this module send to other ranks.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch.distributed import all_to_all_single
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.distributed import expert_parallel
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
from transformers.distributed.parallel_utils import _WaitTensor


DEDUP_EP_IMPLEMENTATION = "dedup"


class _DedupState(NamedTuple):
    token_index: torch.Tensor  # (S,) the source token of each sent row, rows grouped by destination rank
    send_sizes: list[int]  # rows sent to each rank of the EP group (self included)
    recv_sizes: list[int]  # rows received from each rank
    num_local_tokens: int  # this rank's tokens (its slice of the TP group's batch)
    num_tokens: int


class DedupAllToAllEP(EPImplementation):
    """Expert parallelism that sends each token once per rank hosting at least one of its experts, and gets back
    one partial sum per (token, rank). Same batch layout as `AllToAllEP`: the ranks of a TP group keep disjoint
    slices of the batch they share and gather the outputs back over TP."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        tokens, expert_ids, weights, state = self._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
        if tokens.shape[0] == 0:
            # No token for this rank's experts: one zero-weight row keeps the received (empty) tokens and weights in
            # the graph, so this rank joins the backward all-to-alls the other ranks wait for.
            expert_output = self.experts_forward(
                tokens.sum(dim=0, keepdim=True), expert_ids.new_zeros((1, 1)), weights.sum(dim=0, keepdim=True)[:, :1]
            )[:0]
        else:
            expert_output = self.experts_forward(tokens, expert_ids, weights)
        return self._combine_tokens(expert_output, state)

    def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
        """One row per (token, destination rank): the rows this rank's experts run on, their (rows, k) local expert
        ids and weights (sentinel and 0 on the slots of other ranks), and what `_combine_tokens` needs."""
        num_tokens = hidden_states.size(0)
        if self.tp_mesh.size() > 1:
            # As in AllToAllEP: Replicate -> Shard(0) is a local chunk; its backward all-gathers the row gradients.
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)])
                .to_local()
                for t in (hidden_states, top_k_index, top_k_weights)
            )
        ep_group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
        owner = top_k_index // self.num_local_experts  # (N, k) the rank of each selected expert

        # (N, ep_size): which ranks serve each token; rows go out grouped by rank, tokens in order within a rank
        serves = torch.zeros(owner.size(0), ep_size, dtype=torch.bool, device=owner.device)
        serves.scatter_(1, owner, True)
        destination, token_index = serves.T.nonzero(as_tuple=True)
        on_destination = owner[token_index] == destination[:, None]  # (S, k) the slots each row's rank serves
        send_expert_ids = torch.where(on_destination, top_k_index[token_index] % self.num_local_experts,
                                      self.num_local_experts)  # fmt: skip
        send_weights = top_k_weights[token_index].masked_fill(~on_destination, 0.0)

        send_counts = serves.sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        all_to_all_single(recv_counts, send_counts, group=ep_group)
        send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()  # the layer's one host sync

        recv_tokens = all_to_all_single_autograd(hidden_states[token_index], recv_sizes, send_sizes, ep_group)
        recv_weights = all_to_all_single_autograd(send_weights, recv_sizes, send_sizes, ep_group)
        recv_expert_ids = send_expert_ids.new_empty(sum(recv_sizes), send_expert_ids.size(1))
        all_to_all_single(recv_expert_ids, send_expert_ids, recv_sizes, send_sizes, group=ep_group)
        # hand the experts the received rows, not the all-to-all's pending results (see AllToAllEP)
        recv_tokens, recv_weights = _WaitTensor.apply(recv_tokens), _WaitTensor.apply(recv_weights)
        state = _DedupState(token_index, send_sizes, recv_sizes, hidden_states.size(0), num_tokens)
        return recv_tokens, recv_expert_ids, recv_weights, state

    def _combine_tokens(self, expert_output, state):
        """Each partial sum back to the rank that sent the token, added up per token."""
        hidden_dim = expert_output.size(-1)
        partial_sums = all_to_all_single_autograd(
            expert_output, state.send_sizes, state.recv_sizes, self.ep_mesh.get_group()
        )
        partial_sums = _WaitTensor.apply(partial_sums)
        output = partial_sums.new_zeros(state.num_local_tokens, hidden_dim)
        output = output.index_add(0, state.token_index, partial_sums)
        if self.tp_mesh.size() == 1:
            return output
        # Shard(0) -> Replicate is one all-gather of the row slices, uneven or empty ones too.
        output = DTensor.from_local(
            output.contiguous(), self.tp_mesh, [Shard(0)], shape=(state.num_tokens, hidden_dim), stride=(hidden_dim, 1)
        )
        return output.full_tensor()


EPImplementationInterface.register(DEDUP_EP_IMPLEMENTATION, DedupAllToAllEP)


class AllToAllSend(NamedTuple):
    """What one all-to-all call sent to the ranks other than this one."""

    rows: int
    row_bytes: int  # bytes of one row (the tensor's trailing dimensions)

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass
class AllToAllTraffic:
    """What the expert-parallel all-to-alls of this process sent to other ranks while `record()` was active: the
    forward exchanges of transformers' EP implementations and of `DedupAllToAllEP` (token rows, their routing
    metadata and split counts; the backward all-to-alls, which autograd runs inside torch, are not seen)."""

    calls: list[AllToAllSend] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(call.bytes for call in self.calls)

    def _count(self, tensor: torch.Tensor, split_sizes: list[int] | None, group) -> None:
        """`tensor`'s rows go to the ranks of `group` by `split_sizes` (equal splits when None)."""
        group_size, own_rank = dist.get_world_size(group), dist.get_rank(group)
        rows = list(split_sizes) if split_sizes else [tensor.size(0) // group_size] * group_size
        remote_rows = sum(count for rank, count in enumerate(rows) if rank != own_rank)
        self.calls.append(AllToAllSend(remote_rows, math.prod(tensor.shape[1:]) * tensor.element_size()))

    @contextlib.contextmanager
    def record(self) -> Iterator[AllToAllTraffic]:
        """Count the all-to-alls that transformers' `expert_parallel` module and this module issue."""
        modules = (expert_parallel, sys.modules[__name__])
        originals = [(module, module.all_to_all_single, module.all_to_all_single_autograd) for module in modules]

        def counted_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            self._count(input, input_split_sizes, group)
            return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

        def counted_autograd_all_to_all(input, output_split_sizes, input_split_sizes, group):
            self._count(input, input_split_sizes, group)
            return functional_collectives.all_to_all_single_autograd(
                input, output_split_sizes, input_split_sizes, group
            )

        for module in modules:
            module.all_to_all_single = counted_all_to_all
            module.all_to_all_single_autograd = counted_autograd_all_to_all
        try:
            yield self
        finally:
            for module, plain, autograd in originals:
                module.all_to_all_single = plain
                module.all_to_all_single_autograd = autograd
