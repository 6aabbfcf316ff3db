"""SMoES' expert-parallel alignment (spec smoes.md §3): the bin -> device placement, the analytic dispatch metrics,
the bin-aligned export permutation (E4), and real expert parallelism on gloo processes.

The gloo tests run transformers' `all_to_all` EP and moezoo's `dedup` EP on a tiny Qwen3-MoE against the same model in
one process. Each rank checks its loss and gradients, the rows each layer sends to every rank (the analytic counts
from the reference's own routing: (token, expert) pairs per owner rank for `all_to_all`, tokens per rank hosting any
of their experts for `dedup`), and the bytes of token rows its all-to-alls actually sent to other ranks. The dedup EP
also runs under tensor parallelism (`tp_size=2`: its TP branch, where the ranks sharing a batch split its tokens).
Run by pytest, the module launches itself under torchrun once per world size (a launch costs more than the checks):
each process runs the checks below in sequence (`check_expert_parallel` for both implementations, and on two
processes `check_tensor_parallel` and `check_zoo_experts` too) and writes each check's failure, if any, for the test
that asks for it.
"""

import contextlib
import copy
import json
import os
import subprocess
import sys
import traceback
from functools import partial
from pathlib import Path

import pytest
import torch
from test_smoes_model import TEXT_CONFIG, TOKEN_IDS, VISION_CONFIG, inputs, smoes_config  # noqa: F401 (fixture)
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from moezoo.modeling.moe import SORTED_EXPERTS_IMPLEMENTATION
from moezoo.modeling.moe.smoes.bins import contiguous_bins
from moezoo.modeling.moe.smoes.placement import (
    bin_aligned_order,
    check_placement,
    device_of_expert,
    dispatch_metrics,
    random_routing_dispatch,
    smoes_export_bin_aligned,
)
from moezoo.modeling.smoes import SmoesQwen3_5MoeForConditionalGeneration


MODEL_CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=64, norm_topk_prob=True, router_aux_loss_coef=0.0,  # the reference reads the routing
)  # fmt: skip
BATCH, SEQUENCE = 2, 6
# the zoo's experts behind the dedup EP: (experts implementation, routing) of each check_zoo_experts run
ZOO_EXPERT_RUNS = (("eager", "random"), (SORTED_EXPERTS_IMPLEMENTATION, "random"), ("eager", "first-rank"))


def analytic_send_rows(top_k_index: torch.Tensor, experts_per_rank: int, world: int, dedup: bool) -> torch.Tensor:
    """(world,) rows one rank's tokens, (N, k) top-k, send to each rank (itself included)."""
    owner = top_k_index // experts_per_rank
    if dedup:
        return torch.nn.functional.one_hot(owner, world).amax(dim=1).sum(dim=0)
    return torch.bincount(owner.reshape(-1), minlength=world)


@contextlib.contextmanager
def recording_dispatch(ep_class, record):
    """`ep_class._dispatch_tokens` calls `record(self, result)` after each dispatch, until the block ends."""
    dispatch = ep_class._dispatch_tokens

    def recorded(self, *args):
        result = dispatch(self, *args)
        record(self, result)
        return result

    ep_class._dispatch_tokens = recorded
    try:
        yield
    finally:
        ep_class._dispatch_tokens = dispatch


def expert_parallel_reference(model_dir: str, world: int) -> tuple:
    """The single-process reference on every rank's batch: the batches, their outputs (losses and routing), and the
    gradients of the mean loss."""
    from transformers import Qwen3MoeForCausalLM

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (world, BATCH, SEQUENCE), generator=generator)
    reference = Qwen3MoeForCausalLM.from_pretrained(model_dir, experts_implementation="eager")
    outputs = [reference(input_ids=ids, labels=ids, output_router_logits=True) for ids in input_ids]
    torch.stack([output.loss for output in outputs]).mean().backward()
    return input_ids, outputs, {name: param.grad for name, param in reference.named_parameters()}


def check_expert_parallel(model_dir: str, implementation: str, reference: tuple) -> int:
    """Loss, gradients, rows sent and bytes sent of one EP implementation against `reference`; returns the bytes
    this rank sent."""
    import transformers.distributed.expert_parallel as transformers_ep
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    import moezoo.modeling.moe.expert_parallel as moezoo_ep

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    input_ids, outputs, reference_grads = reference
    experts_per_rank, k = MODEL_CONFIG["num_experts"] // world, MODEL_CONFIG["num_experts_per_tok"]
    send_rows = torch.stack([  # (layers, source rank, destination rank)
        torch.stack([analytic_send_rows(logits.topk(k).indices, experts_per_rank, world, implementation == "dedup")
                     for logits in output.router_logits])
        for output in outputs
    ], dim=1)  # fmt: skip

    recorded_send_sizes = []
    ep_class = moezoo_ep.DedupAllToAllEP if implementation == "dedup" else transformers_ep.AllToAllEP
    config = DistributedConfig(tp_size=1, fsdp_size=world, ep_size=world, ep_implementation=implementation)
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, distributed_config=config, experts_implementation="eager")
    record = lambda self, result: recorded_send_sizes.append(result[3].send_sizes)  # noqa: E731
    with recording_dispatch(ep_class, record), moezoo_ep.AllToAllTraffic().record() as traffic:
        loss = model(input_ids=input_ids[rank], labels=input_ids[rank]).loss
    loss.backward()

    torch.testing.assert_close(loss, outputs[rank].loss, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert recorded_send_sizes == send_rows[:, rank].tolist()
    # token rows (hidden_size floats) leave this rank twice per layer: its own tokens to the other ranks, and the
    # outputs of the other ranks' tokens back to them
    others = [r for r in range(world) if r != rank]
    remote_rows = send_rows[:, rank, others].sum() + send_rows[:, others, rank].sum()
    row_bytes = MODEL_CONFIG["hidden_size"] * 4
    assert sum(call.bytes for call in traffic.calls if call.row_bytes == row_bytes) == remote_rows * row_bytes
    return traffic.bytes_sent


def check_tensor_parallel(model_dir: str) -> None:
    """`DedupAllToAllEP` under tensor parallelism (`tp_size=2, ep_size=2`): both ranks hold the same batch, each
    dispatches its slice of the tokens (15 tokens: uneven slices) and gathers the outputs back over the TP group; the
    loss and every gradient (gathered) equal one process."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    import moezoo.modeling.moe.expert_parallel as moezoo_ep

    input_ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(0))
    reference = Qwen3MoeForCausalLM.from_pretrained(model_dir, experts_implementation="eager")
    reference_loss = reference(input_ids=input_ids, labels=input_ids).loss
    reference_loss.backward()

    tp_sizes = []
    config = DistributedConfig(tp_size=2, ep_size=2, ep_implementation="dedup")
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, distributed_config=config, experts_implementation="eager")
    with recording_dispatch(moezoo_ep.DedupAllToAllEP, lambda self, result: tp_sizes.append(self.tp_mesh.size())):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    assert tp_sizes == [2] * MODEL_CONFIG["num_hidden_layers"]  # every MoE layer took the TP branch
    torch.testing.assert_close(loss, reference_loss, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, reference.get_parameter(name).grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")  # fmt: skip


def check_zoo_experts(implementation: str, routing: str) -> None:
    """The zoo's own `SwiGLUExperts` (eager, then moezoo's CPU implementation) behind `DedupAllToAllEP`, each rank
    holding its contiguous expert range: outputs and input gradients equal one process, and each rank's expert
    gradients are the slice of the reference's over every rank's tokens. With `routing="first-rank"` every token
    picks rank 0's experts, so the other ranks receive nothing and must still join the backward exchanges."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import PreTrainedConfig

    from moezoo.modeling.moe import DedupAllToAllEP, MoeLayerSpec, SwiGLUExperts

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    config = PreTrainedConfig()
    config._experts_implementation = implementation
    torch.manual_seed(0)
    reference = SwiGLUExperts(config, MoeLayerSpec(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                   expert_intermediate_size=8))  # fmt: skip
    with torch.no_grad():
        reference.gate_up_proj.normal_(std=0.25)
        reference.down_proj.normal_(std=0.35)
    hidden_states = torch.randn(world, 10, 16, requires_grad=True)
    top_k_index = torch.rand(world, 10, 8 if routing == "random" else 8 // world).topk(3).indices
    top_k_weights = torch.rand(world, 10, 3, requires_grad=True)
    outputs = [reference(*inputs) for inputs in zip(hidden_states, top_k_index, top_k_weights)]
    torch.stack(outputs).square().sum().backward()

    local = SwiGLUExperts(config, MoeLayerSpec(hidden_size=16, num_experts=8 // world, num_experts_per_tok=3,
                                               expert_intermediate_size=8))  # fmt: skip
    experts = slice(rank * local.num_experts, (rank + 1) * local.num_experts)
    with torch.no_grad():
        local.gate_up_proj.copy_(reference.gate_up_proj[experts])
        local.down_proj.copy_(reference.down_proj[experts])
    local._is_expert_parallel = True
    rank_hidden_states = hidden_states[rank].detach().requires_grad_()
    rank_weights = top_k_weights[rank].detach().requires_grad_()
    output = DedupAllToAllEP(local, mesh["ep"], mesh["tp"])(rank_hidden_states, top_k_index[rank], rank_weights)
    output.square().sum().backward()

    torch.testing.assert_close(output, outputs[rank], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rank_hidden_states.grad, hidden_states.grad[rank], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rank_weights.grad, top_k_weights.grad[rank], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(local.gate_up_proj.grad, reference.gate_up_proj.grad[experts], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(local.down_proj.grad, reference.down_proj.grad[experts], atol=1e-5, rtol=1e-5)


def run_checks(model_dir: str, result_dir: str) -> None:
    """Every check of this world size in one process group, in the same order on every rank; each rank writes the
    checks' failures (None where a check passed) and the bytes each EP implementation sent."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = expert_parallel_reference(model_dir, world)
    checks = {implementation: partial(check_expert_parallel, model_dir, implementation, reference)
              for implementation in ("all_to_all", "dedup")}  # fmt: skip
    if world == 2:
        checks["tensor-parallel"] = partial(check_tensor_parallel, model_dir)
        checks.update({f"zoo-experts {implementation} {routing}": partial(check_zoo_experts, implementation, routing)
                       for implementation, routing in ZOO_EXPERT_RUNS})  # fmt: skip
    results = {}
    for name, check in checks.items():
        try:  # an assertion fails after the check's collectives, so the ranks stay in step for the next check
            results[name] = {"failure": None, "bytes_sent": check()}
        except AssertionError:
            results[name] = {"failure": traceback.format_exc(), "bytes_sent": None}
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL_CONFIG)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """`launched(world)`: every rank's check results of the launch on `world` processes (run once per world size)."""
    results = {}

    def launch(world: int) -> list[dict]:
        if world not in results:
            from conftest import free_port

            result_dir = tmp_path_factory.mktemp(f"world{world}")
            result = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), __file__, model_dir, result_dir],
                env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr[-4000:]
            results[world] = [json.loads(path.read_text()) for path in sorted(result_dir.glob("rank*.json"))]
            assert len(results[world]) == world
        return results[world]

    return launch


def passed(ranks: list[dict], check: str) -> list[dict]:
    """Fail the test with the first rank's failure of `check`; else each rank's result of it."""
    for rank, results in enumerate(ranks):
        assert results[check]["failure"] is None, f"rank {rank}, {check}:\n{results[check]['failure']}"
    return [results[check] for results in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dedup_and_stock_ep_match_one_process_and_send_the_analytic_rows(launched, world):
    bytes_sent = {implementation: sum(result["bytes_sent"] for result in passed(launched(world), implementation))
                  for implementation in ("all_to_all", "dedup")}  # fmt: skip
    # top-2 of 8 experts: a token's two experts often share a rank, and dedup sends it there once
    assert bytes_sent["dedup"] < bytes_sent["all_to_all"]


def test_importing_moezoo_registers_the_dedup_ep():
    from conftest import run_python

    run_python("""
        import moezoo
        from transformers.distributed.expert_parallel import EPImplementationInterface
        assert EPImplementationInterface()["dedup"].__name__ == "DedupAllToAllEP"
    """)


# --- placement and analytic dispatch metrics (single process) -----------------------------------------------------


def test_bins_map_to_devices_through_the_bin_aligned_order():
    bins = torch.tensor([3, 0, 1, 0, 1, 2, 3, 2])  # spec §8.7's example bins
    assert bin_aligned_order(bins).tolist() == [1, 3, 2, 4, 5, 7, 0, 6]
    assert device_of_expert(bins, num_bins=4, num_devices=2).tolist() == [1, 0, 0, 0, 0, 1, 1, 1]
    # more devices than bins: each bin spans two devices, split in expert index order
    assert device_of_expert(bins // 2, num_bins=2, num_devices=4).tolist() == [2, 0, 0, 1, 1, 2, 3, 3]
    assert device_of_expert(contiguous_bins(8, 4), num_bins=4, num_devices=2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "num_experts, num_bins, num_devices, message",
    [
        (8, 3, 2, "smoes_num_bins=3 must divide the 8 experts"),
        (8, 2, 3, "3 expert-parallel devices must divide the 8 experts"),
        (12, 4, 6, "the bin count must divide the device count"),
        (12, 4, 3, "the device count must divide the bin count"),
    ],
)
def test_placements_that_split_bins_unevenly_are_refused(num_experts, num_bins, num_devices, message):
    with pytest.raises(ValueError, match=message):
        check_placement(num_experts, num_bins, num_devices)


def test_random_routing_closed_forms_are_the_spec_numbers_and_match_enumeration():
    expected = random_routing_dispatch(num_experts=64, top_k=6, num_devices=2)
    assert (round(expected.span_frac, 3), round(expected.remote_any_frac, 3)) == (0.976, 0.988)
    assert expected.remote_pair_frac == 0.5 and expected.dedup_remote_devices_per_token == expected.remote_any_frac
    # exactly, over every top-2 choice of 8 experts on 4 devices, with every home
    choices = torch.combinations(torch.arange(8), 2)
    top_k_index = choices.repeat(4, 1)[None]  # (1, 4 * 28, 2)
    home = torch.arange(4).repeat_interleave(len(choices))[None]
    measured = dispatch_metrics(top_k_index, torch.ones_like(home, dtype=torch.bool), torch.arange(8) // 2, home, 4)
    closed_form = random_routing_dispatch(num_experts=8, top_k=2, num_devices=4)
    for name, value in closed_form.to_dict().items():
        assert getattr(measured, name) == pytest.approx(value, abs=1e-12), name


def test_sampled_random_routing_gives_the_spec_numbers():
    generator = torch.Generator().manual_seed(0)
    top_k_index = torch.rand(1, 20000, 64, generator=generator).topk(6).indices
    home = torch.arange(20000)[None] % 2  # sample i lives on rank i mod D
    measured = dispatch_metrics(top_k_index, torch.ones_like(home, dtype=torch.bool), torch.arange(64) // 32, home, 2)
    assert measured.span_frac == pytest.approx(0.976, abs=0.005)
    assert measured.remote_any_frac == pytest.approx(0.988, abs=0.005)
    assert measured.remote_pair_frac == pytest.approx(0.500, abs=0.01)
    assert measured.load_imbalance == pytest.approx(1.0, abs=0.01)


# --- E4: the bin-aligned export ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def binned_smoes_model():
    """The tiny SMoES Qwen3.5-MoE VLM with 4 bins whose experts are scattered over the index range, and routers
    drawn at random (initialised to zero, every router would tie, and top-k would break ties by index)."""
    torch.manual_seed(0)
    model = SmoesQwen3_5MoeForConditionalGeneration(smoes_config(smoes_num_bins=4, smoes_ep_devices=2))
    model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(0)
    for layer in model.model.language_model.layers:
        layer.mlp.gate.weight.data.normal_(generator=generator)
        state = layer.mlp.smoes
        state.expert_counts_ema.copy_(torch.rand(state.expert_counts_ema.shape, generator=generator))
        state.reassign_bins()
    return model.eval()


def test_export_puts_each_bin_in_a_contiguous_range_and_keeps_logits_and_dispatch(binned_smoes_model, inputs, tmp_path):
    model = copy.deepcopy(binned_smoes_model)
    states = model.model.language_model.smoes_states
    assert any(not torch.equal(state.bins, contiguous_bins(8, 4)) for state in states)
    valid, home = inputs["attention_mask"].bool(), torch.arange(2)[:, None].expand(2, 13)

    def logits_and_dispatch(model):
        with torch.no_grad():
            output = model(**inputs, output_router_logits=True)
        placement = [device_of_expert(state.bins, 4, 2) for state in states]
        dispatch = [dispatch_metrics(logits.view(2, 13, -1).topk(2).indices, valid, devices, home, 2).to_dict()
                    for logits, devices in zip(output.router_logits, placement)]  # fmt: skip
        return output.logits, dispatch

    logits, dispatch = logits_and_dispatch(model)
    smoes_export_bin_aligned(model)
    assert all(torch.equal(state.bins, contiguous_bins(8, 4)) for state in states)
    exported_logits, exported_dispatch = logits_and_dispatch(model)
    torch.testing.assert_close(exported_logits, logits, atol=1e-6, rtol=0)
    assert exported_dispatch == dispatch

    # transformers' own class reads the exported weights (the SMoES buffers are extra) and routes the same
    model.save_pretrained(tmp_path)
    plain = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path, config=Qwen3_5MoeConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **TOKEN_IDS),
        experts_implementation="eager",
    )  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(**inputs).logits, logits, atol=1e-6, rtol=0)


def test_export_refuses_group_limited_routing_and_uneven_placements(binned_smoes_model):
    model = copy.deepcopy(binned_smoes_model)
    with pytest.raises(ValueError, match="3 expert-parallel devices must divide the 8 experts"):
        smoes_export_bin_aligned(model, num_devices=3)
    model.config.text_config.n_group = 2
    with pytest.raises(ValueError, match="n_group=2: group-limited routing"):
        smoes_export_bin_aligned(model)

@pytest.mark.slow
def test_dedup_ep_runs_the_zoo_experts(launched):
    for implementation, routing in ZOO_EXPERT_RUNS:
        passed(launched(2), f"zoo-experts {implementation} {routing}")


@pytest.mark.slow
def test_dedup_ep_under_tensor_parallelism_matches_one_process(launched):
    passed(launched(2), "tensor-parallel")


if __name__ == "__main__":
    run_checks(*sys.argv[1:])
