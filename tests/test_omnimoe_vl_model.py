"""OmniMoE-VL on the tiny preset: config validation, the projector's routing and its mathematical properties (spec
omnimoe_vl.md §8), the injection and its sparsity, exploration, route interventions and generation (spec §9.2-9.10)."""

import copy
import itertools

import pytest
import torch

from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from moezoo.modeling.omnimoe_vl_projector import (
    depth_prior,
    effective_count,
    floored_participation,
    participation_target,
    top_k_softmax,
    underuse_bonus,
)


IMAGE, START, END = TINY_OMNIMOE_VL["image_token_id"], 151, 152
NUM_PATCHES = 16


def tiny_config(**changes) -> OmniMoeVlConfig:
    return OmniMoeVlConfig(**{**copy.deepcopy(TINY_OMNIMOE_VL), **changes})


def tiny_model(seed: int = 0, gate: float = 0.0, **changes) -> OmniMoeVlForConditionalGeneration:
    torch.manual_seed(seed)
    model = OmniMoeVlForConditionalGeneration(tiny_config(**changes)).eval()
    with torch.no_grad():
        model.model.projector.injection.gate.fill_(gate)
        # Distinct depth scores: the freshly initialised score heads give nearly equal ones.
        for score in model.model.projector.depth_score:
            score.fc2.weight.normal_(std=1.0)
    return model


def row(question: list[int], prefix: list[int] = (1, 2)) -> list[int]:
    return [*prefix, START, *[IMAGE] * NUM_PATCHES, END, *question]


def batch(rows: list[list[int]], seed: int = 0, left_pad: bool = True):
    """input_ids, attention_mask and pixel_values of rows of different lengths, padded with 0."""
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, tokens in enumerate(rows):
        span = slice(width - len(tokens), width) if left_pad else slice(0, len(tokens))
        input_ids[index, span] = torch.tensor(tokens)
        attention_mask[index, span] = 1
    pixel_values = torch.randn(len(rows), 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    return input_ids, attention_mask, pixel_values


ROWS = [row([5, 6, 7, 8]), row([9, 10, 11], prefix=[3])]


# --- config ----------------------------------------------------------------------------------------------------------


def test_default_config_is_the_papers_model():
    config = OmniMoeVlConfig()
    assert config.vision_feature_layers == list(range(1, 38, 4)) and config.injection_layers == list(range(10))
    assert config.num_image_tokens == 576 and config.vision_config.num_hidden_layers == 37
    assert config.text_config.mlp_only_layers == list(range(1, 36, 2))
    assert [config.text_config.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert config.text_config.norm_topk_prob and config.participation_target_max == 16


def test_config_round_trips(tmp_path):
    config = tiny_config()
    config.save_pretrained(tmp_path)
    reloaded = OmniMoeVlConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(depth_top_k=4), "OmniMoeVlConfig.depth_top_k"),
        (dict(fusion_top_k=0), "OmniMoeVlConfig.fusion_top_k"),
        (dict(injection_layers=[0, 1]), "OmniMoeVlConfig.injection_layers"),
        (dict(injection_layers=[0, 1, 6]), "OmniMoeVlConfig.injection_layers"),
        (dict(vision_feature_layers=[1, 3, 7]), "OmniMoeVlConfig.vision_feature_layers"),
        (dict(vision_feature_layers=[0, 3, 5]), "OmniMoeVlConfig.vision_feature_layers"),
        (dict(query_floor=0.2), "OmniMoeVlConfig.query_floor"),
        (dict(projector_attn_heads=5), "OmniMoeVlConfig.projector_attn_heads"),
        (dict(fusion_temperature=0.0), "OmniMoeVlConfig.fusion_temperature"),
        (dict(usage_ema_decay=1.0), "OmniMoeVlConfig.usage_ema_decay"),
        (dict(injection_type="static_lora"), "OmniMoeVlConfig.injection_type"),
        (dict(image_token_id=160), "OmniMoeVlConfig.image_token_id"),
        (dict(vision_end_token_id=150), "OmniMoeVlConfig.image_token_id"),
        (dict(injection_max_relative_norm=-1.0), "OmniMoeVlConfig.injection_max_relative_norm"),
    ],
)
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        tiny_config(**changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(image_size=72), "OmniMoeVlVisionConfig.image_size"),
        (dict(moe_layers=[0, 6]), "OmniMoeVlVisionConfig.moe_layers"),
        (dict(num_experts_per_tok=2), "OmniMoeVlVisionConfig.top1_straight_through"),
    ],
)
def test_invalid_vision_values_name_the_field(changes, field):
    vision = {**TINY_OMNIMOE_VL["vision_config"], **changes}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        tiny_config(vision_config=vision)


def test_invalid_text_values_name_the_field():
    text = {**TINY_OMNIMOE_VL["text_config"], "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"OmniMoeVlTextConfig\.num_key_value_heads"):
        tiny_config(text_config=text)


# --- routing math (spec §8) ------------------------------------------------------------------------------------------


def test_p1_p2_p3_participation():
    logits = torch.randn(200, 16, dtype=torch.float64) * 5
    weights = floored_participation(logits, 1e-4)
    assert torch.allclose(weights.sum(-1), torch.ones(200, dtype=torch.float32), atol=1e-6)
    assert bool((weights >= 1e-4 - 1e-9).all())
    counts = effective_count(weights)
    assert bool((counts >= 1 - 1e-5).all() and (counts <= 16 + 1e-5).all())
    for k in (1, 3, 16):
        assert torch.isclose(effective_count(torch.full((k,), 1 / k)), torch.tensor(float(k)))
    targets = participation_target(torch.tensor([0, 10, 50, 200, 10**9]), 4.0, 2.0, 16.0)
    assert torch.allclose(targets, torch.tensor([4.0, 6.3979, 7.9318, 9.3033, 16.0]), atol=1e-3)


def test_p7_p9_top_k_softmax():
    logits = torch.randn(50, 10)
    route = top_k_softmax(logits, 4)
    assert torch.allclose(route.sum(-1), torch.ones(50)) and bool(((route > 0).sum(-1) == 4).all())
    shifted = top_k_softmax(logits + 3.0, 4)  # shift invariance (up to fp32 rounding of the shifted logits)
    assert torch.equal(shifted > 0, route > 0) and torch.allclose(shifted, route, atol=1e-6)
    assert torch.allclose(top_k_softmax(logits, 10), torch.softmax(logits, -1))
    assert torch.equal(top_k_softmax(logits, 1), torch.nn.functional.one_hot(logits.argmax(-1), 10).float())
    tied = top_k_softmax(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), 2)  # ties go to the lower index
    assert torch.equal(tied > 0, torch.tensor([False, True, True, False, False]))


def test_p8_prior_and_bonus():
    prior = depth_prior(torch.zeros(10), alpha=1.0, kernel_width=1.0)
    assert bool((prior > 0).all()) and torch.isclose(prior.sum(), torch.tensor(1.0))
    assert torch.isclose(torch.log(prior[0] / prior[4]), torch.tensor(-0.2458), atol=1e-4)
    usage = torch.full((10,), 30.0)
    usage[3] = 0.0
    bonus = underuse_bonus(usage, 1e-3)
    assert torch.isclose(bonus.mean(), torch.tensor(1.0))
    assert torch.isclose(bonus[3], torch.tensor(9.51), atol=0.01)
    assert torch.isclose(bonus[0], torch.tensor(0.055), atol=1e-3)
    assert torch.allclose(underuse_bonus(torch.full((10,), 7.0), 1e-3), torch.ones(10))


# --- forward, shapes and sparsity (spec §2.8, §9.4, §9.10) ------------------------------------------------------------


def test_output_shapes_and_sparsity():
    model = tiny_model()
    input_ids, attention_mask, pixel_values = batch(ROWS)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                    output_router_logits=True, output_hidden_states=True)
    context = out.routing_context
    assert out.logits.shape == (2, input_ids.shape[1], 160)
    assert out.image_hidden_states.shape == (2, NUM_PATCHES, 64)
    assert out.query_weights.shape == (2, 6) and out.router_queries.shape == (2, 3, 64)
    assert out.depth_scores.shape == out.depth_route.shape == (2, 3)
    assert out.fusion_weights.shape == (2, 4, 3)
    assert context.text_factors.shape == (2, 4, 64) and context.visual_factors.shape == (2, 3, 4, 64)
    assert context.coefficients.shape == (2, 3, 4)
    assert torch.allclose(context.coefficients.sum(-1), torch.ones(2, 3))  # P18
    assert bool(((out.depth_route > 0).sum(-1) == 2).all())  # k nonzero per row
    assert bool(((out.fusion_weights > 0).sum(-1) == 2).all())  # k_loc nonzero per group
    assert torch.equal(out.fusion_weights > 0, (out.depth_route > 0)[:, None].expand_as(out.fusion_weights))
    assert len(out.router_logits) == 3 and len(out.image_outputs.router_logits) == 3 and len(out.hidden_states) == 7
    assert out.router_logits[0].shape == (int(attention_mask.sum()), 8)  # padding is never routed
    assert out.image_outputs.router_logits[0].shape == (2 * NUM_PATCHES, 8)


def test_p10_local_log_ratio():
    model = tiny_model()
    projector = model.model.projector
    streams = torch.randn(1, 3, NUM_PATCHES, 64)
    queries = torch.randn(1, 3, 64)
    route = torch.tensor([[0.0, 0.3, 0.7]])
    with torch.no_grad():
        _, weights = projector.fuse(streams, queries, route)
        groups = torch.nn.functional.normalize(streams.view(1, 3, 4, 4, 64).mean(3), dim=-1)
        alignment = torch.einsum("bsgd,bd->bgs", groups, torch.nn.functional.normalize(queries.mean(1), dim=-1))
    expected = torch.log(route[0, 1] / route[0, 2]) + (alignment[0, :, 1] - alignment[0, :, 2]) / 0.7
    assert torch.allclose(torch.log(weights[0, :, 1] / weights[0, :, 2]), expected, atol=1e-5)


def test_p11_fusion_is_group_local_with_the_route_fixed():
    model = tiny_model()
    input_ids, attention_mask, pixel_values = batch(ROWS[:1])
    with torch.no_grad():
        streams = model.model.visual_streams(model.model.get_image_features(pixel_values))
        route = model(input_ids=input_ids, visual_streams=streams).depth_route
        override = {"fusion": route, "injection": route}
        base = model(input_ids=input_ids, visual_streams=streams, route_override=override).image_hidden_states
        changed = streams.clone()
        changed[:, :, 5] += torch.randn(32)  # patch 5 lies in group 1 (patches 4..7)
        moved = model(input_ids=input_ids, visual_streams=changed, route_override=override).image_hidden_states
    differs = (moved - base).abs().amax(-1)[0] > 1e-6
    assert bool(differs[4:8].any()) and not bool(differs[:4].any()) and not bool(differs[8:].any())


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm", "moezoo"])
def test_every_experts_implementation_agrees(implementation):
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
        model.set_experts_implementation(implementation)
        got = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
    real = attention_mask.bool()
    assert (got[real] - expected[real]).abs().max() <= 1e-5


# --- injection (spec §9.2, §9.4) -------------------------------------------------------------------------------------


def test_gate_zero_is_no_injection_and_a_gate_changes_the_logits():
    input_ids, attention_mask, pixel_values = batch(ROWS)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    with torch.no_grad():
        gated_off = tiny_model()(**inputs).logits
        no_injection = tiny_model(injection_type="none")(**inputs).logits
        injected = tiny_model(gate=0.5)(**inputs).logits
    assert torch.equal(gated_off, no_injection)
    assert (injected - gated_off)[attention_mask.bool()].abs().max() > 1e-3


def test_injection_acts_only_before_anchors_on_the_route():
    model, reference = tiny_model(gate=0.5), tiny_model(injection_type="none")
    input_ids, attention_mask, pixel_values = batch(ROWS[:1])
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                  output_hidden_states=True)
    with torch.no_grad():
        out, base = model(**inputs), reference(**inputs)
    support = (out.depth_route[0] > 0).nonzero().flatten().tolist()  # streams s, anchored before layer s
    first = min(support)
    for index, (ours, theirs) in enumerate(zip(out.hidden_states, base.hidden_states)):
        # hidden_states[i] is the input of layer i, after the injection: it differs from the first anchor on
        assert torch.equal(ours, theirs) == (index < first), index
    # An anchor whose stream is off the route adds exactly nothing.
    off_route = next(stream for stream in range(3) if stream not in support)
    delta = model.model.projector.injection.residual(
        off_route, torch.randn(1, input_ids.shape[1], 64), out.routing_context, input_ids == IMAGE
    )
    assert torch.equal(delta, torch.zeros_like(delta))


# --- determinism and invariances in eval (spec §9.3) ------------------------------------------------------------------


def test_route_is_deterministic_batch_order_and_padding_invariant():
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    with torch.no_grad():
        first = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
        again = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
        alone = model(input_ids=input_ids[1:, 2:], pixel_values=pixel_values[1:])
        right = model(*batch(ROWS, left_pad=False)[:1], attention_mask=batch(ROWS, left_pad=False)[1],
                      pixel_values=pixel_values)
    for name in ("depth_route", "fusion_weights", "query_weights", "logits"):
        assert torch.equal(first[name], again[name]), name
    assert (alone.depth_route - first.depth_route[1:]).abs().max() <= 1e-6
    assert (right.depth_route - first.depth_route).abs().max() <= 1e-6


def test_route_ignores_the_order_of_prompt_tokens():
    model = tiny_model()
    ids = row([5, 6, 7, 8, 9])
    shuffled = row([9, 7, 5, 8, 6])
    pixel_values = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        route = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values).depth_route
        permuted = model(input_ids=torch.tensor([shuffled]), pixel_values=pixel_values).depth_route
    assert (route - permuted).abs().max() <= 1e-6


# --- exploration (spec §9.5) -----------------------------------------------------------------------------------------


def test_exploration_updates_usage_in_training_only():
    model = tiny_model()
    router = model.model.projector.depth_router
    input_ids, attention_mask, pixel_values = batch(ROWS)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    model.train()
    with torch.no_grad():
        model(**inputs)
    usage = router.depth_usage_ema.clone()
    assert torch.isclose(usage.sum(), torch.tensor(0.01 * 2 * 2))  # 2 samples x k = 2 depths, decay 0.99
    router.routing_step.fill_(model.config.exploration_steps)  # exploration over: content routing, no update
    with torch.no_grad():
        out = model(**inputs)
    assert torch.equal(router.depth_usage_ema, usage)
    assert torch.equal(out.depth_route, top_k_softmax(out.depth_scores, 2))
    model.eval()
    router.routing_step.zero_()
    with torch.no_grad():
        out = model(**inputs)
    assert torch.equal(router.depth_usage_ema, usage)
    assert torch.equal(out.depth_route, top_k_softmax(out.depth_scores, 2))


def test_exploration_state_stays_fp32_in_bfloat16(tmp_path):
    model = tiny_model()
    model.model.projector.depth_router.depth_usage_ema.copy_(torch.tensor([0.1234567, 2.0, 3.0]))
    model.to(torch.bfloat16)
    router = model.model.projector.depth_router
    assert router.depth_usage_ema.dtype == torch.float32 and router.depth_usage_ema[0] == 0.1234567
    assert router.routing_step.dtype == torch.int64
    model.save_pretrained(tmp_path)
    reloaded = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert reloaded.model.projector.depth_router.depth_usage_ema.dtype == torch.float32
    assert torch.equal(reloaded.model.projector.depth_router.depth_usage_ema, router.depth_usage_ema)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    with torch.no_grad():
        logits = reloaded.eval()(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


# --- route interventions (spec §9.6) ---------------------------------------------------------------------------------


def test_route_override():
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    with torch.no_grad():
        native = model(**inputs)
        route = native.depth_route
        same = model(**inputs, route_override={"fusion": route, "injection": route})
        other = torch.roll(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), 1, dims=-1)
        fusion = model(**inputs, route_override={"fusion": other})
        injection = model(**inputs, route_override={"injection": other})
    real = attention_mask.bool()
    assert torch.equal(same.logits, native.logits)
    assert (fusion.logits - native.logits)[real].abs().max() > 1e-4
    assert torch.equal(fusion.depth_route, route)  # the outputs keep the sample's own route
    assert (injection.logits - native.logits)[real].abs().max() > 1e-4
    assert torch.equal(injection.image_hidden_states, native.image_hidden_states)  # fusion untouched
    with pytest.raises(ValueError, match=r"route_override\['fusion'\]"):
        model(**inputs, route_override={"fusion": torch.ones(2, 4)})
    with pytest.raises(ValueError, match="route_override has keys"):
        model(**inputs, route_override={"both": route})


# --- generation (spec §9.7) ------------------------------------------------------------------------------------------


def test_generation_with_and_without_cache_is_equal():
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, max_new_tokens=6,
                  do_sample=False)
    cached = model.generate(**inputs)
    uncached = model.generate(**inputs, use_cache=False)
    assert torch.equal(cached, uncached)


def test_decode_step_logits_equal_full_recompute():
    model = tiny_model(gate=0.5)
    input_ids, _, pixel_values = batch(ROWS[:1])
    with torch.no_grad():
        prefill = model(input_ids=input_ids, pixel_values=pixel_values, use_cache=True)
        step_ids = torch.tensor([[17, 23]])
        step = model(input_ids=step_ids, cache=prefill.cache, routing_context=prefill.routing_context)
        full_ids = torch.cat([input_ids, step_ids], dim=1)
        prompt_mask = model.model.default_prompt_mask(input_ids, None)
        full = model(input_ids=full_ids, pixel_values=pixel_values,
                     prompt_mask=torch.nn.functional.pad(prompt_mask, (0, 2)))
    assert (step.logits - full.logits[:, -2:]).abs().max() <= 1e-5


def test_batched_left_padded_generation_equals_one_by_one():
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    together = model.generate(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                              max_new_tokens=5, do_sample=False)
    for index, tokens in enumerate(ROWS):
        alone = model.generate(input_ids=torch.tensor([tokens]), pixel_values=pixel_values[index:index + 1],
                               max_new_tokens=5, do_sample=False)
        assert torch.equal(together[index, -5:], alone[0, -5:]), index


def test_beam_search_sampling_and_text_only_generation_run():
    model = tiny_model(gate=0.5)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    beams = model.generate(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                           max_new_tokens=4, num_beams=2, do_sample=False)
    assert beams.shape == (2, input_ids.shape[1] + 4)
    torch.manual_seed(0)
    sampled = model.generate(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                             max_new_tokens=4, do_sample=True, num_return_sequences=2)
    assert sampled.shape == (4, input_ids.shape[1] + 4)
    text = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert text.shape == (1, 7)


# --- training smoke (spec §9.8) --------------------------------------------------------------------------------------


def test_one_training_step_reaches_every_part():
    model = tiny_model(gate=0.5).train()
    model.activation_checkpointing_enable()
    input_ids, attention_mask, pixel_values = batch(ROWS)
    labels = torch.full_like(input_ids, -100)
    labels[:, -3:] = input_ids[:, -3:]  # the answer: left out of the default prompt
    out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, labels=labels,
                output_router_logits=True)
    assert bool(torch.isfinite(out.loss)) and out.aux_loss is not None
    out.loss.backward()
    assert int(out.prompt_lengths.min()) >= 1 and int(out.prompt_lengths[0]) == 3  # 1, 2 and 5 (not 6, 7, 8)
    parameters = dict(model.named_parameters())
    assert parameters["model.vision_tower.encoder.layers.0.mlp.gate.weight"].grad.abs().sum() > 0  # straight-through
    assert parameters["model.language_model.layers.0.mlp.gate.weight"].grad.abs().sum() > 0
    for name in ("model.projector.injection.gate", "model.projector.injection.adapter_up",
                 "model.projector.queries.query_bank", "model.projector.depth_score.0.fc2.weight",
                 "model.projector.stream_proj.0.linear_fc1.weight"):
        assert parameters[name].grad is not None and parameters[name].grad.abs().sum() > 0, name


# --- bad input -------------------------------------------------------------------------------------------------------


def test_placeholder_count_must_match_the_images():
    model = tiny_model()
    input_ids, attention_mask, pixel_values = batch(ROWS)
    missing = input_ids.clone()
    missing[0, 5] = 7  # 15 placeholders in the first row
    with pytest.raises(ValueError, match=r"one image per sample.*\[15, 16\] placeholders per row"):
        model(input_ids=missing, attention_mask=attention_mask, pixel_values=pixel_values)
    with pytest.raises(ValueError, match="one image per sample"):
        model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values[:1])
    with pytest.raises(ValueError, match="pixel_values or visual_streams"):
        model(input_ids=input_ids, pixel_values=pixel_values, visual_streams=torch.zeros(2, 3, 16, 32))


def test_routing_objects_are_fp32_under_bfloat16():
    model = tiny_model().to(torch.bfloat16)
    input_ids, attention_mask, pixel_values = batch(ROWS)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    for name in ("depth_route", "depth_scores", "query_weights", "fusion_weights"):
        assert out[name].dtype == torch.float32, name
    assert out.image_hidden_states.dtype == torch.bfloat16
    assert list(itertools.islice((out.depth_route > 0).sum(-1).tolist(), 2)) == [2, 2]
