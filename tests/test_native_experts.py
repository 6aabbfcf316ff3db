"""moezoo's native C kernels for experts that see few tokens each, and the pooled weight gradients."""

import logging
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import PreTrainedConfig

from moezoo.kernels import native, sorted_experts
from moezoo.modeling.moe import MoeLayerSpec, SwiGLUExperts


pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the native kernels")

HIDDEN, WIDTH, EXPERTS, TOP_K = 128, 64, 16, 4


def make_experts(implementation, seed=0):
    torch.manual_seed(seed)
    config = PreTrainedConfig()
    config._experts_implementation = implementation
    spec = MoeLayerSpec(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                        expert_intermediate_size=WIDTH)
    experts = SwiGLUExperts(config, spec)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=HIDDEN**-0.5)
        experts.down_proj.normal_(std=WIDTH**-0.5)
    return experts


def skewed_routing(tokens=24, seed=1):
    """Expert 0 takes every token (three 8-pair chunks), experts 1-8 share the rest, experts 9-15 get nothing."""
    generator = torch.Generator().manual_seed(seed)
    others = torch.stack([torch.randperm(8, generator=generator)[: TOP_K - 1] + 1 for _ in range(tokens)])
    index = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), others], dim=1)
    weights = torch.rand(tokens, TOP_K, generator=generator).softmax(-1)
    hidden_states = torch.randn(tokens, HIDDEN, generator=generator)
    return hidden_states, index, weights


def assert_close(actual, expected, tolerance=1e-5):
    """max |Δ| within `tolerance` of the scale of `expected` (at least 1): gradients summed over many tokens reach
    magnitudes of 10-100, where fp32 rounding of any other summation order alone is ~1e-5 absolute."""
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= tolerance * scale


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls into each function of the native library (by name without `moezoo_`), which must have been
    built."""
    library = native.native_library()
    assert library is not None, "the native kernels did not build"
    calls = {name.removeprefix("moezoo_"): 0 for name in native._PARAMETERS}

    def counting(function, short_name):
        def counted(*args):
            calls[short_name] += 1
            return function(*args)

        return counted

    for name in native._PARAMETERS:
        monkeypatch.setattr(library, name, counting(getattr(library, name), name.removeprefix("moezoo_")))
    return calls


def only(calls, **expected):
    """`calls` with every function not named in `expected` at zero."""
    return calls == {name: expected.get(name, 0) for name in calls}


def many_tokens_routing(seed=2):
    """Random routing with ~4x the pairs per expert above which the native expert kernels hand over to BLAS."""
    tokens = 4 * sorted_experts.NATIVE_MAX_PAIRS_PER_EXPERT * EXPERTS // TOP_K
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator).softmax(-1)
    return torch.randn(tokens, HIDDEN, generator=generator), index, weights


def forward_backward(experts, hidden_states, index, weights, upstream, input_grads=True):
    x = hidden_states.clone().requires_grad_(input_grads)
    w = weights.clone().requires_grad_(input_grads)
    out = experts(x, index, w)
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in experts.named_parameters() if p.grad is not None}
    experts.zero_grad(set_to_none=True)
    return out.detach(), x.grad, w.grad, grads


def run_both_and_compare(routing, seed):
    """Forward and backward through eager's experts and moezoo's on `routing`: outputs and all four gradients agree.
    Returns moezoo's experts, eager's, and moezoo's weight gradients."""
    reference, ours = make_experts("eager"), make_experts("moezoo")
    hidden_states, index, weights = routing()
    upstream = torch.randn(hidden_states.shape, generator=torch.Generator().manual_seed(seed))
    expected = forward_backward(reference, hidden_states, index, weights, upstream)
    actual = forward_backward(ours, hidden_states, index, weights, upstream)
    for got, want in zip(actual[:3], expected[:3]):
        assert_close(got, want)
    assert actual[3].keys() == expected[3].keys() == {"gate_up_proj", "down_proj"}
    for name in expected[3]:
        assert_close(actual[3][name], expected[3][name])
    return ours, reference, actual[3]


def test_native_kernels_equal_eager_on_outputs_and_all_gradients(native_calls):
    ours, reference, weight_grads = run_both_and_compare(skewed_routing, seed=3)
    assert only(native_calls, sort_pairs=1, swiglu_forward=1, swiglu_backward=1)
    assert torch.count_nonzero(weight_grads["gate_up_proj"][9:]) == 0  # experts without tokens
    hidden_states, index, weights = skewed_routing()
    with torch.no_grad():
        assert (ours(hidden_states, index, weights) - reference(hidden_states, index, weights)).abs().max() <= 1e-6
    assert native_calls["swiglu_forward"] == 2


def test_pairs_are_sorted_by_expert_stably_with_offsets_and_the_experts_hit():
    library = native.native_library()
    expert_index = torch.tensor([3, 0, 3, 5, 0, 3, 5, 0], dtype=torch.int64)
    order, offsets = torch.empty(8, dtype=torch.int64), torch.empty(7, dtype=torch.int64)
    hit = library.moezoo_sort_pairs(expert_index.data_ptr(), 8, 6, order.data_ptr(), offsets.data_ptr())
    assert hit == 3
    assert order.tolist() == torch.argsort(expert_index, stable=True).tolist() == [1, 4, 7, 0, 2, 5, 3, 6]
    assert offsets.tolist() == [0, 3, 3, 3, 6, 6, 8]
    for bad in (6, -1):
        expert_index[2] = bad
        assert library.moezoo_sort_pairs(expert_index.data_ptr(), 8, 6, order.data_ptr(), offsets.data_ptr()) == -1


@pytest.mark.parametrize("routing,backward", [(skewed_routing, "swiglu_backward"),
                                               (many_tokens_routing, "swiglu_pairs_backward")])
def test_native_kernels_skip_gradients_nobody_needs(native_calls, routing, backward):
    reference, ours = make_experts("eager"), make_experts("moezoo")
    ours.down_proj.requires_grad_(False)
    reference.down_proj.requires_grad_(False)
    hidden_states, index, weights = routing()
    upstream = torch.randn(hidden_states.shape)
    expected = forward_backward(reference, hidden_states, index, weights, upstream, input_grads=False)
    actual = forward_backward(ours, hidden_states, index, weights, upstream, input_grads=False)
    assert native_calls[backward] == 1
    assert actual[1] is None and actual[2] is None and actual[3].keys() == {"gate_up_proj"}
    assert_close(actual[3]["gate_up_proj"], expected[3]["gate_up_proj"])


class ExpertsOnly(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, index, weights):
        return self.experts(hidden_states, index, weights)


def lora_experts(implementation):
    """Experts with LoRA adapters on both weights (PEFT `target_parameters`), initialised alike for every call."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    torch.manual_seed(5)
    model = get_peft_model(ExpertsOnly(make_experts(implementation)), config)
    with torch.no_grad():  # non-zero B, so that every adapter matrix gets a gradient
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_lora_adapters_on_the_experts_train_through_the_native_kernels(native_calls):
    ours, reference = lora_experts("moezoo"), lora_experts("eager")
    hidden_states, index, weights = skewed_routing()
    upstream = torch.randn(hidden_states.shape, generator=torch.Generator().manual_seed(4))
    for model in (ours, reference):
        model(hidden_states, index, weights).backward(upstream)
    assert native_calls["swiglu_backward"] == 1
    reference_grads = {name: p.grad for name, p in reference.named_parameters() if p.requires_grad}
    assert len(reference_grads) == 4
    for name, parameter in ours.named_parameters():
        if parameter.requires_grad:
            assert_close(parameter.grad, reference_grads[name])


def test_many_tokens_per_expert_run_blas_gemms_between_native_swiglu_passes(native_calls):
    """Above the threshold each expert is one BLAS GEMM per product, and the SwiGLU and its derivative are single
    native passes over all pairs; equal to eager."""
    run_both_and_compare(many_tokens_routing, seed=6)
    # the pairs are sorted in C, then found too many per expert for the native kernels
    assert only(native_calls, sort_pairs=1, swiglu_pairs=1, swiglu_pairs_backward=1)


def test_switched_off_or_unbuildable_kernels_fall_back_to_pytorch(monkeypatch, tmp_path, caplog):
    reference = make_experts("eager")
    hidden_states, index, weights = skewed_routing()
    with torch.no_grad():
        expected = reference(hidden_states, index, weights)
    try:
        monkeypatch.setenv("MOEZOO_NATIVE_KERNELS", "0")
        native.native_library.cache_clear()
        assert native.native_library() is None
        monkeypatch.delenv("MOEZOO_NATIVE_KERNELS")
        monkeypatch.setenv("CC", shutil.which("false"))
        monkeypatch.setenv("MOEZOO_KERNEL_CACHE", str(tmp_path))
        native.native_library.cache_clear()
        with caplog.at_level(logging.WARNING, logger="moezoo.kernels.native"):
            assert native.native_library() is None
        assert "could not be built" in caplog.text
        assert list(tmp_path.iterdir()) == []  # no partial library left behind
        with torch.no_grad():
            assert (make_experts("moezoo")(hidden_states, index, weights) - expected).abs().max() <= 1e-6
    finally:
        native.native_library.cache_clear()


def test_build_is_cached_per_source_compiler_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEZOO_KERNEL_CACHE", str(tmp_path))
    native.native_library.cache_clear()
    try:
        assert native.native_library() is not None
        (built,) = tmp_path.glob("native_experts-*.so")
        modified = built.stat().st_mtime_ns
        native.native_library.cache_clear()
        assert native.native_library() is not None
        assert built.stat().st_mtime_ns == modified and len(list(tmp_path.iterdir())) == 1
    finally:
        native.native_library.cache_clear()


# --- pooled weight gradients ------------------------------------------------------------------------------------


def test_weight_gradients_reuse_memory_but_never_overwrite_a_held_gradient():
    sorted_experts.release_workspace()
    experts = make_experts("moezoo")
    hidden_states, index, weights = skewed_routing()

    def backward():
        experts(hidden_states, index, weights).square().sum().backward()
        return experts.gate_up_proj.grad

    first = backward()
    first_pointer, held = first.data_ptr(), first.clone()
    experts.zero_grad(set_to_none=True)  # the caller still holds `first`
    assert backward().data_ptr() != first_pointer
    assert torch.equal(first, held)
    del first
    experts.zero_grad(set_to_none=True)
    assert backward().data_ptr() == first_pointer  # free again, so reused instead of fresh pages
    key = (tuple(experts.gate_up_proj.shape), torch.float32, torch.device("cpu"))
    assert len(sorted_experts._GRADIENT_POOL.buffers[key]) == 2


def test_pooled_gradients_accumulate_like_plain_ones():
    ours, reference = make_experts("moezoo"), make_experts("grouped_mm")
    hidden_states, index, weights = skewed_routing()
    for experts in (ours, reference):
        for scale in (1.0, -0.5, 2.0):  # three micro-batches without zeroing in between
            (experts(hidden_states * scale, index, weights).square().sum()).backward()
    for name, parameter in ours.named_parameters():
        assert_close(parameter.grad, reference.get_parameter(name).grad)
    sorted_experts.release_workspace()
    assert sorted_experts._GRADIENT_POOL.buffers == {}


def test_streaming_read_behind_the_benchmark_floor_reads_every_float():
    library = native.native_library()
    values = torch.rand(3 * 4096 + 77, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(1)
    library.moezoo_read_floats(values.data_ptr(), values.numel(), total.data_ptr(), 2)
    assert abs(float(total) - float(values.double().sum())) <= 1e-6 * values.numel()


@pytest.mark.parametrize("native_sort", [True, False])  # the C counting sort, and PyTorch's without a C compiler
@pytest.mark.parametrize("width", [64, 48])  # the native kernels, and the general path (widths not multiples of 64)
@pytest.mark.parametrize("bad_expert", [EXPERTS, -1])
def test_an_expert_index_outside_the_layer_is_named(monkeypatch, native_sort, width, bad_expert):
    if not native_sort:
        monkeypatch.setattr(sorted_experts, "native_library", lambda: None)
    config = PreTrainedConfig()
    config._experts_implementation = "moezoo"
    spec = MoeLayerSpec(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2, expert_intermediate_size=width)
    experts = SwiGLUExperts(config, spec)
    index = torch.tensor([[0, 1], [2, bad_expert]])
    with torch.no_grad(), pytest.raises(ValueError, match=rf"expert {bad_expert}, .* numbered 0\.\.{EXPERTS - 1}"):
        experts(torch.randn(2, HIDDEN), index, torch.rand(2, 2))


def test_int32_and_non_contiguous_expert_indices_route_alike(native_calls):
    experts = make_experts("moezoo")
    hidden_states, index, weights = skewed_routing()
    with torch.no_grad():
        expected = experts(hidden_states, index, weights)
        as_int32 = experts(hidden_states, index.to(torch.int32), weights)
        strided = experts(hidden_states, index.t().contiguous().t(), weights)  # same values, column-major
    assert native_calls["swiglu_forward"] == 3
    assert torch.equal(as_int32, expected) and torch.equal(strided, expected)


def test_pytorch_sort_without_the_native_library_equals_the_c_sort(monkeypatch):
    _, index, _ = skewed_routing()
    sorted_in_c, hit_in_c = sorted_experts._sort_pairs(index, EXPERTS)
    monkeypatch.setattr(sorted_experts, "native_library", lambda: None)
    sorted_in_pytorch, hit_in_pytorch = sorted_experts._sort_pairs(index, EXPERTS)
    assert torch.equal(sorted_in_c, sorted_in_pytorch) and hit_in_c == hit_in_pytorch == 9


def penalised_gradients(experts, hidden_states, index, weights):
    """Parameter gradients of `loss + ||dloss/dx||^2` (a gradient penalty: a second-order backward pass)."""
    x = hidden_states.clone().requires_grad_()
    loss = experts(x, index, weights).square().sum()
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad_x.square().sum()).backward()
    return {name: p.grad for name, p in experts.named_parameters()}


@pytest.mark.parametrize("routing", [skewed_routing, many_tokens_routing])  # native kernels, then BLAS GEMMs
def test_gradients_of_gradients_equal_eager(routing):
    """A backward pass that autograd records (create_graph=True) gives eager's second-order gradients: the
    hand-written backward passes would drop them silently, so such calls are differentiated through grouped_mm."""
    expected = penalised_gradients(make_experts("eager"), *routing())
    actual = penalised_gradients(make_experts("moezoo"), *routing())
    for name in ("gate_up_proj", "down_proj"):
        assert_close(actual[name], expected[name], tolerance=1e-4)


def test_features_made_under_inference_mode_train_the_experts():
    """Features cached under torch.inference_mode() (a frozen encoder's) cannot be saved for backward as they are."""
    hidden_states, index, weights = skewed_routing()
    with torch.inference_mode():
        cached = hidden_states.clone()
    for routing_weights in (weights, weights.clone().requires_grad_()):
        expected, actual = make_experts("eager"), make_experts("moezoo")
        expected(cached, index, routing_weights).square().sum().backward()
        actual(cached, index, routing_weights).square().sum().backward()
        for name in ("gate_up_proj", "down_proj"):
            assert_close(getattr(actual, name).grad, getattr(expected, name).grad)
