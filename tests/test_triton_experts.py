"""`moezoo_triton`, the Triton experts implementation, against transformers' own implementations on the same weights:
outputs, and the gradients of the inputs, routing weights, weights and biases.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py turns it on), in fp32 and fp64; with one
they are compiled and run on it.
"""

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import use_experts_implementation
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from moezoo.kernels import moezoo_experts, triton_backward_kernels, triton_kernels
from moezoo.kernels.triton_experts import _device_reason, kernel_activation
from moezoo.modeling.moe import GeluExperts, MoeLayerSpec, SwiGLUExperts


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every activation the kernels compute, on gated experts without biases and on two-layer experts with biases.
KERNEL_EXPERTS = [
    (SwiGLUExperts, "silu"),
    (SwiGLUExperts, "relu"),
    (GeluExperts, "gelu_pytorch_tanh"),
    (GeluExperts, "gelu"),
    (GeluExperts, "quick_gelu"),
]


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


def gradients(module, implementation, x, index, weights):
    """The output, and the gradients of a fixed projection of it w.r.t. the inputs, the routing weights and every
    parameter."""
    module.config._experts_implementation = implementation
    module.zero_grad(set_to_none=True)
    x, weights = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    output = module(x, index, weights)
    (output * torch.linspace(-1, 1, output.shape[-1], device=output.device)).sum().backward()
    return [output.detach(), x.grad, weights.grad, *(parameter.grad for parameter in module.parameters())]


def assert_all_close(got, expected, rtol=1e-5):
    """Each tensor within `rtol` times the largest magnitude of the expected one (equal where that is 0)."""
    assert len(got) == len(expected)
    for got_tensor, expected_tensor in zip(got, expected):
        assert got_tensor.shape == expected_tensor.shape
        if expected_tensor.numel():
            assert (got_tensor - expected_tensor).abs().max() <= rtol * expected_tensor.abs().max()


def counter(monkeypatch, module, name):
    """Counts the calls of `module.name` (so a silent fallback cannot pass for the kernels)."""
    calls = []
    function = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls that reach the Triton forward kernels."""
    return counter(monkeypatch, triton_kernels, "experts_forward")


@pytest.fixture
def backward_calls(monkeypatch):
    """The calls that reach the Triton backward kernels."""
    return counter(monkeypatch, triton_backward_kernels, "experts_backward")


@pytest.mark.parametrize(("kind", "hidden_act"), KERNEL_EXPERTS)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_equals_transformers_implementations(kind, hidden_act, implementation, kernel_calls):
    module = experts(kind, hidden_act)
    inputs = routing(37, 6, 2, 48)
    expected = run(module, implementation, *inputs)
    got = run(module, "moezoo_triton", *inputs)
    assert kernel_calls == [(37, 48)]
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize(("kind", "hidden_act"), KERNEL_EXPERTS)
def test_gradients_equal_eager(kind, hidden_act, kernel_calls, backward_calls):
    """dX, the routing weights' gradient and every weight and bias gradient, SwiGLU (no biases) and GELU-family
    experts (with biases), in transformers' layout."""
    module = experts(kind, hidden_act)
    inputs = routing(37, 6, 2, 48)
    expected = gradients(module, "eager", *inputs)
    got = gradients(module, "moezoo_triton", *inputs)
    assert kernel_calls == [(37, 48)] and backward_calls
    assert_all_close(got, expected)


@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 6), (3, 64), (200, 4)])
def test_few_and_many_tokens_and_experts_without_tokens(num_tokens, num_experts, kernel_calls):
    """Most of 64 experts get no tokens (their weight gradients are 0); 200 tokens on 4 experts take several row
    tiles per expert."""
    module = experts(SwiGLUExperts, "silu", num_experts=num_experts)
    inputs = routing(num_tokens, num_experts, 2, 48)
    assert_all_close(gradients(module, "moezoo_triton", *inputs), gradients(module, "eager", *inputs))
    assert len(kernel_calls) == 1


def test_an_expert_with_more_pairs_than_tokens(kernel_calls, backward_calls):
    """A token routed twice to one expert: that expert sees more pairs than the grid was sized for (one tile per
    token), so its programs loop over further tiles."""
    module = experts(SwiGLUExperts, "silu", num_experts=3)
    x, _, weights = routing(40, 3, 2, 48)
    index = torch.zeros(40, 2, dtype=torch.int64, device=DEVICE)
    expected = gradients(module, "eager", x, index, weights)
    assert_all_close(gradients(module, "moezoo_triton", x, index, weights), expected)
    assert kernel_calls and backward_calls


def test_no_tokens():
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = torch.empty(0, 48), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2)
    output, grad_x, grad_weights, grad_gate_up, grad_down = gradients(
        module, "moezoo_triton", x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE)
    )
    assert output.shape == grad_x.shape == (0, 48) and grad_weights.shape == (0, 2)
    assert not grad_gate_up.any() and not grad_down.any()


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
                output[token] = output[token] + weight * (hidden @ self.down_proj[expert] + self.down_proj_bias[expert])
        return output


def test_transposed_layout_with_biases(kernel_calls, backward_calls):
    torch.manual_seed(0)
    module = TransposedExperts(PreTrainedConfig()).to(DEVICE)
    inputs = routing(29, 5, 3, 32)
    expected = gradients(module, "eager", *inputs)
    assert_all_close(gradients(module, "grouped_mm", *inputs), expected)  # the reference itself
    assert_all_close(gradients(module, "moezoo_triton", *inputs), expected)
    assert kernel_calls and backward_calls


def test_masked_slots_and_padding_tokens(kernel_calls, backward_calls):
    """Top-k' < k per token, as transformers' eager experts take it: a slot routed to the expert index E (one past
    the last, which eager skips) adds nothing and gets no gradient; a slot of routing weight 0 adds nothing but its
    weight gets the gradient every implementation gives it. A padding token routed nowhere gets 0 and no gradient."""
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=4, hidden_act="silu")
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(DEVICE)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(std=parameter.shape[-1] ** -0.5)
    x, index, weights = routing(12, 4, 3, 32)
    index[0, 2] = index[3, 1] = index[5, 0] = 4  # masked slots: k' = 2 for three tokens
    index[7] = 4  # a padding token
    weights[1, 2] = weights[2, 0] = 0.0
    expected = gradients(module, "eager", x, index, weights)
    got = gradients(module, "moezoo_triton", x, index, weights)
    assert_all_close(got, expected)
    output, grad_x, grad_weights = got[:3]
    assert not output[7].any() and not grad_x[7].any() and not grad_weights[index == 4].any()
    assert grad_weights[1, 2] != 0
    assert kernel_calls and backward_calls


def test_16_bit_activations_into_fp32_experts(kernel_calls, backward_calls):
    """Under autocast, bf16 activations reach fp32 experts: the kernels compute in fp32 and answer in bf16, with the
    input's gradient in bf16 and the weights' in fp32, as transformers' grouped_mm does."""
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = routing(13, 6, 2, 48)
    expected = gradients(module, "grouped_mm", x.bfloat16(), index, weights)
    got = gradients(module, "moezoo_triton", x.bfloat16(), index, weights)
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[3].dtype == torch.float32
    assert_all_close([got[0].float(), got[1].float()], [expected[0].float(), expected[1].float()], rtol=1e-2)
    assert_all_close(got[2:], expected[2:])
    assert kernel_calls and backward_calls


def test_gradcheck_in_float64():
    """The backward pass is the derivative of the forward pass (finite differences in fp64, which the kernels
    accumulate in fp64), through masked slots and a token routed twice to one expert."""
    module = experts(GeluExperts, "gelu", num_experts=3, hidden=5, width=3).double()
    module.config._experts_implementation = "moezoo_triton"
    x, index, weights = routing(4, 3, 2, 5)
    index[1] = torch.tensor([2, 2])
    index[2, 0] = 3
    assert torch.autograd.gradcheck(
        lambda x, weights, *parameters: module(x, index, weights),
        (x.double().requires_grad_(True), weights.double().requires_grad_(True), *module.parameters()),
        atol=1e-8, rtol=1e-6, fast_mode=True,
    )


def test_training_a_transformers_model_one_step(kernel_calls, backward_calls):
    """`experts_implementation="moezoo_triton"` on transformers' own Qwen3-MoE gives eager's logits, loss and
    gradients, and after one optimizer step eager's loss again."""
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, head_dim=8)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    results = {}
    for implementation in ("eager", "moezoo_triton"):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config).to(DEVICE)
        model.set_experts_implementation(implementation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = [parameter.grad.clone() for parameter in model.parameters()]
        optimizer.step()
        with torch.no_grad():
            results[implementation] = [loss.detach(), *grads, model(ids, labels=ids).loss]
    assert len(kernel_calls) == 4 and len(backward_calls) == 2  # one per MoE layer and pass
    assert_all_close(results["moezoo_triton"], results["eager"])


def test_moezoo_hands_cuda_tensors_to_triton(kernel_calls, monkeypatch):
    """The default implementation of moezoo's models, `moezoo`, runs moezoo_triton on the devices of
    TRITON_DEVICE_TYPES (CUDA) when triton is installed, and CPU calls on its CPU implementation. (Declaring the CPU a
    Triton device lets Triton's interpreter stand in for a GPU.)"""
    module = experts(SwiGLUExperts, "silu")
    inputs = routing(9, 6, 2, 48)
    expected = gradients(module, "eager", *inputs)
    assert_all_close(gradients(module, "moezoo", *inputs), expected)
    assert len(kernel_calls) == (DEVICE == "cuda")

    kernel_calls.clear()
    monkeypatch.setattr(moezoo_experts, "TRITON_DEVICE_TYPES", (DEVICE,))
    monkeypatch.setattr(moezoo_experts, "is_triton_available", lambda: False)
    assert_all_close(gradients(module, "moezoo", *inputs), expected)
    assert kernel_calls == []
    monkeypatch.setattr(moezoo_experts, "is_triton_available", lambda: True)
    assert_all_close(gradients(module, "moezoo", *inputs), expected)
    assert kernel_calls == [(9, 48)]


def test_devices_triton_does_not_compile_for_are_named(monkeypatch):
    """Triton compiles for NVIDIA GPUs of compute capability 8.0 and later; on the CPU it runs only interpreted."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    assert _device_reason(torch.device("cuda", 0)) == "GPUs of compute capability below 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert _device_reason(torch.device("cuda", 0)) is None
    assert _device_reason(torch.device("mps")) == "mps tensors"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _device_reason(torch.device("cpu")) == "CPU tensors outside TRITON_INTERPRET=1"


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


def test_second_order_gradients_equal_eager(kernel_calls):
    """A backward pass that autograd records (a gradient penalty) is differentiated through transformers'
    implementation, so gradients of gradients equal eager's."""
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = routing(7, 6, 2, 48)
    results = {}
    for implementation in ("eager", "moezoo_triton"):
        module.config._experts_implementation = implementation
        module.zero_grad(set_to_none=True)
        x_grad = x.clone().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(module(x_grad, index, weights).square().sum(), x_grad, create_graph=True)
        grad_x.square().sum().backward()
        results[implementation] = [grad_x.detach(), module.gate_up_proj.grad, module.down_proj.grad]
    assert_all_close(results["moezoo_triton"], results["eager"])
    assert kernel_calls


def test_calls_it_does_not_cover_go_to_moezoo(kernel_calls, backward_calls, monkeypatch):
    """An activation the kernels lack, and the CPU without the interpreter, run on the `moezoo` implementation, with
    the same results and gradients as eager."""
    tanh_experts = experts(GeluExperts, "tanh")
    assert kernel_activation(tanh_experts.act_fn) is None
    inputs = routing(11, 6, 2, 48)
    assert_all_close(gradients(tanh_experts, "moezoo_triton", *inputs), gradients(tanh_experts, "eager", *inputs))
    if DEVICE == "cpu":
        module = experts(SwiGLUExperts, "silu")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert_all_close(gradients(module, "moezoo_triton", *inputs), gradients(module, "eager", *inputs))
    assert kernel_calls == [] and backward_calls == []


@pytest.mark.skipif(DEVICE != "cpu", reason="the indices are checked on the host only (a GPU would need a sync)")
def test_expert_index_outside_the_layer_is_named():
    module = experts(SwiGLUExperts, "silu")
    x, index, weights = routing(5, 6, 2, 48)
    index[3, 1] = 7
    with pytest.raises(ValueError, match=r"routes to expert 7, but this layer's experts are numbered 0..5 \(6 marks"):
        run(module, "moezoo_triton", x, index, weights)


@pytest.mark.skipif(DEVICE != "cuda", reason="16-bit products are not exact in Triton's interpreter; checked on GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_on_a_gpu(dtype, kernel_calls, backward_calls):
    """Outputs and gradients of 16-bit experts (fp32 accumulation) against transformers' grouped_mm, in transformers'
    layout and the transposed one with biases."""
    for module, inputs in ((experts(SwiGLUExperts, "silu"), routing(64, 6, 2, 48)),
                           (TransposedExperts(PreTrainedConfig()).to(DEVICE), routing(64, 5, 3, 32))):
        module = module.to(dtype)
        x, index, weights = inputs
        inputs = (x.to(dtype), index, weights.to(dtype))
        expected = gradients(module, "grouped_mm", *inputs)
        got = gradients(module, "moezoo_triton", *inputs)
        assert got[0].dtype == dtype and all(g.dtype == e.dtype for g, e in zip(got, expected))
        for got_tensor, expected_tensor in zip(got, expected):
            scale = expected_tensor.float().abs().max().item()
            torch.testing.assert_close(got_tensor.float(), expected_tensor.float(), rtol=3e-2, atol=3e-2 * scale)
    assert len(kernel_calls) == 2 and len(backward_calls) == 2
