"""User journeys through the shared MoE core: mixed precision with the `moezoo` experts, routing statistics of
unusual models."""

import pytest
import torch
from torch import nn

from moezoo.demos.moe_core import TokenMoeModel, masked_mse
from moezoo.modeling.moe import (
    MoeLayerSpec, SparseMoeBlock, SwiGLUExperts, TopKRouter, plot_routing_heatmap, record_routing,
)
from test_moe_core import experts_config, randomize


def outputs_and_grads(model, features, mask, targets):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        predictions = model(features, mask)[0]
    masked_mse(predictions.float(), targets, mask).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return predictions.detach(), grads


def test_moezoo_experts_train_under_cpu_autocast_like_grouped_mm():
    """Under autocast the experts receive bf16 activations while their weights stay fp32 (autocast does not reach
    the out= products): `moezoo` must answer like transformers' grouped_mm, which computes in the weights' dtype."""
    spec = MoeLayerSpec(hidden_size=64, num_experts=8, num_experts_per_tok=2, expert_intermediate_size=64)
    generator = torch.Generator().manual_seed(0)
    features, targets = torch.randn(3, 6, 16, generator=generator), torch.randn(3, 6, 8, generator=generator)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[2, 4:] = 0
    results = {}
    for implementation in ("grouped_mm", "moezoo"):
        torch.manual_seed(0)
        results[implementation] = outputs_and_grads(
            TokenMoeModel(16, 8, spec, num_layers=2, experts_impl=implementation), features, mask, targets
        )
    (out_ref, grads_ref), (out, grads) = results["grouped_mm"], results["moezoo"]
    assert out.dtype == out_ref.dtype == torch.bfloat16
    assert (out.float() - out_ref.float()).abs().max() < 2e-2
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert (grad - grads_ref[name]).abs().max() <= 1e-2 * grads_ref[name].abs().max() + 1e-6, name


@pytest.mark.parametrize("input_dtype, weight_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_moezoo_experts_take_inputs_in_another_dtype_than_their_weights(input_dtype, weight_dtype):
    spec = MoeLayerSpec(hidden_size=32, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=16)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 32, generator=generator).to(input_dtype)
    top_k_index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(10)])
    top_k_weights = torch.rand(10, 2, generator=generator).to(input_dtype)
    results = []
    for implementation in ("grouped_mm", "moezoo"):
        experts = randomize(SwiGLUExperts(experts_config(implementation), spec)).to(weight_dtype)
        x = hidden.clone().requires_grad_(True)
        out = experts(x, top_k_index, top_k_weights)
        out.float().sum().backward()
        results.append((out.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for reference, ours in zip(*results):
        assert ours.dtype == reference.dtype
        assert (ours.float() - reference.float()).abs().max() <= 2e-2 * reference.float().abs().max()


def test_routing_heatmap_of_layers_with_different_expert_counts(tmp_path):
    layers = nn.ModuleList(
        randomize(SparseMoeBlock(experts_config("moezoo"), MoeLayerSpec(
            hidden_size=16, num_experts=num_experts, num_experts_per_tok=2, expert_intermediate_size=8,
        ), layer_idx=i), seed=i) for i, num_experts in enumerate((4, 8))
    )
    hidden = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(layers, group_names=["text", "image"]) as stats:
        stats.set_groups((torch.arange(5) >= 2).long().expand(2, 5))
        for layer in layers:
            layer(hidden)
    assert [counts.shape for counts in stats.counts.values()] == [(2, 4), (2, 8)]
    path = plot_routing_heatmap(stats, tmp_path / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_block_recorded_alone_is_named_by_its_layer_name_and_takes_empty_batches():
    block = randomize(SparseMoeBlock(experts_config("moezoo"), MoeLayerSpec(
        hidden_size=16, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=8,
    ), layer_idx=3))
    with torch.no_grad(), record_routing(block, group_names=["text", "image"]) as stats:
        stats.set_groups(torch.zeros(0, 5, dtype=torch.long))
        block(torch.randn(0, 5, 16))
        stats.set_groups(torch.ones(1, 5, dtype=torch.long))
        block(torch.randn(1, 5, 16))
    assert list(stats.counts) == ["layer 3"]
    assert stats.counts["layer 3"].sum(dim=1).tolist() == [0, 10]


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float16)])
def test_casting_a_model_keeps_the_balancing_bias_in_fp32(cast):
    """bf16 cannot hold the bias's ~1e-3 updates on top of its values: a cast model keeps it fp32, unrounded."""
    router = TopKRouter(MoeLayerSpec(hidden_size=8, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=8,
                                     router_type="sigmoid", routing_bias=True))
    router.e_score_correction_bias.copy_(torch.tensor([1.0, 1.001, -0.3337, 2.0e-4]))
    expected = router.e_score_correction_bias.clone()
    cast(router)
    assert router.weight.dtype != torch.float32
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, expected)
    assert dict(router.named_buffers())["e_score_correction_bias"] is router.e_score_correction_bias
