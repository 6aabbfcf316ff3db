"""MoEMB's packed varlen execution of the adaptive forward (spec moemb.md §3.14, §10 C-14/15, D-17): packed equals
the padded full-compute model when nothing is skipped, and the masked reference for every action (GDN-β pruning
included, also on batches that come packed with cu_seqlens); the routed experts run exactly the kept (token, slot)
pairs; the bounds are recomputed after tokens leave; the benchmark runs. The per-segment Gated DeltaNet against each
sequence alone is tests/test_moemb_model.py's; GPU kernels (fla, flash-attention varlen) are tested in
`make gpu-check`."""

import argparse
import copy
import json

import pytest
import torch
from torch.nn import functional as F

from moezoo.bench.moemb_adaptive import packed_inputs
from moezoo.bench.moemb_inputs import MIXED_INPUTS, bench_inputs
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.configuration.moemb_adaptive import AdaptiveSettings
from moezoo.modeling.moemb import fla_chunk_gated_delta_rule
from moezoo.modeling.moemb_adaptive.packed import PaddedBatch

from test_moemb_adaptive import ACTIONS, TOP_K, make_model


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def inputs():
    """Four items of different lengths, two with a 64 px image (16 image tokens) and two text-only, right-padded."""
    return bench_inputs(MoEmbConfig(**copy.deepcopy(TINY_MOEMB)), MIXED_INPUTS, 4, text_tokens=10, image_size=64)


def left_padded(inputs: dict) -> dict:
    """The same batch, left-padded (the pooled index moved with it)."""
    mask = inputs["attention_mask"].bool()
    shift = (~mask).sum(1)
    order = (torch.arange(mask.shape[1])[None] - shift[:, None]) % mask.shape[1]
    moved = {key: inputs[key].gather(1, order) for key in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return inputs | moved | {"pooled_index": inputs["pooled_index"] + shift}


def test_packed_execution_keeping_everything_equals_the_padded_model(model, inputs):
    keep_all = dict(top_k="uniform", experts_per_token=TOP_K, execution="packed")
    with torch.no_grad():
        full = model(**inputs, adaptive={})
        packed = model(**inputs, adaptive=keep_all)
    assert inputs["pixel_values"] is not None and packed.adaptive.flops_saving == 0.0
    torch.testing.assert_close(packed.embeddings, full.embeddings, atol=1e-5, rtol=0)
    real = inputs["attention_mask"].bool()  # the output is back in the input's layout
    torch.testing.assert_close(packed.last_hidden_state[real], full.last_hidden_state[real], atol=1e-5, rtol=0)
    assert not packed.last_hidden_state[~real].any()


@pytest.mark.parametrize("action", list(ACTIONS))
def test_every_action_embeds_the_same_packed_and_masked(model, inputs, action):
    """Exact relation relied on: the masked forward moves each row's surviving tokens to its front, so after GDN-β
    pruning its Gated DeltaNet convolution sees the same new neighbours as the packed row (both differ, by design,
    from keeping the dropped tokens in the row: spec A-18). Left padding too, where tokens leave."""
    with torch.no_grad():
        for batch in (inputs, left_padded(inputs)) if "prune" in action else (inputs,):
            masked = model(**batch, adaptive=dict(ACTIONS[action], execution="masked"))
            packed = model(**batch, adaptive=dict(ACTIONS[action], execution="packed"))
            torch.testing.assert_close(packed.embeddings, masked.embeddings, atol=1e-5, rtol=0)
            assert packed.adaptive.flops == masked.adaptive.flops
            assert torch.equal(packed.adaptive.decisions.drop, masked.adaptive.decisions.drop)
    assert 0 < packed.adaptive.flops_saving < 1


@pytest.mark.parametrize("execution", ["masked", "packed"])
def test_token_pruning_takes_packed_batches(model, inputs, execution):
    settings = dict(ACTIONS["modes+gdn-prune"], execution=execution)
    with torch.no_grad():
        padded = model(**inputs, adaptive=dict(settings, execution="masked"))
        packed = model(**packed_inputs(inputs), adaptive=settings)
    torch.testing.assert_close(packed.embeddings, padded.embeddings, atol=1e-5, rtol=0)
    assert packed.adaptive.flops == padded.adaptive.flops and packed.adaptive.decisions.drop.any()


def test_dropped_tokens_leave_the_packed_row_and_the_bounds_are_recomputed(model, inputs):
    """After the pruning layer, every later layer gets the survivors only, each item's run still ending in its pooled
    token; the experts receive exactly the (token, slot) pairs the report counts as executed."""
    settings = dict(ACTIONS["modes+gdn-prune"], execution="packed")
    layers = model.model.language_model.layers
    rows, pairs = {}, {}
    handles = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.__setitem__(module.layer_idx, (args[0].shape[1], kwargs["packed"])),
        with_kwargs=True) for layer in layers]  # fmt: skip
    handles += [layer.mlp.experts.register_forward_hook(
        lambda module, args, output, i=layer.layer_idx: pairs.__setitem__(i, args[0].shape[0])) for layer in layers
    ]  # fmt: skip
    try:
        with torch.no_grad():
            out = model(**inputs, adaptive=settings)
    finally:
        for handle in handles:
            handle.remove()
    report, prune_after = out.adaptive, AdaptiveSettings().prune_after_layer  # the default K
    real = int(inputs["attention_mask"].sum())
    dropped = report.decisions.drop[:, prune_after].bool()
    for layer in range(len(layers)):
        tokens, packed = rows[layer]
        alive = torch.ones(real, dtype=torch.bool) if layer <= prune_after else ~dropped
        assert tokens == int(alive.sum())
        segments = torch.repeat_interleave(torch.arange(4), inputs["attention_mask"].sum(1))[alive]
        assert packed.cu_seqlens.tolist() == F.pad(torch.bincount(segments).cumsum(0), (1, 0)).tolist()
        assert packed.max_seqlen == int(torch.bincount(segments).max())
        executed = report.decisions.experts_per_token[alive, layer] * (1 - report.decisions.drop[alive, layer])
        assert pairs[layer] == int(executed.sum())  # skipped slots never reach the experts
    pooled_tokens = PaddedBatch.from_mask(inputs["attention_mask"], inputs["input_ids"].shape, None)
    assert not dropped[pooled_tokens.packed_index(inputs["pooled_index"])].any()


def test_execution_mode_is_checked(model, inputs):
    with pytest.raises(ValueError, match=r"adaptive.execution='varlen' is not one of \('masked', 'packed'\)"):
        model(**inputs, adaptive=dict(ACTIONS["top-k"], execution="varlen"))


def test_adaptive_bench_prints_every_action_and_valid_json(capsys, monkeypatch):
    """`moezoo bench moemb --adaptive` on the tiny layout (no timing assertion: the machine is shared)."""
    from moezoo.bench import moemb_adaptive
    from moezoo.bench.moemb import add_bench_arguments, bench_configs, run_bench
    from moezoo.bench.moemb_adaptive import FIXED_ACTIONS, AdaptiveBenchRow, print_adaptive_table

    monkeypatch.setattr(moemb_adaptive, "MODES_GRID_POINTS", 4)  # a coarse MoDES calibration
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--adaptive", "--size", "tiny", "--batch-size", "2", "--text-tokens", "8",
                              "--image-size", "32", "--seconds-per-case", "0.1", "--threads", "1", "--json"])
    assert run_bench(args) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [row["action"] for row in rows]
    assert names[:2] == ["full (padded)", "full (packed)"] and set(FIXED_ACTIONS) < set(names)
    assert {"top-k' 2", "top-k' 1", "modes skip 0.5", "modes skip 0.75"} < set(names)
    assert sum(name.startswith("modes+gdn-beta") for name in names) == 1
    for row in rows[2:]:
        assert row["max_abs_diff_vs_masked"] <= 1e-5 and row["met"] in (True, False)
        assert row["ideal_speedup"] == pytest.approx(1 / (1 - row["flops_saving"]))
        assert row["share_of_ideal"] == pytest.approx(row["realised_speedup"] / row["ideal_speedup"])
    assert max(row["realised_speedup"] for row in rows[:2]) == 1.0  # the faster full compute is the reference
    print_adaptive_table([AdaptiveBenchRow(**row) for row in rows], "tiny", bench_configs("tiny")[0])
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("full", "gdn-beta", "beta-rank", "otsu-logit", "top-k'", "modes"))
    assert f"of {len(rows) - 2} targets met" in printed


# --- GPU kernels (make gpu-check) -------------------------------------------------------------------------------------


@pytest.mark.skipif(
    fla_chunk_gated_delta_rule is None or not torch.cuda.is_available(),
    reason="needs flash-linear-attention and a GPU (the CPU runs the stock Gated DeltaNet per segment)",
)
def test_packed_actions_on_cuda_with_fla_match_the_cpu_masked_reference(model, inputs):
    """fla's varlen Gated DeltaNet (convolution and delta rule reading cu_seqlens) after GDN-β pruning."""
    cuda_model = copy.deepcopy(model).cuda()
    cuda_inputs = {key: value.cuda() for key, value in inputs.items()}
    for action in ("modes+gdn-prune", "beta-rank", "top-k"):
        with torch.no_grad():
            expected = model(**inputs, adaptive=dict(ACTIONS[action], execution="masked")).embeddings
            got = cuda_model(**cuda_inputs, adaptive=dict(ACTIONS[action], execution="packed")).embeddings
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attention's varlen kernel needs a GPU")
def test_packed_actions_on_cuda_with_flash_attn_varlen_match_sdpa(model, inputs):
    """flash_attention_2 in bf16 reads the recomputed cu_seqlens / max_seqlen after pruning (explicit kwargs)."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    models = {}
    for implementation in ("sdpa", "flash_attention_2"):
        models[implementation] = copy.deepcopy(model).to("cuda", torch.bfloat16)
        models[implementation].set_attn_implementation(implementation)
    batch = {key: value.to("cuda", torch.bfloat16 if value.is_floating_point() else value.dtype)
             for key, value in inputs.items()}  # fmt: skip
    with torch.no_grad():
        sdpa, flash = (models[name](**batch, adaptive=ACTIONS["modes+gdn-prune"]).embeddings for name in models)
    torch.testing.assert_close(flash.float(), sdpa.float(), atol=2e-2, rtol=0)
