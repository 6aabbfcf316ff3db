"""The shared sparse-MoE core against transformers' own MoE blocks, the MoE-ViE reference formulas, and itself."""

import copy

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moezoo.modeling.moe import (
    GeluExperts,
    MoeLayerSpec,
    SparseMoeBlock,
    SwiGLUExperts,
    TopKRouter,
    load_balancing_loss,
    record_routing,
    router_z_loss,
    update_routing_biases,
)


IMPLEMENTATIONS = ["eager", "grouped_mm", "batched_mm", "moezoo"]


def experts_config(implementation="eager"):
    config = PreTrainedConfig()
    config._experts_implementation = implementation
    return config


def randomize(module, std=0.1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return module


def run_with_grads(block, x, upstream):
    x = x.clone().requires_grad_(True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def assert_same_outputs_and_grads(ours, reference, x, tolerance):
    upstream = torch.randn_like(x)
    out_ref, x_grad_ref, grads_ref = run_with_grads(reference, x, upstream)
    out, x_grad, grads = run_with_grads(ours, x, upstream)
    assert (out - out_ref).abs().max() <= tolerance
    assert (x_grad - x_grad_ref).abs().max() <= tolerance
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert (grads[name] - grads_ref[name]).abs().max() <= tolerance, name


# --- equality with transformers' own blocks ------------------------------------------------------------------
# Both sides run the same experts implementation: what is compared is the block (router, shared expert, glue).
# That the implementations agree with each other is tested further down.


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_equals_qwen3_5_moe_sparse_block(implementation):
    qwen_config = Qwen3_5MoeTextConfig(
        hidden_size=48, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    )
    qwen_config._experts_implementation = implementation
    reference = randomize(Qwen3_5MoeSparseMoeBlock(qwen_config))
    spec = MoeLayerSpec(
        hidden_size=48, num_experts=8, num_experts_per_tok=3, expert_intermediate_size=24,
        shared_expert_intermediate_size=40, shared_expert_gate=True,
    )
    ours = SparseMoeBlock(experts_config(implementation), spec, layer_idx=0)
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(1))
    assert_same_outputs_and_grads(ours, reference, x, tolerance=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_equals_qwen3_moe_sparse_block(implementation, norm_topk_prob):
    qwen_config = Qwen3MoeConfig(
        hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=norm_topk_prob
    )
    qwen_config._experts_implementation = implementation
    reference = randomize(Qwen3MoeSparseMoeBlock(qwen_config), seed=3)
    spec = MoeLayerSpec(
        hidden_size=32, num_experts=6, num_experts_per_tok=2, expert_intermediate_size=16, norm_topk_prob=norm_topk_prob
    )
    ours = SparseMoeBlock(experts_config(implementation), spec, layer_idx=0)
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    assert_same_outputs_and_grads(ours, reference, x, tolerance=1e-6)


def test_load_balancing_loss_equals_transformers():
    logits = tuple(torch.randn(20, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected = load_balancing_loss_func(logits, num_experts=8, top_k=2)
    assert torch.allclose(load_balancing_loss(logits, num_experts=8, top_k=2), expected, atol=1e-6)


def test_router_z_loss_formula():
    logits = [torch.randn(10, 4), torch.randn(5, 4)]
    expected = torch.stack([torch.log(torch.exp(l).sum(-1)).pow(2).mean() for l in logits]).mean()
    assert torch.allclose(router_z_loss(logits), expected, atol=1e-6)


# --- the MoE-ViE semantics (spec moe_vie.md §2.1), written out -------------------------------------------------


def moe_vie_reference(x, router_w, bias, gate_up, down, shared, top_k):
    """y = sum_{e in T(x)} g'_e E_e(x) + E_shared(x), T(x) = topk(sigmoid(W_r x) + b), g' = p / sum_T p."""
    outputs = []
    for token in x:
        p = torch.sigmoid(router_w @ token)
        chosen = torch.topk(p + bias, top_k).indices
        gates = p[chosen] / p[chosen].sum()
        y = torch.zeros_like(token)
        for gate, e in zip(gates, chosen):
            g, u = (gate_up[e] @ token).chunk(2)
            y = y + gate * (down[e] @ (torch.nn.functional.silu(g) * u))
        s_gate, s_up, s_down = shared
        y = y + s_down @ (torch.nn.functional.silu(s_gate @ token) * (s_up @ token))
        outputs.append(y)
    return torch.stack(outputs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sigmoid_router_with_selection_bias_and_shared_expert(implementation):
    spec = MoeLayerSpec(
        hidden_size=16, num_experts=7, num_experts_per_tok=3, expert_intermediate_size=8, router_type="sigmoid",
        routing_bias=True, shared_expert_intermediate_size=8,
    )
    block = randomize(SparseMoeBlock(experts_config(implementation), spec, layer_idx=1), seed=5)
    block.gate.e_score_correction_bias.copy_(torch.tensor([0.5, -0.5, 0.3, 0.0, -0.2, 0.8, 0.1]))
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(6))
    expected = moe_vie_reference(
        x, block.gate.weight, block.gate.e_score_correction_bias, block.experts.gate_up_proj, block.experts.down_proj,
        (block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight, block.shared_expert.down_proj.weight),
        top_k=3,
    )
    with torch.no_grad():
        out, _ = block(x)
    assert (out - expected).abs().max() < 1e-5


def test_bias_selects_but_never_weights():
    """The bias changes which experts are chosen; the chosen experts' weights are the renormalised unbiased p."""
    spec = MoeLayerSpec(hidden_size=8, num_experts=6, num_experts_per_tok=2, expert_intermediate_size=4,
                        router_type="sigmoid", routing_bias=True)
    router = randomize(TopKRouter(spec), std=0.5)
    x = torch.randn(50, 8)
    p = torch.sigmoid(x @ router.weight.T)
    for bias in (torch.zeros(6), torch.tensor([3.0, 0, 0, 0, 0, -3.0]), torch.randn(6)):
        router.e_score_correction_bias.copy_(bias)
        _, weights, index = router(x)
        assert torch.equal(index, torch.topk(p + bias, 2).indices)
        chosen = p.gather(1, index)
        assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-7)


# --- every implementation agrees ------------------------------------------------------------------------------


# width 32: moezoo's native SwiGLU row kernels (widths that are multiples of 16) between its BLAS GEMMs
@pytest.mark.parametrize("expert_type,hidden_act,width", [
    ("swiglu", "silu", 20), ("swiglu", "silu", 32), ("gelu", "gelu_pytorch_tanh", 20), ("swiglu", "gelu", 20),
])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS[1:])
def test_implementations_agree_on_outputs_and_gradients(implementation, expert_type, hidden_act, width):
    spec = MoeLayerSpec(hidden_size=24, num_experts=9, num_experts_per_tok=3, expert_intermediate_size=width,
                        expert_type=expert_type, hidden_act=hidden_act, router_type="sigmoid")
    reference = randomize(SparseMoeBlock(experts_config("eager"), spec, layer_idx=0), seed=7)
    ours = copy.deepcopy(reference)
    ours.experts.config = experts_config(implementation)
    x = torch.randn(4, 10, 24, generator=torch.Generator().manual_seed(8))
    assert_same_outputs_and_grads(ours, reference, x, tolerance=1e-5)


def test_sorted_experts_skip_weight_gradients_of_frozen_experts():
    spec = MoeLayerSpec(hidden_size=16, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=8)
    block = randomize(SparseMoeBlock(experts_config("moezoo"), spec, layer_idx=0))
    block.experts.requires_grad_(False)
    reference = copy.deepcopy(block)
    reference.experts.config = experts_config("eager")
    x = torch.randn(12, 16)
    assert_same_outputs_and_grads(block, reference, x, tolerance=1e-6)
    assert block.experts.gate_up_proj.grad is None


def test_sorted_experts_with_empty_experts_and_bf16():
    spec = MoeLayerSpec(hidden_size=16, num_experts=32, num_experts_per_tok=1, expert_intermediate_size=8)
    block = randomize(SparseMoeBlock(experts_config("eager"), spec, layer_idx=0)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)  # 3 tokens: most experts receive nothing
    upstream = torch.randn(3, 16, dtype=torch.bfloat16)
    out_ref, x_grad_ref, grads_ref = run_with_grads(block, x, upstream)
    block.experts.config = experts_config("moezoo")
    out, x_grad, grads = run_with_grads(block, x, upstream)
    assert (out.float() - out_ref.float()).abs().max() < 2e-2
    assert (x_grad.float() - x_grad_ref.float()).abs().max() < 2e-2
    untouched = grads["experts.gate_up_proj"].flatten(1).abs().sum(1) == 0
    assert untouched.sum() >= 29 and torch.equal(untouched, grads_ref["experts.gate_up_proj"].flatten(1).abs().sum(1) == 0)


def test_sorted_experts_on_a_transformers_model():
    """`experts_implementation="moezoo"` selects our implementation on transformers' own Qwen3-MoE."""
    from transformers import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        expected = model(ids).logits
        model.set_experts_implementation("moezoo")
        assert model.config._experts_implementation == "moezoo"
        got = model(ids).logits
    assert (got - expected).abs().max() < 1e-5


# --- padding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["eager", "moezoo"])
def test_padding_never_changes_valid_tokens_or_statistics(implementation):
    spec = MoeLayerSpec(hidden_size=16, num_experts=5, num_experts_per_tok=2, expert_intermediate_size=8,
                        router_type="sigmoid", routing_bias=True, shared_expert_intermediate_size=8)
    block = randomize(SparseMoeBlock(experts_config(implementation), spec, layer_idx=0), seed=4).train()
    valid = torch.randn(2, 5, 16)
    padded = torch.cat([valid, 100 * torch.randn(2, 3, 16)], dim=1)  # padding with wild values
    mask = torch.cat([torch.ones(2, 5), torch.zeros(2, 3)], dim=1).long()

    with record_routing(block) as unpadded_stats:
        out_valid, logits_valid = block(valid)
    counts_valid = block.gate.tokens_per_expert.clone()
    block.gate.tokens_per_expert.zero_()
    with record_routing(block) as padded_stats:
        out_padded, logits_padded = block(padded, attention_mask=mask)

    assert torch.equal(out_padded[:, :5], out_valid)
    assert torch.equal(out_padded[:, 5:], torch.zeros(2, 3, 16))
    assert torch.equal(logits_padded, logits_valid.reshape(-1, 5)) and logits_padded.shape == (10, 5)
    assert torch.equal(block.gate.tokens_per_expert, counts_valid)
    assert torch.equal(padded_stats.counts["layer 0"] if "layer 0" in padded_stats.counts else
                       next(iter(padded_stats.counts.values())), next(iter(unpadded_stats.counts.values())))


def test_given_routes_per_example_and_per_token():
    spec = MoeLayerSpec(hidden_size=8, num_experts=3, num_experts_per_tok=1, expert_intermediate_size=4,
                        router_type="given")
    block = randomize(SparseMoeBlock(experts_config("moezoo"), spec, layer_idx=2))
    x = torch.randn(2, 4, 8)
    out, logits = block(x, routes=torch.tensor([2, 0]))
    assert logits is None
    for b, e in enumerate([2, 0]):
        expected = block.experts.expert_forward(e, x[b])
        assert torch.allclose(out[b], expected, atol=1e-6)
    per_token = torch.tensor([[0, 1, 2, 0], [1, 1, 1, 1]])
    out_tokens, _ = block(x, routes=per_token)
    assert torch.allclose(out_tokens[1], block.experts.expert_forward(1, x[1]), atol=1e-6)
    with pytest.raises(ValueError, match=r"layer 2: route ids must lie in \[0, 3\)"):
        block(x, routes=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="needs `routes`"):
        block(x)
    with pytest.raises(ValueError, match="layer 2: routes must be integer expert ids, got dtype torch.float32"):
        block(x, routes=torch.tensor([0.7, 1.9]))
    out_int32, _ = block(x, routes=torch.tensor([2, 0], dtype=torch.int32))
    assert torch.equal(out_int32, out)


# --- balancing ----------------------------------------------------------------------------------------------------


def skewed_router(rule="zscore", rate=1e-2):
    spec = MoeLayerSpec(hidden_size=16, num_experts=8, num_experts_per_tok=2, expert_intermediate_size=4,
                        router_type="sigmoid", routing_bias=True, bias_update_rate=rate, bias_update_rule=rule)
    router = TopKRouter(spec).train()
    with torch.no_grad():
        router.weight.normal_(std=0.1)
        router.weight[:2] += 0.3  # experts 0 and 1 attract everything
    return router


def load_ratio(router, x):
    counts = torch.bincount(router(x)[2].flatten(), minlength=8).double()
    return float(counts.max() / counts.mean())


@pytest.mark.parametrize("rule", ["zscore", "sign"])
def test_bias_updates_reduce_load_imbalance_and_keep_gate_weights(rule):
    router = skewed_router(rule)
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0)) + 1.0
    router.tokens_per_expert.zero_()
    before = load_ratio(router, x)
    p = torch.sigmoid(x @ router.weight.T)
    for _ in range(300):
        router(x)
        step = router.update_bias()
        assert step is not None
        if rule == "zscore":
            assert abs(float(step.sum())) < 1e-9  # the z-score step sums to zero
    after = load_ratio(router, x)
    router.tokens_per_expert.zero_()
    assert after < 0.6 * before, (before, after)
    _, weights, index = router(x)
    chosen = p.gather(1, index)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-7)


def test_zscore_step_has_constant_norm():
    router = skewed_router("zscore", rate=1e-3)
    router(torch.randn(64, 16))
    step = router.update_bias()
    assert torch.isclose(step.norm(), torch.tensor(1e-3 * 8**0.5, dtype=step.dtype), rtol=1e-6)


def test_bias_counts_ignore_eval_and_checkpoint_recompute():
    router = skewed_router()
    x = torch.randn(10, 16, requires_grad=True)
    router.eval()
    router(x)
    assert router.tokens_per_expert.sum() == 0
    router.train()
    out = torch.utils.checkpoint.checkpoint(lambda h: router(h)[1], x, use_reentrant=False)
    out.sum().backward()  # the backward re-runs the forward
    assert router.tokens_per_expert.sum() == 10 * 2


def test_update_routing_biases_skips_frozen_routers():
    model = nn.ModuleList([skewed_router(), skewed_router()])
    model[1].weight.requires_grad_(False)
    for router in model:
        router(torch.randn(32, 16))
    assert update_routing_biases(model) == 1
    assert model[0].e_score_correction_bias.abs().sum() > 0
    assert model[1].e_score_correction_bias.abs().sum() == 0
    assert all(router.tokens_per_expert.sum() == 0 for router in model)


def test_update_routing_biases_on_layers_with_different_expert_counts():
    wide = skewed_router()
    narrow_spec = MoeLayerSpec(hidden_size=16, num_experts=4, num_experts_per_tok=1, expert_intermediate_size=4,
                               router_type="sigmoid", routing_bias=True, bias_update_rate=1e-2)
    narrow = TopKRouter(narrow_spec).train()
    narrow.weight.data.normal_(std=0.1)
    model = nn.ModuleList([wide, narrow])
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    for router in model:
        router(x)
    expected = [copy.deepcopy(router) for router in model]
    for router in expected:
        router.update_bias()
    assert update_routing_biases(model) == 2
    for router, reference in zip(model, expected):
        assert torch.equal(router.e_score_correction_bias, reference.e_score_correction_bias)


def test_sigmoid_scores_that_all_underflow_give_zero_weights_not_nan():
    spec = MoeLayerSpec(hidden_size=2, num_experts=2, num_experts_per_tok=1, expert_intermediate_size=4,
                        router_type="sigmoid", norm_topk_prob=True)
    router = TopKRouter(spec)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[-112.0, 0.0], [-120.0, 0.0]]))  # sigmoid(-112) is 0 in fp32
    logits, weights, index = router(torch.tensor([[1.0, 0.0]]))
    assert torch.isfinite(logits).all() and torch.equal(weights, torch.zeros(1, 1))


# --- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts": 0}, "num_experts"),
        ({"hidden_size": -4}, "hidden_size"),
        ({"expert_intermediate_size": 2.5}, "expert_intermediate_size"),
        ({"router_type": "learned"}, "router_type"),
        ({"hidden_act": "swishy"}, "hidden_act"),
        ({"expert_type": "relu"}, "expert_type"),
        ({"bias_update_rate": -0.1}, "bias_update_rate"),
        ({"bias_update_rule": "adam"}, "bias_update_rule"),
        ({"routing_bias": True}, "routing_bias"),
        ({"shared_expert_gate": True}, "shared_expert_gate"),
    ],
)
def test_invalid_spec_names_the_field(changes, field):
    values = dict(hidden_size=8, num_experts=8, num_experts_per_tok=2, expert_intermediate_size=4) | changes
    with pytest.raises(ValueError, match=field):
        MoeLayerSpec(**values)


def test_wrong_hidden_size_and_nan_logits_name_the_layer():
    spec = MoeLayerSpec(hidden_size=8, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=4)
    block = SparseMoeBlock(experts_config(), spec, layer_idx=3)
    with pytest.raises(ValueError, match="MoE layer 3: hidden states have size 12"):
        block(torch.randn(2, 12))
    x = torch.randn(2, 8)
    x[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="MoE layer 3: router logits contain NaN"):
        block(x)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        block(torch.randn(2, 3, 8), attention_mask=torch.ones(2, 4))


@pytest.mark.parametrize("implementation", ["moezoo", "moezoo_triton"])
def test_experts_called_with_mismatched_shapes_say_what_does_not_fit(implementation):
    """moezoo's kernels index raw memory: inputs that do not fit the weights raise instead of reading past them."""
    spec = MoeLayerSpec(hidden_size=64, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=64)
    experts = SwiGLUExperts(experts_config(implementation), spec)
    index, weights = torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="SwiGLUExperts: hidden_states has 128 features, but these experts take"):
            experts(torch.randn(5, 128), index, weights)
        with pytest.raises(ValueError, match=r"top_k_weights \(5, 3\) must have top_k_index's shape \(5, 2\)"):
            experts(torch.randn(5, 64), index, torch.rand(5, 3))
        with pytest.raises(ValueError, match=r"expected hidden_states \(tokens, hidden\)"):
            experts(torch.randn(4, 64), index, weights)


def test_router_logit_bias_enters_logits_and_trains():
    spec = MoeLayerSpec(hidden_size=8, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=4,
                        router_logit_bias=True)
    router = randomize(TopKRouter(spec), std=0.5)
    x = torch.randn(5, 8)
    logits, weights, _ = router(x)
    assert torch.allclose(logits, x @ router.weight.T + router.bias, atol=1e-6)
    weights.sum().backward()
    assert router.bias.grad is not None
    with pytest.raises(ValueError, match="router_logit_bias"):
        MoeLayerSpec(hidden_size=8, num_experts=4, num_experts_per_tok=1, expert_intermediate_size=4,
                     router_type="given", router_logit_bias=True)


@pytest.mark.parametrize("width", [12, 16])
@pytest.mark.parametrize("expert_type", ["swiglu", "gelu"])
def test_experts_handed_to_transformers_run_at_any_width_in_bf16(expert_type, width):
    """What the moezoo implementations hand to transformers (other devices, expert parallelism, compile tracing) runs
    for 16-bit experts whose rows are not 16-byte aligned (MoE-ViE-L/H's widths), which `grouped_mm` refuses."""
    from moezoo.kernels.sorted_experts import transformers_experts_forward

    torch.manual_seed(0)
    spec = MoeLayerSpec(hidden_size=32, num_experts=4, num_experts_per_tok=2, expert_intermediate_size=width,
                        expert_type=expert_type, hidden_act="silu" if expert_type == "swiglu" else "gelu")
    experts = (SwiGLUExperts if expert_type == "swiglu" else GeluExperts)(PreTrainedConfig(), spec)
    for parameter in experts.parameters():
        nn.init.normal_(parameter, std=0.2)
    experts = experts.to(torch.bfloat16)
    hidden_states = torch.randn(10, 32, dtype=torch.bfloat16)
    top_k_index = torch.randint(0, 4, (10, 2))
    top_k_weights = torch.rand(10, 2, dtype=torch.bfloat16)
    expected = copy.deepcopy(experts).float()(hidden_states.float(), top_k_index, top_k_weights.float())
    actual = transformers_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
    torch.testing.assert_close(actual.float(), expected, rtol=0.05, atol=0.05)
