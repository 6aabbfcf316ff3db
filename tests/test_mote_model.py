"""MoTE configurations and models (spec mote.md §2-4, §9) on the tiny configs of §4.4.

MoTE models are built by converting a dense tiny model (random MoTE weights would have unrelated experts), so the
strongest checks compare against transformers' own LlamaForCausalLM and GlmOcrForConditionalGeneration.
"""

import copy
import json
import logging
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoModelForMultimodalLM,
    GlmOcrConfig,
    GlmOcrForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipConfig,
    SiglipModel,
)

from conftest import run_python
from moezoo.configuration.mote import (
    GLM_OCR_MOTE_CONFIGS,
    TINY_GLM_OCR,
    TINY_GLM_OCR_MOTE,
    TINY_LLAMA,
    TINY_LLAMA_MOTE,
    TINY_SIGLIP_VISION,
    TINY_VIDEOLLM_MOTE,
    VIDEOLLM_MOTE_CONFIGS,
    GlmOcrMoteConfig,
    LlamaMoteConfig,
    VideoLlmMoteConfig,
)
from moezoo.conversion.mote_glm_ocr import convert_glm_ocr_to_mote, synthetic_inputs
from moezoo.conversion.mote_llama import convert_llama_to_mote, synthetic_video_inputs
from moezoo.hub.export import export_folder
from moezoo.hub.flatten import flatten_modules
from moezoo.modeling.moe.accounting import count_parameters
from moezoo.modeling.moe.router import TopKRouter
from moezoo.modeling.mote.common import MoteFeedForward
from moezoo.modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from moezoo.modeling.mote.llama import LlamaMoteDecoderLayer, LlamaMoteForCausalLM
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from moezoo.zoo import create_from_preset


COIN = ["step", "next", "proc", "task", "proc_plus"]
P_FFN_TINY = 2 * 3 * 64 * 128  # two layers of gate/up/down 64x128


def dense_llama(seed=0, **changes):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA | changes)).eval()


def converted_llama(tmp_path_factory, experts=COIN, seed=0, **options):
    """(dense tiny Llama, its MoTE conversion)."""
    base = dense_llama(seed)
    folder = tmp_path_factory.mktemp("llama")
    base.save_pretrained(folder)
    model, _ = convert_llama_to_mote(folder, experts=experts, verify=False, **options)
    return base, model


def token_batch(batch_size=2, length=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (batch_size, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def routes(*ids):
    return torch.tensor(ids, dtype=torch.long)


def train(model, steps, experts, lr=1e-2, seed=0, parameters=None, weight_decay=0.0):
    """A few AdamW steps on random sequences, cycling through the routes `experts` (homogeneous batches)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        parameters if parameters is not None else model.parameters(), lr=lr, weight_decay=weight_decay
    )
    model.train()
    for step in range(steps):
        input_ids = torch.randint(3, 128, (4, 8), generator=generator)
        route = model.route_id(experts[step % len(experts)])
        loss = model(input_ids=input_ids, labels=input_ids, task_ids=torch.full((4,), route)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return optimizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return converted_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A converted tiny Llama with three routes trained jointly, so that its experts differ."""
    _, model = converted_llama(tmp_path_factory, experts=["t0", "t1", "t2"])
    train(model, 12, ["t0", "t1", "t2"])
    return model


# --- configuration -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(mote_expert_names="step"), "mote_expert_names"),
        (dict(mote_expert_names=["step", "step"]), "mote_expert_names"),
        (dict(mote_expert_names=["Step"]), "mote_expert_names"),
        (dict(mote_expert_names=["keys"]), "mote_expert_names"),
        (dict(mote_expert_names=["9lives"]), "mote_expert_names"),
        (dict(mote_expert_descriptions={"unknown": "x"}), "mote_expert_descriptions"),
        (dict(mote_default_route="missing"), "mote_default_route"),
        (dict(mote_layers=[1, 0]), "mote_layers"),
        (dict(mote_layers=[2]), "mote_layers"),
        (dict(mote_routing_mode="soft"), "mote_routing_mode"),
        (dict(mote_num_shared_experts=2), "mote_num_shared_experts"),
        (dict(mote_routed_expert_scale=-1.0), "mote_routed_expert_scale"),
        (dict(mote_init={"experts": "split", "shared": "zero_down"}), "mote_init"),
    ],
)
def test_invalid_mote_fields_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"LlamaMoteConfig.{field}"):
        LlamaMoteConfig(**TINY_LLAMA_MOTE | changes)


def test_copy_half_without_a_shared_expert_is_rejected_naming_both_fields():
    copy_half = dict(mote_init={"experts": "copy", "shared": "copy_half"}, mote_num_shared_experts=0)
    both_fields = r"LlamaMoteConfig.mote_init\['shared'\]='copy_half' .* LlamaMoteConfig.mote_num_shared_experts=0"
    with pytest.raises(ValueError, match=both_fields):
        LlamaMoteConfig(**TINY_LLAMA_MOTE | copy_half)


def test_invalid_videollm_fields_name_the_field():
    with pytest.raises(ValueError, match="frame_num_tokens"):
        VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE | dict(frame_num_tokens=9))
    with pytest.raises(ValueError, match="video_token_id"):
        VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE | dict(video_token_id=128002))  # beyond the tiny vocabulary
    with pytest.raises(ValueError, match="frame_resolution"):
        VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE | dict(frame_resolution=64))


def test_the_video_placeholder_and_the_frame_separator_must_be_different_tokens():
    with pytest.raises(ValueError, match="video_token_id and VideoLlmMoteConfig.frame_token_interval_id are both 11"):
        VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE | dict(video_token_id=11))


@pytest.mark.parametrize(
    "config_class, fields",
    [
        (LlamaMoteConfig, TINY_LLAMA_MOTE),
        (GlmOcrMoteConfig, TINY_GLM_OCR_MOTE),
        (VideoLlmMoteConfig, TINY_VIDEOLLM_MOTE),
    ],
)
def test_configs_round_trip_with_their_expert_registry(config_class, fields, tmp_path):
    config = config_class(**fields)
    config.save_pretrained(tmp_path)
    loaded = config_class.from_pretrained(tmp_path)
    text, loaded_text = config.get_text_config(), loaded.get_text_config()
    assert type(loaded_text) is type(text)
    assert loaded_text.mote_expert_names == text.mote_expert_names
    assert loaded_text.mote_expert_descriptions == text.mote_expert_descriptions
    assert loaded_text.mote_default_route == text.mote_default_route
    assert loaded.to_dict() == config.to_dict()


# --- clone equivalence (spec §9.1) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_every_llama_route_reproduces_the_dense_model(llama, attention):
    base, model = copy.deepcopy(llama)
    base.set_attn_implementation(attention)
    model.set_attn_implementation(attention)
    batch = token_batch()
    with torch.no_grad():
        expected = base(**batch).logits
        for route in range(len(COIN)):
            assert torch.equal(model(**batch, task_ids=routes(route, route)).logits, expected), COIN[route]
        hidden_states = model(**batch, task_ids=routes(0, 0), output_hidden_states=True).hidden_states
        reference = base(**batch, output_hidden_states=True).hidden_states
        assert len(hidden_states) == len(reference) == 3
        assert all(torch.equal(mote, dense) for mote, dense in zip(hidden_states, reference))
    generated = base.generate(**batch, max_new_tokens=8, do_sample=False)
    for route in (0, 4):
        assert torch.equal(model.generate(**batch, task_ids=routes(route, route), max_new_tokens=8, do_sample=False),
                           generated)


def test_llama_routes_reproduce_the_dense_model_in_bfloat16(llama):
    base, model = (copy.deepcopy(m).to(torch.bfloat16) for m in llama)
    batch = token_batch()
    with torch.no_grad():
        expected = base(**batch).logits
        assert all(torch.equal(model(**batch, task_ids=routes(r, r)).logits, expected) for r in range(len(COIN)))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    torch.manual_seed(0)
    base = GlmOcrForConditionalGeneration(GlmOcrConfig(**TINY_GLM_OCR)).eval()
    folder = tmp_path_factory.mktemp("glm_ocr")
    base.save_pretrained(folder)
    model, _ = convert_glm_ocr_to_mote(folder, verify=False)
    return base, model


def test_every_glm_ocr_route_reproduces_glm_ocr_on_images(glm):
    base, model = glm
    inputs = synthetic_inputs(model.config)  # two examples, one image each
    with torch.no_grad():
        expected = base(**inputs).logits
        assert torch.equal(model(**inputs).logits, expected)  # no task_ids: the default route "ocr"
        for route in range(2):
            assert torch.equal(model(**inputs, task_ids=routes(route, route)).logits, expected)
    generated = base.generate(**inputs, max_new_tokens=8, do_sample=False)
    kie = model.route_id("kie")
    assert torch.equal(model.generate(**inputs, task_ids=routes(kie, kie), max_new_tokens=8, do_sample=False),
                       generated)


@pytest.fixture(scope="module")
def videollm(tmp_path_factory):
    base = dense_llama()
    llm, vision = tmp_path_factory.mktemp("llm"), tmp_path_factory.mktemp("siglip")
    base.save_pretrained(llm)
    torch.manual_seed(1)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    SiglipModel(SiglipConfig(vision_config=TINY_SIGLIP_VISION, text_config=text)).save_pretrained(vision)
    model, _ = convert_llama_to_mote(llm, vision=vision, video_token="<v>", video_token_id=120,
                                     frame_token_interval_id=11, verify=False)
    return base, model


def test_every_videollm_route_reproduces_the_dense_llama_on_video_embeddings(videollm):
    base, model = videollm
    inputs = synthetic_video_inputs(model.config)
    with torch.no_grad():
        frame_tokens = torch.cat(model.get_video_features(inputs["pixel_values_videos"]).pooler_output)
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        mask = (inputs["input_ids"] == model.config.video_token_id)[..., None]
        embeds = embeds.masked_scatter(mask, model.model.multi_modal_projector(frame_tokens))
        expected = base(inputs_embeds=embeds).logits
        for route in range(len(COIN)):
            assert torch.equal(model(**inputs, task_ids=routes(route, route)).logits, expected)
            assert torch.equal(model(inputs_embeds=embeds, task_ids=routes(route, route)).logits, expected)
    generated = base.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(inputs_embeds=embeds, task_ids=routes(3, 3), max_new_tokens=8, do_sample=False),
                       generated)


def test_videollm_loss_weighs_the_silent_frame_terms(videollm):
    _, model = copy.deepcopy(videollm)
    inputs = synthetic_video_inputs(model.config)
    input_ids = inputs["input_ids"]
    labels = torch.full_like(input_ids, -100)
    labels[:, -3:] = input_ids[:, -3:]  # the answer
    after_frame = torch.zeros_like(input_ids, dtype=torch.bool)
    after_frame[:, 1:] = input_ids[:, :-1] == model.config.video_token_id
    labels[after_frame & (input_ids != model.config.video_token_id)] = 2  # the last <v> of a frame -> EOS (silence)
    with torch.no_grad():
        logits = model(**inputs, task_ids=routes(0, 0)).logits
        assert torch.equal(model(**inputs, labels=labels, task_ids=routes(0, 0)).loss,
                           model.loss_function(logits=logits, labels=labels, vocab_size=128))
        model.config.stream_loss_weight = 0.25
        per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        weights = torch.where(input_ids[:, :-1] == model.config.video_token_id, 0.25, 1.0)
        expected = (per_token * weights).sum() / (labels[:, 1:] != -100).sum()
        torch.testing.assert_close(model(**inputs, labels=labels, task_ids=routes(0, 0)).loss, expected)


def test_videollm_frames_become_ten_tokens_each(videollm):
    _, model = videollm
    frames = synthetic_video_inputs(model.config)["pixel_values_videos"]  # 4 frames, two videos of two
    with torch.no_grad():
        features = model.get_video_features(frames, video_num_frames=routes(1, 3))
        vision = model.model.vision_tower(pixel_values=frames)
    assert [tuple(t.shape) for t in features.pooler_output] == [(10, 32), (30, 32)]
    first_frame = features.pooler_output[0]
    assert torch.equal(first_frame[0], vision.pooler_output[0])  # the "CLS": SigLIP's attention pooling
    grid = vision.last_hidden_state[0].reshape(4, 4, 32)  # 4x4 patches -> 3x3 average pooling, row-major
    expected = torch.nn.functional.adaptive_avg_pool2d(grid.permute(2, 0, 1), 3).flatten(1).t()
    torch.testing.assert_close(first_frame[1:], expected)
    with pytest.raises(ValueError, match="sum to the 4 frames"):
        model.get_video_features(frames, video_num_frames=routes(2, 3))
    inputs = synthetic_video_inputs(model.config)
    inputs["input_ids"][0, inputs["input_ids"][0].tolist().index(120)] = 5  # one placeholder fewer than tokens
    with pytest.raises(ValueError, match="video placeholders"):
        model(**inputs, task_ids=routes(0, 0))
    text_only = torch.full((2, 3), 5)  # a continued generation's next tokens, with the clip's frames passed again
    with pytest.raises(ValueError, match="0 video placeholders .* frames already in the KV cache"):
        model(input_ids=text_only, pixel_values_videos=frames, video_num_frames=routes(2, 2), task_ids=routes(0, 0))


def test_videollm_placeholders_without_frames_are_named_and_frames_need_their_resolution(videollm, caplog):
    _, model = videollm
    inputs = synthetic_video_inputs(model.config)
    frames = ("pixel_values_videos", "video_num_frames")
    without_frames = {key: value for key, value in inputs.items() if key not in frames}
    # A warning, not an error: transformers' common tests run text-only forwards over placeholder ids.
    with caplog.at_level(logging.WARNING, logger="moezoo.modeling.mote.common"):
        model(**without_frames, task_ids=routes(0, 0))
    assert re.search("40 video placeholders .* but no frames were given: .* pass the processor's pixel_values_videos",
                     caplog.text)
    resolution = model.config.frame_resolution
    size = resolution + 16
    wrong_size = inputs | {"pixel_values_videos": torch.zeros(4, 3, size, size)}
    with pytest.raises(ValueError, match=f"{size}x{size} frames, but config.frame_resolution={resolution}: .* processor"):
        model(**wrong_size, task_ids=routes(0, 0))


def test_glm_ocr_image_placeholders_without_their_image_are_named(glm, caplog):
    _, model = glm
    inputs = synthetic_inputs(model.config)
    without_image = {key: value for key, value in inputs.items() if key not in ("pixel_values", "image_grid_thw")}
    with caplog.at_level(logging.WARNING, logger="moezoo.modeling.mote.common"):
        model(**without_image)
    assert re.search("8 image placeholders .* but no image was given: .* pass the processor's pixel_values",
                     caplog.text)


# --- parameter accounting (spec §3.6, §9.2) -----------------------------------------------------------------------


def executed_parameters(model, inputs) -> int:
    """Parameters of the modules a forward actually runs, each counted once."""
    used = {}
    hooks = [
        module.register_forward_hook(lambda m, *_: used.update({id(p): p.numel() for p in m.parameters(recurse=False)}))
        for module in model.modules()
    ]
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    return sum(used.values())


def test_active_parameters_do_not_depend_on_the_number_of_experts():
    batch = token_batch() | {"task_ids": routes(0, 0)}
    p_dense = sum(p.numel() for p in dense_llama().parameters())
    totals, active, executed, flops = [], set(), set(), set()
    for num_experts in (1, 2, 5, 8):
        names = [f"e{i}" for i in range(num_experts)]
        model = LlamaMoteForCausalLM(LlamaMoteConfig(**TINY_LLAMA_MOTE | dict(mote_expert_names=names,
                                                                             mote_expert_descriptions={}))).eval()
        totals.append(model.num_parameters_mote(active=False))
        assert totals[-1] == p_dense + (num_experts + 1 - 1) * P_FFN_TINY
        active.add(model.num_parameters_mote(active=True))
        assert count_parameters(model).active == model.num_parameters_mote(active=True)
        executed.add(executed_parameters(model, batch))
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(**batch)
        flops.add(counter.get_total_flops())
    assert totals == [131_392, 180_544, 328_000, 475_456]
    assert active == executed == {131_392}
    assert len(flops) == 1


def test_paper_scale_parameter_counts_on_the_meta_device():
    with torch.device("meta"):
        videollm = VideoLlmMoteForConditionalGeneration(
            VideoLlmMoteConfig(**VIDEOLLM_MOTE_CONFIGS["VideoLLM-MoTE-1B+5E"])
        )
        videollm_6e = VideoLlmMoteForConditionalGeneration(
            VideoLlmMoteConfig(**VIDEOLLM_MOTE_CONFIGS["VideoLLM-MoTE-1B+6E"])
        )
        glm = GlmOcrMoteForConditionalGeneration(GlmOcrMoteConfig(**GLM_OCR_MOTE_CONFIGS["GLM-OCR-MoTE-0.9B+2E"]))
    # A.1: P_total = P_dense + (T + S - 1) P_FFN, P_active = P_dense + (k + S - 1) P_FFN
    assert videollm.num_parameters_mote(active=False) == 5_262_346_240
    assert videollm.num_parameters_mote(active=True) == 2_041_120_768
    assert videollm_6e.num_parameters_mote(active=False) == 6_067_652_608
    assert videollm_6e.num_parameters_mote(active=True) == 2_041_120_768
    assert sum(p.numel() for p in videollm.model.vision_tower.parameters()) == 316_283_904
    assert sum(p.numel() for p in videollm.model.multi_modal_projector.parameters()) == 6_295_552
    assert glm.num_parameters_mote(active=False) == 1_352_762_880
    assert glm.num_parameters_mote(active=True) == 1_013_024_256
    assert sum(p.numel() for p in glm.parameters()) == 1_786_883_072


# --- routes: determinism, training, mixed batches, generation (spec §9.3, §9.5) -------------------------------------


def test_routes_are_deterministic_and_separate_after_training(trained):
    batch = token_batch()
    with torch.no_grad():
        first = trained(**batch, task_ids=routes(0, 0)).logits
        assert torch.equal(trained(**batch, task_ids=routes(0, 0)).logits, first)
        assert not torch.allclose(trained(**batch, task_ids=routes(1, 1)).logits, first, atol=1e-3)


def test_mixed_route_batches_match_per_example_runs(trained):
    batch = token_batch(batch_size=3)
    mixed = routes(2, 0, 2)
    with torch.no_grad():
        together = trained(**batch, task_ids=mixed).logits
        for i, route in enumerate(mixed.tolist()):
            alone = trained(input_ids=batch["input_ids"][i : i + 1], task_ids=routes(route)).logits
            torch.testing.assert_close(together[i : i + 1], alone, atol=1e-5, rtol=1e-4)
    generated = trained.generate(**batch, task_ids=mixed, max_new_tokens=6, do_sample=False)
    for i, route in enumerate(mixed.tolist()):
        alone = trained.generate(input_ids=batch["input_ids"][i : i + 1], task_ids=routes(route), max_new_tokens=6,
                                 do_sample=False)
        assert torch.equal(generated[i : i + 1], alone)


def test_generate_keeps_each_example_on_its_route(trained):
    seen = []
    layer = trained.model.layers[1]
    hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["task_ids"].tolist()),
                                           with_kwargs=True)
    batch = token_batch()
    try:
        trained.generate(**batch, task_ids=routes(0, 2), num_beams=3, max_new_tokens=4, do_sample=False)
        assert len(seen) == 4 and all(ids == [0, 0, 0, 2, 2, 2] for ids in seen)
        seen.clear()
        torch.manual_seed(0)
        trained.generate(**batch, task_ids=routes(1, 2), do_sample=True, max_new_tokens=3)
        assert seen == [[1, 2]] * 3
    finally:
        hook.remove()


def test_cached_decoding_matches_full_recomputation_and_keeps_the_routes(trained):
    batch = token_batch()
    task_ids = routes(2, 1)
    with torch.no_grad():
        prefix = trained(input_ids=batch["input_ids"][:, :-1], task_ids=task_ids, use_cache=True)
        step = trained(input_ids=batch["input_ids"][:, -1:], cache=prefix.cache, task_ids=task_ids)
        full = trained(**batch, task_ids=task_ids, use_cache=False)
        torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-4)
        assert torch.equal(prefix.cache.mote_routes.task_ids, task_ids)
        with pytest.raises(ValueError, match="fixed for a whole sequence"):
            trained(input_ids=batch["input_ids"][:, -1:], cache=prefix.cache, task_ids=routes(0, 1))


@pytest.mark.parametrize(
    "task_ids, message",
    [
        (None, "task_ids is required"),
        (routes(0, 3), r"task_ids \[3\] are not routes"),
        (routes(-1, 0), r"task_ids \[-1\] are not routes"),
        (routes(0), r"shape \(2,\)"),
        (torch.tensor([0.0, 1.0]), "integer tensor"),
    ],
)
def test_bad_task_ids_are_rejected(trained, task_ids, message):
    with pytest.raises(ValueError, match=message):
        trained(**token_batch(), task_ids=task_ids)


def test_missing_task_ids_use_the_default_route(trained):
    model = copy.deepcopy(trained)
    model.config.mote_default_route = "t1"
    batch = token_batch()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model(**batch, task_ids=routes(1, 1)).logits)


# --- expert management (spec §3.3-3.5, §9.4) ----------------------------------------------------------------------


def route_logits(model, batch) -> dict[str, torch.Tensor]:
    names = model.config.mote_expert_names
    with torch.no_grad():
        return {name: model(**batch, task_ids=routes(*[model.route_id(name)] * 2)).logits for name in names}


def test_add_freeze_train_remove_and_swap_leave_other_routes_bit_identical(trained, tmp_path):
    model = copy.deepcopy(trained)
    batch = token_batch(seed=5)
    before = route_logits(model, batch)

    assert model.add_expert("t3", init_from="t0", description="the fourth task") == 3
    trainable = model.freeze_for_expert_addition("t3")
    expected = {id(p) for _, ffn in model.mote_layers() for p in ffn.experts["t3"].parameters()}
    assert {id(p) for p in trainable} == expected
    frozen = {key: value.clone() for key, value in model.state_dict().items() if ".experts.t3." not in key}
    optimizer = train(model, 10, ["t3"], parameters=trainable, weight_decay=0.1)
    optimizer_parameters = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimizer_parameters == {id(p) for p in trainable}
    after = route_logits(model, batch)
    assert all(torch.equal(after[name], before[name]) for name in ("t0", "t1", "t2"))
    assert not torch.equal(after["t3"], before["t0"])  # t3 started as t0 and trained
    state = model.state_dict()
    assert all(torch.equal(state[key], value) for key, value in frozen.items())

    model.save_pretrained(tmp_path)
    reloaded = LlamaMoteForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.mote_expert_names == ["t0", "t1", "t2", "t3"]
    assert reloaded.config.mote_expert_descriptions["t3"] == "the fourth task"
    assert torch.equal(route_logits(reloaded, batch)["t3"], after["t3"])

    model.remove_expert("t1")
    assert model.config.mote_expert_names == ["t0", "t2", "t3"] and model.route_id("t2") == 1
    assert not any(".experts.t1." in key for key in model.state_dict())
    removed = route_logits(model, batch)
    assert all(torch.equal(removed[name], after[name]) for name in ("t0", "t2", "t3"))

    model.swap_experts("t0", "t2")
    swapped = route_logits(model, batch)
    assert torch.equal(swapped["t0"], after["t2"]) and torch.equal(swapped["t2"], after["t0"])
    assert torch.equal(swapped["t3"], after["t3"])
    assert model.config.mote_expert_names == ["t0", "t2", "t3"]
    model.swap_experts("t2", "t0")
    assert all(torch.equal(route_logits(model, batch)[name], after[name]) for name in ("t0", "t2", "t3"))


def test_an_expert_added_from_the_dense_model_copies_its_ffns(tmp_path_factory):
    base, model = converted_llama(tmp_path_factory, experts=["step"])
    train(model, 4, ["step"])  # the existing expert moves away from the dense FFN
    assert model.add_expert("next", init_from="dense", dense_source=base, description="what comes next") == 1
    for layer, dense_layer in zip(model.model.layers, base.model.layers):
        experts = layer.mlp.experts
        assert all(torch.equal(a, b) for a, b in zip(experts["next"].state_dict().values(),
                                                     dense_layer.mlp.state_dict().values()))
        assert not torch.equal(experts["step"].down_proj.weight, dense_layer.mlp.down_proj.weight)
    assert model.config.mote_expert_descriptions == {"step": "recognize the current action step in the video",
                                                     "next": "what comes next"}


@pytest.mark.parametrize(
    "operation, message",
    [
        (lambda m: m.add_expert("Bad", init_from="t0"), "not valid"),
        (lambda m: m.add_expert("keys", init_from="t0"), "clashes with an attribute"),
        (lambda m: m.add_expert("t0", init_from="t1"), "already exists"),
        (lambda m: m.add_expert("t3", init_from="nothing"), "must be 'dense', 'shared' or an existing expert"),
        (lambda m: m.add_expert("t3"), "pass dense_source"),
        (lambda m: m.remove_expert("t9"), "no expert named 't9'"),
        (lambda m: m.swap_experts("t0", "t0"), "two different experts"),
        (lambda m: m.route_id("t9"), "no expert named 't9'"),
    ],
)
def test_bad_expert_management_says_what_to_fix(trained, operation, message):
    model = copy.deepcopy(trained)
    names = list(model.config.mote_expert_names)
    with pytest.raises(ValueError, match=message):
        operation(model)
    assert model.config.mote_expert_names == names
    assert all(list(ffn.experts) == names for _, ffn in model.mote_layers())


def test_the_last_expert_and_the_default_route_are_protected(tmp_path_factory):
    _, model = converted_llama(tmp_path_factory, experts=["ocr", "kie"], default_route="ocr")
    with pytest.raises(ValueError, match="force=True"):
        model.remove_expert("ocr")
    model.remove_expert("ocr", force=True)
    assert model.config.mote_default_route is None and model.config.mote_expert_names == ["kie"]
    with pytest.raises(ValueError, match="the only expert"):
        model.remove_expert("kie")
    assert list(model.model.layers[0].mlp.experts) == ["kie"]


# --- routing ablations (spec §2.5, §9.11) ---------------------------------------------------------------------------


def test_dense_routing_averages_the_experts_and_preserves_the_function_at_conversion(llama):
    base, model = copy.deepcopy(llama)
    model.set_routing_mode("dense")
    batch = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-5, rtol=1e-5)
        flops = []
        for experts in (["a"], ["a", "b", "c"]):
            probe = LlamaMoteForCausalLM(LlamaMoteConfig(**TINY_LLAMA_MOTE | dict(
                mote_expert_names=experts, mote_expert_descriptions={}, mote_routing_mode="dense")))
            with FlopCounterMode(display=False) as counter:
                probe(**batch)
            flops.append(counter.get_total_flops())
            assert probe.num_parameters_mote(active=True) == probe.num_parameters_mote(active=False)
    assert flops[1] > flops[0]


@pytest.mark.parametrize("mode", ["token_top1", "sample_top1"])
def test_learned_routers_add_a_load_balancing_loss(llama, mode):
    _, model = copy.deepcopy(llama)
    model.set_routing_mode(mode)
    routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
    assert len(routers) == (2 if mode == "token_top1" else 1)
    batch = token_batch()
    labels = batch["input_ids"].clone()
    labels[:, :3] = -100  # the prompt, which the sample router pools
    outputs = model(**batch, labels=labels)
    assert outputs.aux_loss is not None and outputs.aux_loss > 0
    lm_loss = model.loss_function(logits=outputs.logits, labels=labels, vocab_size=128)
    torch.testing.assert_close(outputs.loss, lm_loss + 0.01 * outputs.aux_loss)
    outputs.loss.backward()
    assert all(router.weight.grad is not None for router in routers)
    with pytest.raises(ValueError, match=r"set_routing_mode\(.task.\)"):
        model.add_expert("extra", init_from="step")
    model.set_routing_mode("task")
    assert not any(isinstance(module, TopKRouter) for module in model.modules())
    assert not any("router" in key for key in model.state_dict())


def test_the_sample_router_keeps_one_route_per_example_while_decoding(llama):
    _, model = copy.deepcopy(llama)
    model.set_routing_mode("sample_top1")
    with torch.no_grad():
        model.model.sample_router.weight.normal_(0, 1.0)  # decisive routes
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["task_ids"].tolist()), with_kwargs=True
    )
    try:
        model.generate(**token_batch(batch_size=4), max_new_tokens=5, do_sample=False)
    finally:
        hook.remove()
    assert len(seen) == 5 and all(ids == seen[0] for ids in seen)


def left_padded_token_batch():
    batch = token_batch(batch_size=4)
    batch["attention_mask"][0, :2] = 0
    return batch


@pytest.mark.parametrize(
    "family, make_inputs",
    [
        ("llama", lambda model: left_padded_token_batch()),
        ("videollm", lambda model: synthetic_video_inputs(model.config)),
        ("glm", lambda model: synthetic_inputs(model.config)),
    ],
)
def test_the_sample_router_decides_on_the_prompt_with_or_without_a_kv_cache(family, make_inputs, request):
    _, model = copy.deepcopy(request.getfixturevalue(family))
    model.set_routing_mode("sample_top1")
    sample_router = model.get_decoder().sample_router
    with torch.no_grad():
        sample_router.weight.normal_(0, 2.0)  # decisive routes, which generated tokens could tip over
    inputs = make_inputs(model)
    decisions = []
    hook = sample_router.register_forward_hook(lambda m, args, output: decisions.append(output[2][:, 0].tolist()))
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    try:
        cached = model.generate(**inputs, **options)
        uncached = model.generate(**inputs, **options, use_cache=False)
        assert len(decisions) == 1 + 5 and all(routes == decisions[0] for routes in decisions)
        beams = dict(max_new_tokens=3, do_sample=False, num_beams=2, num_return_sequences=2)
        assert torch.equal(model.generate(**inputs, **beams, use_cache=False), model.generate(**inputs, **beams))
    finally:
        hook.remove()
    assert torch.equal(uncached.sequences, cached.sequences)
    for uncached_logits, cached_logits in zip(uncached.logits, cached.logits):
        torch.testing.assert_close(uncached_logits, cached_logits, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_trains_only_the_routed_and_shared_experts(llama):
    _, model = copy.deepcopy(llama)
    model.activation_checkpointing_enable()
    model.train()
    batch = token_batch()
    model(**batch, labels=batch["input_ids"], task_ids=routes(2, 2), use_cache=False).loss.backward()
    for _, ffn in model.mote_layers():
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ffn.experts["proc"].parameters())
        assert all(p.grad is not None for p in ffn.shared_expert.parameters())
        others = [p for name, expert in ffn.experts.items() if name != "proc" for p in expert.parameters()]
        assert all(p.grad is None for p in others)


def test_only_the_layers_in_mote_layers_get_experts():
    model = LlamaMoteForCausalLM(LlamaMoteConfig(**TINY_LLAMA_MOTE | dict(mote_layers=[1])))
    assert not isinstance(model.model.layers[0].mlp, MoteFeedForward)
    assert isinstance(model.model.layers[1].mlp, MoteFeedForward)
    assert isinstance(model.model.layers[0], LlamaMoteDecoderLayer)
    assert "model.layers.0.mlp.gate_proj.weight" in model.state_dict()
    assert model.num_parameters_mote(active=False) == 82_240 + 5 * P_FFN_TINY // 2


# --- remote code (spec §9.9) -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, model_class",
    [("tiny-mote", VideoLlmMoteForConditionalGeneration), ("tiny-mote-glm-ocr", GlmOcrMoteForConditionalGeneration)],
)
def test_the_vision_language_models_load_with_auto_model_for_multimodal_lm(preset, model_class, tmp_path):
    create_from_preset(preset, tmp_path / "created")
    # `import moezoo` registered the class; an exported folder names it in its auto_map, for trust_remote_code.
    assert type(AutoModelForMultimodalLM.from_pretrained(tmp_path / "created")) is model_class
    export_folder(tmp_path / "created", tmp_path / "exported")
    auto_map = json.loads((tmp_path / "exported" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForMultimodalLM"] == auto_map["AutoModelForImageTextToText"]


@pytest.mark.parametrize("preset", ["tiny-mote-llama", "tiny-mote", "tiny-mote-glm-ocr"])
def test_every_load_in_the_exported_model_card_trusts_remote_code(preset, tmp_path):
    # Without trust_remote_code, loading a folder whose config needs remote code asks "run custom code?" in a terminal.
    create_from_preset(preset, tmp_path / "created")
    export_folder(tmp_path / "created", tmp_path / "exported", repo_id="zoo/tiny")
    usage = re.search(r"```python\n(.*?)```", (tmp_path / "exported" / "README.md").read_text(), re.DOTALL).group(1)
    loads = re.findall(r"from_pretrained\(([^)]*)\)", usage)
    assert loads and all("trust_remote_code=True" in arguments for arguments in loads), loads


@pytest.mark.parametrize("construction,claim", [
    (None, "every route reproduces the base model"),  # folders converted before the construction was recorded
    ("copy", "every route reproduces the base model"),
    ("copy_half", "each weighted 0.5, so every route reproduces the base model"),
    ("split", "no single route equals it"),
    ("paper_literal", "every route computes twice the dense network's output"),
])
def test_the_card_says_what_the_construction_gives_right_after_conversion(construction, claim):
    from moezoo.hub.cards import render_model_card
    from moezoo.registry import get_architecture

    provenance = {"source": "meta-llama/Llama-3.2-1B-Instruct", "converter": "llama-to-mote", "max_abs_diff": 0.0}
    if construction:
        provenance["construction"] = construction
    parameters = {"total": 1000, "active": 600}
    card = render_model_card(get_architecture("llama_mote"), provenance, parameters, repo_id="zoo/tiny")
    provenance_section = " ".join(card.text.split("## Provenance")[1].split())
    assert claim in provenance_section
    assert f"construction `{construction or 'copy'}`" in provenance_section


def test_flattened_code_saves_and_loads_with_trust_remote_code_without_moezoo(tmp_path):
    families = ["llama", "glm_ocr", "video_llm"]
    flatten_modules(["moezoo.configuration.mote", *(f"moezoo.modeling.mote.{family}" for family in families)],
                    tmp_path / "mote_hub")
    (tmp_path / "mote_hub" / "__init__.py").write_text("")
    models = {
        "llama": ("LlamaMoteConfig", "LlamaMoteForCausalLM", "TINY_LLAMA_MOTE", "AutoModelForCausalLM"),
        "glm_ocr": ("GlmOcrMoteConfig", "GlmOcrMoteForConditionalGeneration", "TINY_GLM_OCR_MOTE",
                    "AutoModelForImageTextToText"),
        "video_llm": ("VideoLlmMoteConfig", "VideoLlmMoteForConditionalGeneration", "TINY_VIDEOLLM_MOTE",
                      "AutoModelForImageTextToText"),
    }
    # Saved from the flat package, loaded through transformers' remote code (which imports the copies in the saved
    # folder, not the package), with moezoo unimportable throughout.
    run_python(f"""
        import importlib, sys, torch, transformers
        from safetensors.torch import load_file
        sys.path.insert(0, {str(tmp_path)!r})
        from mote_hub import configuration_mote
        for name, (config_name, model_name, fields, auto) in {models!r}.items():
            path = {str(tmp_path)!r} + "/" + name
            modeling = importlib.import_module("mote_hub.modeling_mote_" + name)
            config_class, model_class = getattr(configuration_mote, config_name), getattr(modeling, model_name)
            config_class.register_for_auto_class()
            model_class.register_for_auto_class(auto)
            torch.manual_seed(0)
            config = config_class(**getattr(configuration_mote, fields))
            config.get_text_config().mote_default_route = config.get_text_config().mote_expert_names[-1]
            model_class(config).save_pretrained(path)

            model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
            assert type(model).__name__ == model_name and type(model) is not model_class, type(model)
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            saved, state = load_file(path + "/model.safetensors"), model.state_dict()
            assert all(torch.equal(saved[key], state[key]) for key in saved), name
            input_ids = torch.randint(3, 99, (2, 5))
            with torch.no_grad():
                default = model(input_ids=input_ids).logits
                last = len(model.config.get_text_config().mote_expert_names) - 1
                assert torch.equal(default, model(input_ids=input_ids, task_ids=torch.tensor([last, last])).logits)
            model.add_expert("extra", init_from="shared")
            assert model.route_id("extra") == last + 1
    """, without_moezoo=True)
