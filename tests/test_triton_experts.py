"""`moezoo_triton`, the Triton experts implementation, against transformers' own implementations on the same weights.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py turns it on), in fp32; with one they are
compiled and run on it.
"""

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import use_experts_implementation

from moezoo.kernels import triton_kernels
from moezoo.kernels.triton_experts import kernel_activation
from moezoo.modeling.moe import GeluExperts, MoeLayerSpec, SwiGLUExperts


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(kind, hidden_act, num_experts=6, hidden=48, width=40, seed=0):
    config = PreTrainedConfig()
    spec = MoeLayerSpec(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=2,
                        expert_intermediate_size=width, hidden_act=hidden_act)
    module = kind(config, spec)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * parameter.shape[-1] ** -0.5)
    return module.to(DEVICE)


def routing(num_tokens, num_experts, top_k, hidden, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return x.to(DEVICE), index.reshape(num_tokens, top_k).to(DEVICE), weights.to(DEVICE)


def run(module, implementation, *inputs):
    module.config._experts_implementation = implementation
    with torch.no_grad():
        return module(*inputs)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach the Triton kernels (so a silent fallback cannot pass for them)."""
    calls = []
    forward = triton_kernels.experts_forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "experts_forward", counted)
    return calls


@pytest.mark.parametrize(("kind", "hidden_act"), [
    (SwiGLUExperts, "silu"),
    (SwiGLUExperts, "relu"),
    (GeluExperts, "gelu_pytorch_tanh"),
    (GeluExperts, "gelu"),
    (GeluExperts, "quick_gelu"),
])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_equals_transformers_implementations(kind, hidden_act, implementation, kernel_calls):
    module = experts(kind, hidden_act)
    inputs = routing(37, 6, 2, 48)
    expected = run(module, implementation, *inputs)
    got = run(module, "moezoo_triton", *inputs)
    assert kernel_calls == [(37, 48)]
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 6), (3, 64), (200, 4)])
def test_few_and_many_tokens_and_experts_without_tokens(num_tokens, num_experts, kernel_calls):
    module = experts(SwiGLUExperts, "silu", num_experts=num_experts)
    inputs = routing(num_tokens, num_experts, 2, 48)
    expected = run(module, "eager", *inputs)
    assert (run(module, "moezoo_triton", *inputs) - expected).abs().max() <= 1e-5
    assert len(kernel_calls) == 1


def test_an_expert_with_more_pairs_than_tokens(kernel_calls):
    """A token routed twice to one expert: that expert sees more pairs than the grid was sized for (one tile per
    token), so its programs loop over further tiles."""
    module = experts(SwiGLUExperts, "silu", num_experts=3)
    x, _, weights = routing(40, 3, 2, 48)
    index = torch.zeros(40, 2, dtype=torch.int64, device=DEVICE)
    expected = run(module, "eager", x, index, weights)
    assert (run(module, "moezoo_triton", x, index, weights) - expected).abs().max() <= 1e-5
    assert kernel_calls


def test_no_tokens():
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = torch.empty(0, 48), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2)
    assert run(module, "moezoo_triton", x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE)).shape == (0, 48)


@use_experts_implementation(is_transposed=True, has_bias=True)
class TransposedExperts(nn.Module):
    """SwiGLU experts with biases in the transposed layout (gate_up (E, H, 2I), down (E, I, H)), as GPT-OSS stores
    them, with the default gate."""

    def __init__(self, config, num_experts=5, hidden=32, width=48):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, hidden, 2 * width) * hidden**-0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(num_experts, 2 * width))
        self.down_proj = nn.Parameter(torch.randn(num_experts, width, hidden) * width**-0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, hidden))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        output = torch.zeros_like(hidden_states)
        for token, (experts, weights) in enumerate(zip(top_k_index.tolist(), top_k_weights)):
            for expert, weight in zip(experts, weights):
                gate, up = (hidden_states[token] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]).chunk(2)
                hidden = self.act_fn(gate) * up
                output[token] += weight * (hidden @ self.down_proj[expert] + self.down_proj_bias[expert])
        return output


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_transposed_layout_with_biases(implementation, kernel_calls):
    torch.manual_seed(0)
    module = TransposedExperts(PreTrainedConfig()).to(DEVICE)
    inputs = routing(29, 5, 3, 32)
    expected = run(module, implementation, *inputs)
    assert (run(module, "moezoo_triton", *inputs) - expected).abs().max() <= 1e-5 * expected.abs().max().item()
    assert kernel_calls


def test_on_a_transformers_model(kernel_calls):
    """`experts_implementation="moezoo_triton"` on transformers' own Qwen3-MoE gives eager's logits."""
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(DEVICE).eval()
    ids = torch.randint(0, 64, (2, 6), device=DEVICE)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        expected = model(ids).logits
        model.set_experts_implementation("moezoo_triton")
        got = model(ids).logits
    assert len(kernel_calls) == 2  # one per MoE layer
    assert (got - expected).abs().max() < 1e-5


def test_calls_it_does_not_cover_go_to_moezoo(kernel_calls, monkeypatch):
    """Training (gradients), an activation the kernels lack, and the CPU without the interpreter run on the `moezoo`
    implementation, with the same results as eager and gradients that flow."""
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = routing(11, 6, 2, 48)
    module.config._experts_implementation = "eager"
    x_eager = x.clone().requires_grad_(True)
    module(x_eager, index, weights).sum().backward()
    expected_grads = x_eager.grad, module.gate_up_proj.grad.clone()
    module.zero_grad()

    module.config._experts_implementation = "moezoo_triton"
    x_triton = x.clone().requires_grad_(True)
    module(x_triton, index, weights).sum().backward()
    assert (x_triton.grad - expected_grads[0]).abs().max() < 1e-5
    assert (module.gate_up_proj.grad - expected_grads[1]).abs().max() < 1e-5

    tanh_experts = experts(GeluExperts, "tanh")
    assert kernel_activation(tanh_experts.act_fn) is None
    assert (run(tanh_experts, "moezoo_triton", x, index, weights) - run(tanh_experts, "eager", x, index, weights)
            ).abs().max() < 1e-5
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert (run(module, "moezoo_triton", x, index, weights) - run(module, "eager", x, index, weights)
                ).abs().max() < 1e-5
    assert kernel_calls == []


@pytest.mark.skipif(DEVICE != "cpu", reason="the indices are checked on the host only (a GPU would need a sync)")
def test_expert_index_outside_the_layer_is_named():
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = routing(5, 6, 2, 48)
    index[3, 1] = 6
    with pytest.raises(ValueError, match="routes to expert 6, but this layer's experts are numbered 0..5"):
        run(module, "moezoo_triton", x, index, weights)


@pytest.mark.skipif(DEVICE != "cuda", reason="16-bit products are not exact in Triton's interpreter; checked on GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_on_a_gpu(dtype, kernel_calls):
    module = experts(SwiGLUExperts, "silu").to(dtype)
    x, index, weights = routing(64, 6, 2, 48)
    inputs = (x.to(dtype), index, weights.to(dtype))
    expected = run(module, "grouped_mm", *inputs)
    got = run(module, "moezoo_triton", *inputs)
    assert kernel_calls and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
