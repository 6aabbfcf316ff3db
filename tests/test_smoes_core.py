"""The SMoES core (moezoo.modeling.moe.smoes) against hand-computed values, closed forms and the reference formulas of
the SMoES spec (§2, §8), on small tensors."""

import math

import pytest
import torch
from torch.nn import functional as F

from moezoo.modeling.moe import load_balancing_loss
from moezoo.modeling.moe.smoes import (
    TEXT,
    VISION,
    ModalityMoments,
    SmoesLayerState,
    SmoesRuntime,
    adaptive_bins,
    apply_smoes,
    attention_mixed_scores,
    bin_balance_loss,
    contiguous_bins,
    hard_modality,
    inter_bin_mutual_information,
    mean_modality_specialisation_index,
    mi_coefficient,
    modality_specialisation_index,
    one_hot_scores,
    rebins_after,
    residual_score_update,
    soft_dispatch_counts,
)


# --- soft modality scores ------------------------------------------------------------------------------------------


def test_hard_modality_marks_image_and_video_placeholders_only():
    mm_token_type_ids = torch.tensor([[0, 1, 1, 0, 2, 0]])
    assert hard_modality(mm_token_type_ids, (1, 2)).tolist() == [[TEXT, VISION, VISION, TEXT, VISION, TEXT]]
    assert hard_modality(mm_token_type_ids, (1,)).tolist() == [[0, 1, 1, 0, 0, 0]]


def test_gaussian_scores_sum_to_one_carry_no_gradient_and_fall_back_to_hard_labels():
    torch.manual_seed(0)
    state = SmoesLayerState(hidden_size=6, num_experts=4, num_bins=2)
    features = torch.randn(10, 6, requires_grad=True)
    modality = torch.tensor([0, 1] * 5)
    fallback = state.gaussian_scores(features, modality, tau=3.0, var_eps=1e-5)
    assert torch.equal(fallback, one_hot_scores(modality))  # statistics not yet initialised

    state.update_gaussian(ModalityMoments.of(features[modality == TEXT].detach(), modality[modality == TEXT]), 0.9)
    assert state.gauss_initialized.tolist() == [True, False]
    assert torch.equal(state.gaussian_scores(features, modality, 3.0, 1e-5), fallback)  # one modality is not enough

    state.update_gaussian(ModalityMoments.of(features.detach() + 2.0 * modality[:, None], modality), 0.9)
    scores = state.gaussian_scores(features, modality, tau=3.0, var_eps=1e-5)
    assert not scores.requires_grad
    torch.testing.assert_close(scores.sum(-1), torch.ones(10))
    assert not torch.equal(scores, fallback) and ((scores > 0) & (scores < 1)).all()


def test_gaussian_ema_equals_the_two_component_mixture():
    """Two updates with beta = 0.5: mean and variance of the mixture {first batch: 0.5, second batch: 0.5} (spec §8.5)."""
    torch.manual_seed(0)
    first, second = torch.randn(7, 5) * 2 + 1, torch.randn(9, 5) - 3
    state = SmoesLayerState(hidden_size=5, num_experts=4, num_bins=2)
    for batch in (first, second):
        state.update_gaussian(ModalityMoments.of(batch, torch.zeros(len(batch), dtype=torch.long)), beta=0.5)
    mean_1, var_1 = first.mean(0), first.var(0, unbiased=False)
    mean_2, var_2 = second.mean(0), second.var(0, unbiased=False)
    mixture_mean = 0.5 * mean_1 + 0.5 * mean_2
    mixture_var = 0.5 * (var_1 + mean_1**2) + 0.5 * (var_2 + mean_2**2) - mixture_mean**2
    torch.testing.assert_close(state.gauss_mean[TEXT], mixture_mean, atol=1e-5, rtol=0)
    torch.testing.assert_close(state.gauss_var[TEXT], mixture_var, atol=1e-5, rtol=0)
    # The vision statistics saw fewer than two tokens: untouched.
    assert not state.gauss_initialized[VISION] and torch.equal(state.gauss_var[VISION], torch.ones(5))


def test_attention_mixed_scores_equal_the_head_mean_attention_matrix_times_the_scores():
    """One SDPA pass with V = M equals mean_h(Attn_h) @ M, with GQA, a causal mask and left padding (spec §8.6)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 2, 4, 2, 6, 8
    query = torch.randn(batch, heads, length, head_dim)
    key = torch.randn(batch, kv_heads, length, head_dim)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :2] = False  # left padding
    scores = torch.softmax(torch.randn(batch, length, 2), dim=-1)
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    mixed = attention_mixed_scores(query, key, scores, mask)

    logits = query @ key.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) / math.sqrt(head_dim)
    attention = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).mean(dim=1)  # (B, T, T)
    expected = attention @ scores
    torch.testing.assert_close(mixed[valid], expected[valid], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[valid].sum(-1), torch.ones(int(valid.sum())))
    assert torch.equal(attention_mixed_scores(query, key, scores, None)[0], mixed[0])  # None = plain causal


def test_residual_score_update_weighs_the_two_branches_by_their_norms():
    scores = torch.tensor([[[1.0, 0.0]]])
    mixed = torch.tensor([[[0.0, 1.0]]])
    residual = torch.tensor([[[3.0, 4.0]]])  # norm 5
    mixer_output = torch.tensor([[[0.0, 15.0]]])  # norm 15
    torch.testing.assert_close(residual_score_update(scores, mixed, mixer_output, residual), torch.tensor([[[0.25, 0.75]]]))


# --- bins ------------------------------------------------------------------------------------------------------------


def test_bins_are_contiguous_at_initialisation_and_with_uniform_counts():
    assert contiguous_bins(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert SmoesLayerState(hidden_size=4, num_experts=8, num_bins=2).bins.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(adaptive_bins(torch.zeros(2, 8), 4), contiguous_bins(8, 4))
    assert torch.equal(adaptive_bins(torch.full((2, 8), 3.0), 4), contiguous_bins(8, 4))


def test_adaptive_bins_sort_by_text_preference():
    """The spec's example (§8.7): bin 0 the most vision-leaning experts, bin 3 the most text-leaning, ties in index
    order."""
    counts = torch.tensor([[5, 1, 3, 0, 2, 2, 9, 4], [1, 5, 3, 9, 2, 2, 1, 4]], dtype=torch.float32)
    assert adaptive_bins(counts, 4).tolist() == [3, 0, 1, 0, 1, 2, 3, 2]


def test_reassignment_keeps_the_bin_sizes():
    generator = torch.Generator().manual_seed(0)
    state = SmoesLayerState(hidden_size=4, num_experts=16, num_bins=4)
    for _ in range(5):
        state.update_expert_counts(torch.rand(2, 16, generator=generator) * 10, beta=0.5)
        state.reassign_bins()
        assert torch.bincount(state.bins, minlength=4).tolist() == [4, 4, 4, 4]
    assert not torch.equal(state.bins, contiguous_bins(16, 4))


def test_soft_dispatch_counts_weigh_each_top_k_slot_by_the_token_scores():
    top_k_index = torch.tensor([[[0, 2], [1, 2], [3, 0]]])
    scores = torch.tensor([[[1.0, 0.0], [0.25, 0.75], [0.5, 0.5]]])
    valid = torch.tensor([[True, True, False]])
    counts = soft_dispatch_counts(top_k_index, scores, valid, num_experts=4)
    assert counts.tolist() == [[1.0, 0.25, 1.25, 0.0], [0.0, 0.75, 0.75, 0.0]]


# --- losses ----------------------------------------------------------------------------------------------------------


def _jensen_shannon(p, q):
    middle = (p + q) / 2
    return 0.5 * (p * (p / middle).log()).sum() + 0.5 * (q * (q / middle).log()).sum()


def test_mutual_information_by_hand_on_two_tokens():
    """One text and one vision token, two experts in two bins: P(B|text) = their gates, and I = JSD(text || vision)."""
    gates = torch.tensor([[[0.8, 0.2], [0.3, 0.7]]])
    scores = one_hot_scores(torch.tensor([[TEXT, VISION]]))
    valid = torch.ones(1, 2, dtype=torch.bool)
    information = inter_bin_mutual_information(gates, scores, torch.tensor([0, 1]), 2, valid, min_modality_mass=1.0)
    expected = (
        0.5 * (0.8 * math.log(0.8 / 0.55) + 0.2 * math.log(0.2 / 0.45))
        + 0.5 * (0.3 * math.log(0.3 / 0.55) + 0.7 * math.log(0.7 / 0.45))
    )
    assert information.item() == pytest.approx(expected, abs=1e-6)


def test_mutual_information_limits():
    """Disjoint bins per modality give ln 2, identical conditionals 0, a text-only sample 0 (spec §8.3)."""
    valid = torch.ones(1, 4, dtype=torch.bool)
    bins = torch.tensor([0, 0, 1, 1])
    modality = one_hot_scores(torch.tensor([[TEXT, TEXT, VISION, VISION]]))
    disjoint = torch.tensor([[[0.5, 0.5, 0.0, 0.0]] * 2 + [[0.0, 0.0, 0.5, 0.5]] * 2])
    assert inter_bin_mutual_information(disjoint, modality, bins, 2, valid).item() == pytest.approx(math.log(2))
    same = torch.full((1, 4, 4), 0.25)
    assert inter_bin_mutual_information(same, modality, bins, 2, valid).item() == pytest.approx(0.0, abs=1e-7)
    text_only = one_hot_scores(torch.zeros(1, 4, dtype=torch.long))
    assert inter_bin_mutual_information(disjoint, text_only, bins, 2, valid).item() == 0.0


def test_mutual_information_equals_the_jensen_shannon_divergence_of_the_bin_conditionals():
    torch.manual_seed(0)
    batch, length, num_experts, num_bins = 3, 12, 8, 4
    gates = torch.softmax(torch.randn(batch, length, num_experts, dtype=torch.float64), dim=-1)
    scores = torch.softmax(torch.randn(batch, length, 2, dtype=torch.float64) * 2, dim=-1)
    valid = torch.rand(batch, length) > 0.2
    bins = torch.randperm(num_experts) % num_bins
    information = inter_bin_mutual_information(gates, scores, bins, num_bins, valid)
    for sample in range(batch):
        weights = scores[sample][valid[sample]]  # (N, 2)
        bin_gates = gates[sample][valid[sample]] @ F.one_hot(bins, num_bins).double()  # (N, K)
        conditional = (weights.T @ bin_gates) / weights.sum(0)[:, None]  # P(B | m), rows sum to 1
        assert information[sample].item() == pytest.approx(_jensen_shannon(*conditional).item(), abs=1e-6)


def test_mutual_information_excludes_padding_even_with_nan_scores():
    gates = torch.tensor([[[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]]], requires_grad=True)
    scores = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [float("nan"), float("nan")]]])
    valid = torch.tensor([[True, True, False]])
    information = inter_bin_mutual_information(gates, scores, torch.tensor([0, 1]), 2, valid)
    reference = inter_bin_mutual_information(gates[:, :2], scores[:, :2], torch.tensor([0, 1]), 2, valid[:, :2])
    assert information.item() == pytest.approx(reference.item())
    information.sum().backward()
    assert torch.isfinite(gates.grad).all() and gates.grad[0, 2].abs().sum() == 0


def test_bin_balance_loss_by_hand():
    """Two valid tokens (top-1 experts 0 and 3) and one padding token; E = 4, two bins of N_B = 2:
    f = [.5, 0, 0, .5], P = [.25] * 4 -> global 2 * (.125 + .125) = 0.5; inside each bin f = [1, 0] / [0, 1] and
    P = [.5, .5] -> intra_bin 2 * (.5 + .5) = 2."""
    gates = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 1.0]])
    top_k_index = torch.tensor([[0], [3], [3]])
    valid = torch.tensor([True, True, False])
    bins = torch.tensor([0, 0, 1, 1])
    assert bin_balance_loss(gates, top_k_index, bins, 2, valid, mode="global").item() == pytest.approx(0.5)
    assert bin_balance_loss(gates, top_k_index, bins, 2, valid, mode="intra_bin").item() == pytest.approx(2.0)


def test_bin_balance_loss_of_processes_averages_to_the_global_batch(monkeypatch):
    """Two data-parallel processes holding 5 and 2 valid tokens (their padding differs): the mean of their losses, and
    of their gradients, is the loss and the gradient of one process on the global batch. The all-reduce of the
    dispatch counts is replaced by the sum of the two processes' counts."""
    from moezoo.modeling.moe.smoes import losses

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 4, requires_grad=True)  # process k's tokens: logits[k]
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    bins = torch.tensor([0, 0, 1, 1])

    def loss(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gates = rows.softmax(dim=-1)
        return bin_balance_loss(gates, gates.topk(2).indices, bins, 2, mask)

    reference = loss(logits.reshape(-1, 4), valid.reshape(-1))
    (expected,) = torch.autograd.grad(reference, logits)
    counts = []  # each process's dispatch counts, as it would hand them to the all-reduce
    monkeypatch.setattr(losses, "sum_over_processes", lambda tensor: counts.append(tensor.clone()) or tensor)
    for process in range(2):
        loss(logits[process].detach(), valid[process])
    monkeypatch.setattr(losses, "sum_over_processes", lambda tensor: sum(counts))
    monkeypatch.setattr(losses, "number_of_processes", lambda: 2)
    mean = (loss(logits[0], valid[0]) + loss(logits[1], valid[1])) / 2
    assert mean.item() == pytest.approx(reference.item(), abs=1e-7)
    torch.testing.assert_close(torch.autograd.grad(mean, logits)[0], expected)


def test_bin_balance_loss_minima_and_the_switch_loss():
    """Uniform gates and dispatch: global = k / N_bins, intra_bin = N_bins (spec §8.4); global is the Switch loss
    divided by N_bins whatever the bins."""
    num_experts, top_k, num_bins = 8, 2, 4
    gates = torch.full((8, num_experts), 1 / num_experts)
    top_k_index = torch.arange(16).view(8, 2) % num_experts  # every expert twice
    valid = torch.ones(8, dtype=torch.bool)
    bins = contiguous_bins(num_experts, num_bins)
    assert bin_balance_loss(gates, top_k_index, bins, num_bins, valid).item() == pytest.approx(top_k / num_bins)
    assert bin_balance_loss(gates, top_k_index, bins, num_bins, valid, "intra_bin").item() == pytest.approx(num_bins)

    torch.manual_seed(0)
    logits = torch.randn(20, num_experts)
    probs = torch.softmax(logits, dim=-1)
    selected = probs.topk(top_k).indices
    switch = load_balancing_loss([logits], num_experts=num_experts, top_k=top_k)
    shuffled_bins = torch.randperm(num_experts) % num_bins
    balance = bin_balance_loss(probs, selected, shuffled_bins, num_bins, torch.ones(20, dtype=torch.bool))
    assert balance.item() == pytest.approx(switch.item() / num_bins, rel=1e-6)
    with pytest.raises(ValueError, match="mode='local'"):
        bin_balance_loss(probs, selected, shuffled_bins, num_bins, torch.ones(20, dtype=torch.bool), mode="local")


# --- schedules and metrics -------------------------------------------------------------------------------------------


def test_mi_warmup_and_rebinning_schedules():
    assert [mi_coefficient(0.1, 0, step) for step in (0, 5)] == [0.1, 0.1]
    assert [mi_coefficient(1.0, 4, step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [rebins_after(step, 1, None) for step in range(3)] == [True, True, True]
    assert [rebins_after(step, 3, None) for step in range(6)] == [False, False, True, False, False, True]
    assert [rebins_after(step, 1, 2) for step in range(4)] == [True, True, False, False]


def test_modality_specialisation_index():
    modality = torch.tensor([[TEXT] * 4 + [VISION] * 12])  # 1:3, which the index normalises away
    valid = torch.ones(1, 16, dtype=torch.bool)
    hard_routing = torch.where(modality == TEXT, 0, 2)[..., None] + torch.tensor([0, 1])  # text 0-1, vision 2-3
    assert modality_specialisation_index(hard_routing, modality, valid, num_experts=4) == pytest.approx(1.0)
    agnostic = (torch.arange(16) % 2 * 2)[None, :, None] + torch.tensor([0, 1])  # every token: {0,1} or {2,3}
    agnostic[0, :4] = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert modality_specialisation_index(agnostic, modality, valid, num_experts=4) == pytest.approx(0.0)
    assert mean_modality_specialisation_index([hard_routing, agnostic], modality, valid, 4) == pytest.approx(0.5)


# --- one training step -----------------------------------------------------------------------------------------------


class _Config:
    num_experts_per_tok = 2
    smoes_bal_coef = 0.01
    smoes_mi_coef = 0.5
    smoes_mi_warmup_steps = 0
    smoes_bal_mode = "global"
    smoes_layer_reduction = "sum"
    smoes_mi_min_modality_mass = 1.0
    smoes_ema_beta = 0.5
    smoes_binning = "adaptive"
    smoes_rebin_interval = 1
    smoes_freeze_bins_after = None


def _started_runtime(states, modality, valid, hidden):
    runtime = SmoesRuntime("gaussian", gauss_tau=hidden.shape[-1] * 0.5, gauss_var_eps=1e-5)
    runtime.start(modality, valid)
    for state in states:
        runtime.record_router_input(state, hidden)
    return runtime


def test_apply_smoes_uses_start_of_step_bins_then_updates_the_buffers():
    torch.manual_seed(0)
    batch, length, hidden_size, num_experts = 2, 6, 4, 8
    states = [SmoesLayerState(hidden_size, num_experts, num_bins=2) for _ in range(2)]
    modality = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1]])
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :1] = False
    hidden = torch.randn(batch, length, hidden_size)
    logits = [torch.randn(batch * length, num_experts, requires_grad=True) for _ in states]
    step = torch.zeros((), dtype=torch.long)
    runtime = _started_runtime(states, modality, valid, hidden)
    assert torch.equal(runtime.layer_scores[states[0]], one_hot_scores(modality))  # before any Gaussian update

    losses = apply_smoes(_Config, states, runtime, logits, step)

    gates = [torch.softmax(layer_logits, -1).view(batch, length, -1) for layer_logits in logits]
    initial_bins = contiguous_bins(num_experts, 2)
    expected_balance = sum(
        bin_balance_loss(g, g.topk(2).indices, initial_bins, 2, valid) for g in gates
    )
    expected_mi = -sum(
        inter_bin_mutual_information(g, one_hot_scores(modality), initial_bins, 2, valid).mean() for g in gates
    )
    torch.testing.assert_close(losses.balance_loss, expected_balance)
    torch.testing.assert_close(losses.mi_loss, expected_mi)
    torch.testing.assert_close(losses.loss, 0.01 * expected_balance + 0.5 * expected_mi)
    assert all(torch.equal(bins, initial_bins) for bins in losses.bins)
    assert not losses.layer_mi.requires_grad and losses.layer_mi.shape == (2,)

    assert step.item() == 1
    for state, g in zip(states, gates):
        counts = soft_dispatch_counts(g.topk(2).indices, one_hot_scores(modality), valid, num_experts)
        torch.testing.assert_close(state.expert_counts_ema, 0.5 * counts)
        assert torch.equal(state.bins, adaptive_bins(0.5 * counts, 2))
        assert state.gauss_initialized.all()
        torch.testing.assert_close(state.gauss_mean[VISION], hidden[valid & (modality == 1)].mean(0))

    losses.loss.backward()
    assert all(layer_logits.grad is not None and layer_logits.grad.abs().sum() > 0 for layer_logits in logits)
    assert not any(buffer.requires_grad for state in states for buffer in state.buffers())


def test_apply_smoes_takes_the_router_rows_of_valid_tokens_only():
    """The zoo's SparseMoeBlock returns the logits of valid tokens only: same losses as all rows."""
    torch.manual_seed(1)
    states = [SmoesLayerState(4, 8, num_bins=4)]
    modality = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 0]])
    valid = torch.tensor([[True, True, True, True], [False, True, True, True]])
    hidden = torch.randn(2, 4, 4)
    all_rows = torch.randn(8, 8)
    full = apply_smoes(_Config, states, _started_runtime(states, modality, valid, hidden), [all_rows],
                       torch.zeros((), dtype=torch.long))
    states = [SmoesLayerState(4, 8, num_bins=4)]
    packed = apply_smoes(_Config, states, _started_runtime(states, modality, valid, hidden),
                         [all_rows[valid.reshape(-1)]], torch.zeros((), dtype=torch.long))
    torch.testing.assert_close(packed.loss, full.loss)
    with pytest.raises(ValueError, match="router rows for 5 tokens"):
        apply_smoes(_Config, states, _started_runtime(states, modality, valid, hidden), [all_rows[:5]],
                    torch.zeros((), dtype=torch.long))


def test_apply_smoes_on_a_sigmoid_router_with_its_own_selection():
    """Sigmoid routers (MoE-ViE): the gates are the affinities normalised over experts, and the selection is the one
    the router made (with its balancing bias), handed over as top_k_indices."""
    torch.manual_seed(2)
    states = [SmoesLayerState(4, 8, num_bins=2)]
    modality = torch.tensor([[0, 1, 1, 0, 1, 0]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    logits = torch.randn(6, 8)
    selection = torch.randint(0, 8, (6, 2))
    losses = apply_smoes(_Config, states, _started_runtime(states, modality, valid, torch.randn(1, 6, 4)), [logits],
                         torch.zeros((), dtype=torch.long), top_k_indices=[selection], router_type="sigmoid")
    affinities = torch.sigmoid(logits)
    gates = (affinities / affinities.sum(-1, keepdim=True)).view(1, 6, 8)
    bins = contiguous_bins(8, 2)
    expected = bin_balance_loss(gates, selection.view(1, 6, 2), bins, 2, valid)
    torch.testing.assert_close(losses.balance_loss, expected)
    counts = soft_dispatch_counts(selection.view(1, 6, 2), one_hot_scores(modality), valid, 8)
    torch.testing.assert_close(states[0].expert_counts_ema, 0.5 * counts)


def test_apply_smoes_needs_the_logits_and_scores_of_every_layer():
    states = [SmoesLayerState(4, 8, num_bins=2) for _ in range(2)]
    runtime = SmoesRuntime("hard", 2.0, 1e-5)
    runtime.start(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    runtime.record_router_input(states[0], torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match=r"positions \[1\]; start the runtime"):
        apply_smoes(_Config, states, runtime, [torch.randn(3, 8)] * 2, torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="2 MoE layer states but 1 router logits"):
        apply_smoes(_Config, states, runtime, [torch.randn(3, 8)], torch.zeros((), dtype=torch.long))


def test_layer_state_buffers_stay_float32_in_a_bfloat16_model():
    state = SmoesLayerState(4, 8, num_bins=2).to(torch.bfloat16)
    assert {name: buffer.dtype for name, buffer in state.named_buffers()} == {
        "gauss_mean": torch.float32, "gauss_var": torch.float32, "gauss_initialized": torch.bool,
        "expert_counts_ema": torch.float32, "bins": torch.int64,
    }


# --- the regulariser does what it is for --------------------------------------------------------------------------------


def _train_synthetic_router(mi_coef: float, steps: int = 200) -> tuple[float, float]:
    """A standalone router on two Gaussian token clusters (75 % vision, two text-only samples per batch of 16 x 32),
    trained with 0.01 * L_bal + mi_coef * L_MI, Gaussian scores and adaptive bins (spec §8.8). Returns the MSI and the
    hard-label inter-bin MI of a fresh batch."""
    generator = torch.Generator().manual_seed(0)
    hidden_size, num_experts = 32, 8
    cluster_means = torch.randn(2, hidden_size, generator=generator) * 0.5
    router = torch.nn.Parameter(torch.randn(num_experts, hidden_size, generator=generator) * 0.02)
    optimizer = torch.optim.Adam([router], lr=1e-2)
    state = SmoesLayerState(hidden_size, num_experts, num_bins=2)
    step = torch.zeros((), dtype=torch.long)
    config = type("Config", (_Config,), {"smoes_mi_coef": mi_coef, "smoes_ema_beta": 0.99})

    def batch():
        modality = (torch.rand(16, 32, generator=generator) < 0.75).long()
        modality[:2] = TEXT
        return modality, cluster_means[modality] + torch.randn(16, 32, hidden_size, generator=generator)

    valid = torch.ones(16, 32, dtype=torch.bool)
    for _ in range(steps):
        modality, tokens = batch()
        runtime = _started_runtime([state], modality, valid, tokens)
        losses = apply_smoes(config, [state], runtime, [tokens.reshape(-1, hidden_size) @ router.T], step)
        optimizer.zero_grad()
        losses.loss.backward()
        optimizer.step()
    modality, tokens = batch()
    with torch.no_grad():
        gates = torch.softmax(tokens @ router.T, dim=-1)
        index = modality_specialisation_index(gates.topk(2).indices, modality, valid, num_experts)
        hard_information = inter_bin_mutual_information(gates, one_hot_scores(modality), state.bins, 2, valid)
    return index, hard_information.mean().item()


def test_mutual_information_drives_bins_to_specialise_by_modality():
    """Measured: MSI 0.34 -> 0.93 and hard-label MI 0.0003 -> 0.45 nats when alpha_MI goes from 0 to 0.1."""
    index_without, information_without = _train_synthetic_router(mi_coef=0.0)
    index_with, information_with = _train_synthetic_router(mi_coef=0.1)
    assert index_with >= max(0.85, index_without + 0.3)
    assert information_without < 0.01 and information_with >= 0.4
