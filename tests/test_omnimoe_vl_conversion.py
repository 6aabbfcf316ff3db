"""Qwen3 + SigLIP / SigLIP2 -> OmniMoE-VL: the invariants C1-C5 of spec omnimoe_vl.md §5.3 against transformers' own
`Qwen3ForCausalLM`, `SiglipVisionModel` and `Siglip2VisionModel` (tiny, random weights, random norms, fixed seeds),
and the errors bad sources raise before anything is written."""

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipConfig,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
    Siglip2VisionConfig,
    Siglip2VisionModel,
)

from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.conversion.omnimoe_vl_upcycle import add_arguments, convert, convert_omnimoe_vl_checkpoints, naflex_patches
from moezoo.modeling.moe.accounting import count_parameters
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration


TAPS = TINY_OMNIMOE_VL["vision_feature_layers"]
TOKENS = {name: TINY_OMNIMOE_VL[name] for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
PROJECTOR = {
    key: value for key, value in TINY_OMNIMOE_VL.items()
    if key not in {"vision_config", "text_config", "vision_feature_layers", "injection_layers", *TOKENS}
}
QWEN3 = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, patch_size=16)
IMPLEMENTATIONS = ["eager", "grouped_mm", "batched_mm", "moezoo"]


def randomize_norms(model, seed: int):
    """Norm weights start at 1 (and biases at 0): random ones make every comparison stricter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def converted_model(text, vision, folder, **options) -> OmniMoeVlForConditionalGeneration:
    convert_omnimoe_vl_checkpoints(text, vision, folder, vision_feature_layers=TAPS, projector=PROJECTOR,
                                   **TOKENS, **options)
    return OmniMoeVlForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    randomize_norms(Qwen3ForCausalLM(Qwen3Config(**QWEN3)), 1).eval().save_pretrained(root / "qwen3")
    randomize_norms(SiglipVisionModel(SiglipVisionConfig(**VISION, image_size=64)), 2).save_pretrained(root / "siglip")
    siglip2 = Siglip2VisionModel(Siglip2VisionConfig(**VISION, num_patches=16))
    randomize_norms(siglip2, 3).save_pretrained(root / "siglip2")
    return root


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    return converted_model(sources / "qwen3", sources / "siglip", tmp_path_factory.mktemp("converted") / "out")


@pytest.fixture(scope="module")
def qwen3(sources):
    return Qwen3ForCausalLM.from_pretrained(sources / "qwen3").eval()


def image_batch(config, seed: int = 0):
    """Two rows, one image each: text, <|vision_start|>, 16 placeholders, <|vision_end|>, a question; left padding."""
    generator = torch.Generator().manual_seed(seed)
    image = [config.vision_start_token_id, *[config.image_token_id] * config.num_image_tokens,
             config.vision_end_token_id]
    rows = [[1, 2] + image + [5, 6, 7, 8], [0, 0, 3] + image + [9, 10, 11]]
    input_ids = torch.tensor(rows)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    pixel_values = torch.randn(2, 3, 64, 64, generator=generator)
    return input_ids, attention_mask, pixel_values


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_c1_text_only_logits_equal_dense_qwen3(converted, qwen3, implementation):
    converted.set_experts_implementation(implementation)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 150, (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, :4] = 0
    with torch.no_grad():
        expected = qwen3(input_ids=input_ids, attention_mask=attention_mask).logits
        got = converted(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    difference = (got[real] - expected[real]).abs().max()
    assert difference <= 1e-5, difference
    assert difference > 0 or implementation != "eager"  # upcycled: w1 y + w2 y, not bitwise y (spec C1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_c2_streams_equal_siglip_hidden_states(converted, sources, implementation):
    converted.set_experts_implementation(implementation)
    siglip = SiglipVisionModel.from_pretrained(sources / "siglip").eval()
    pixel_values = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        streams = converted.model.visual_streams(converted.model.get_image_features(pixel_values))
        expected = siglip(pixel_values=pixel_values, output_hidden_states=True).hidden_states
    assert streams.shape == (2, len(TAPS), 16, 32)
    difference = (streams - torch.stack([expected[index] for index in TAPS], dim=1)).abs().max()
    assert difference <= 1e-5, difference


def test_c2_naflex_siglip2_source(sources, tmp_path):
    model = converted_model(sources / "qwen3", sources / "siglip2", tmp_path / "out")
    assert model.config.vision_config.image_size == 64  # the 4 x 4 position grid at patch 16
    siglip2 = Siglip2VisionModel.from_pretrained(sources / "siglip2").eval()
    pixel_values = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    patches, mask, shapes = naflex_patches(pixel_values, 16)
    with torch.no_grad():
        streams = model.model.visual_streams(model.model.get_image_features(pixel_values))
        expected = siglip2(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes,
                           output_hidden_states=True).hidden_states
    # Not bitwise: SigLIP2 resizes its position embeddings even at the native grid (spec §5.1: ~5e-6).
    difference = (streams - torch.stack([expected[index] for index in TAPS], dim=1)).abs().max()
    assert difference <= 2e-5, difference


def test_c3_gate_zero_equals_llava_style_composition(converted, qwen3):
    """The fused tokens Z in place of the image placeholders, fed to the dense source LM: the converted model."""
    converted.set_experts_implementation("eager")
    input_ids, attention_mask, pixel_values = image_batch(converted.config)
    with torch.no_grad():
        output = converted(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
        embeds = qwen3.get_input_embeddings()(input_ids)
        mask = (input_ids == converted.config.image_token_id)[..., None]
        embeds = embeds.masked_scatter(mask, output.image_hidden_states)
        expected = qwen3(inputs_embeds=embeds, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert torch.all(converted.model.projector.injection.gate == 0)
    difference = (output.logits[real] - expected[real]).abs().max()
    assert difference <= 1e-5, difference


def test_c3b_gate_zero_is_bitwise_no_injection(converted, tmp_path):
    converted.save_pretrained(tmp_path)
    without = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path, injection_type="none").eval()
    for model in (converted, without):  # the same experts kernels on both sides
        model.set_experts_implementation("eager")
    input_ids, attention_mask, pixel_values = image_batch(converted.config)
    with torch.no_grad():
        got = converted(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
        expected = without(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
    assert torch.equal(got, expected)


def test_c4_save_and_load_is_bitwise(converted, tmp_path):
    converted.save_pretrained(tmp_path / "first")
    model = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "first").eval()
    with torch.no_grad():  # exploration state, which must survive the round trip too
        model.model.projector.depth_router.depth_usage_ema.copy_(torch.tensor([1.5, 0.25, 3.0]))
        model.model.projector.depth_router.routing_step.fill_(7)
    model.save_pretrained(tmp_path / "second")
    reloaded = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "second").eval()
    assert set(reloaded.state_dict()) == set(model.state_dict())
    assert all(torch.equal(value, reloaded.state_dict()[key]) for key, value in model.state_dict().items())
    input_ids, attention_mask, pixel_values = image_batch(model.config)
    with torch.no_grad():
        first = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
        second = reloaded(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits
    assert torch.equal(first, second)


def closed_form_parameters(config: OmniMoeVlConfig) -> tuple[int, int]:
    """Total and active parameters from the config alone (active: routed experts count k / E; spec §4.3)."""
    vision, text = config.vision_config, config.text_config
    d_v, i_v, patch = vision.hidden_size, vision.intermediate_size, vision.patch_size
    vision_moe = len(vision.moe_layers)
    vision_total = (d_v * vision.num_channels * patch * patch + d_v + vision.num_patches * d_v
                    + vision.num_hidden_layers * (4 * d_v + 4 * (d_v * d_v + d_v))
                    + (vision.num_hidden_layers - vision_moe) * (2 * d_v * i_v + i_v + d_v)
                    + vision_moe * vision.num_experts * (2 * d_v * i_v + i_v + d_v + d_v))
    vision_expert = 2 * d_v * i_v + i_v + d_v
    h, i, heads, kv, hd, vocab = (text.hidden_size, text.intermediate_size, text.num_attention_heads,
                                  text.num_key_value_heads, text.head_dim, text.vocab_size)
    text_moe = sum(text.is_moe_layer(layer) for layer in range(text.num_hidden_layers))
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + 2 * h
    text_total = (2 * vocab * h + h + text.num_hidden_layers * attention
                  + (text.num_hidden_layers - text_moe) * 3 * h * i
                  + text_moe * text.num_experts * (3 * h * text.moe_intermediate_size + h))
    text_expert = 3 * h * text.moe_intermediate_size
    s, q, r, d_a, h_f = (config.num_streams, config.num_query_prototypes, config.num_router_queries,
                         config.projector_attn_dim, config.depth_score_hidden)
    rank, adapter, attn = config.injection_rank, config.adapter_rank, 4 * h * d_a
    projector = (s * (2 * d_v + d_v * h + h + h * h + h)  # stream projections
                 + 2 * h + h + q * h + attn + 2 * h + h + h * h + q + r * q  # query synthesis
                 + s * attn + s * (h * h_f + h_f + h_f + 1)  # depth attention and scores
                 + 2 * h + 1  # fusion norm and output scale
                 + rank * h + attn + 2 * h + s * rank * h + attn + 2 * h + 2 * s * adapter * h + s + 2 * s)  # injection
    total = vision_total + text_total + projector
    inactive = (vision_moe * (vision.num_experts - vision.num_experts_per_tok) * vision_expert
                + text_moe * (text.num_experts - text.num_experts_per_tok) * text_expert)
    return total, total - inactive


@pytest.mark.parametrize("name", ["tiny", "paper"])
def test_c5_parameter_count_equals_closed_form(name):
    config = OmniMoeVlConfig(**TINY_OMNIMOE_VL) if name == "tiny" else OmniMoeVlConfig()
    with torch.device("meta"):
        model = OmniMoeVlForConditionalGeneration(config)
    counts = count_parameters(model)
    assert (counts.total, counts.active) == closed_form_parameters(config)
    if name == "paper":  # spec §4.3: the literal reading, not the paper's "28B total / 9B active"
        assert 31.0e9 < counts.total < 32.0e9 and 12.0e9 < counts.active < 13.2e9, counts


def test_convert_command_measures_the_sources(sources):
    result = convert(sources / "qwen3", vision=sources / "siglip", vision_feature_layers=TAPS, projector=PROJECTOR,
                     **TOKENS)
    provenance = result.provenance
    assert provenance["max_abs_diff"] <= 1e-5
    accounting = provenance["key_accounting"]
    # 6 Qwen3 layers (3 MoE) + 6 SigLIP blocks: every source tensor is copied, upcycled or dropped with a reason.
    assert accounting["source_tensors"] == accounting["copied"] + accounting["upcycled_into_experts"] + sum(
        item["tensors"] for item in accounting["dropped"].values())
    assert set(accounting["dropped"]) == {"pooling head", "post-layernorm", "vision blocks after the last tap"}


def test_full_siglip_checkpoint_drops_the_text_tower(sources, tmp_path):
    torch.manual_seed(4)
    vision = dict(VISION, image_size=64)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    full = SiglipModel(SiglipConfig(vision_config=vision, text_config=text))
    full.save_pretrained(tmp_path / "siglip_full")
    report = convert_omnimoe_vl_checkpoints(sources / "qwen3", tmp_path / "siglip_full", tmp_path / "out",
                                            vision_feature_layers=TAPS, projector=PROJECTOR, **TOKENS)
    assert report["key_accounting"]["dropped"]["text tower"]["tensors"] > 0
    model = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    pixel_values = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        streams = model.model.visual_streams(model.model.get_image_features(pixel_values))
        expected = full.vision_model(pixel_values=pixel_values, output_hidden_states=True).hidden_states
    assert (streams - torch.stack([expected[index] for index in TAPS], dim=1)).abs().max() <= 1e-5


def test_sharded_output_loads_equal(sources, converted, tmp_path):
    model = converted_model(sources / "qwen3", sources / "siglip", tmp_path / "out", max_shard_size=200_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert all(torch.equal(value, converted.state_dict()[key]) for key, value in model.state_dict().items())


def test_new_parameters_follow_spec_initialisation(converted):
    projector = converted.model.projector
    embed = converted.get_input_embeddings().weight
    assert torch.allclose(projector.fusion_output_scale, embed.square().mean(-1).sqrt().mean())
    assert torch.all(projector.injection.gate == 0) and torch.all(projector.injection.type_gain == 1)
    assert torch.all(projector.depth_router.depth_usage_ema == 0) and int(projector.depth_router.routing_step) == 0
    routers = [layer.mlp.gate.weight for layer in converted.model.language_model.layers if hasattr(layer.mlp, "gate")]
    assert len(routers) == 3 and all(0.01 < weight.std() < 0.03 for weight in routers)


# --- bad sources: a clear error, and no output folder ----------------------------------------------------------------


def test_already_moe_language_source_is_refused(sources, tmp_path):
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3, num_experts=4, num_experts_per_tok=2)).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match="already a mixture of experts"):
        convert_omnimoe_vl_checkpoints(tmp_path / "moe", sources / "siglip", tmp_path / "out",
                                       vision_feature_layers=TAPS, projector=PROJECTOR, **TOKENS)
    assert not (tmp_path / "out").exists()


def test_other_family_is_refused(sources, tmp_path):
    with pytest.raises(ValueError, match="SigLIP or SigLIP2 vision tower"):
        convert_omnimoe_vl_checkpoints(sources / "qwen3", sources / "qwen3", tmp_path / "out",
                                       vision_feature_layers=TAPS, projector=PROJECTOR, **TOKENS)
    with pytest.raises(ValueError, match="dense Qwen3"):
        convert_omnimoe_vl_checkpoints(sources / "siglip", sources / "siglip", tmp_path / "out",
                                       vision_feature_layers=TAPS, projector=PROJECTOR, **TOKENS)
    assert not (tmp_path / "out").exists()


def test_taps_beyond_the_tower_are_refused(sources, tmp_path):
    with pytest.raises(ValueError, match=r"--vision-feature-layers .* 1\.\.6"):
        convert_omnimoe_vl_checkpoints(sources / "qwen3", sources / "siglip", tmp_path / "out", projector=PROJECTOR,
                                       **TOKENS)  # the paper's taps 1..37 need a 37-block tower
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named(sources, tmp_path):
    broken = tmp_path / "qwen3"
    broken.mkdir()
    (broken / "config.json").write_text((sources / "qwen3" / "config.json").read_text())
    tensors = load_file(sources / "qwen3" / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.language_model\.layers\.3\.self_attn\.k_norm\.weight"):
        convert_omnimoe_vl_checkpoints(broken, sources / "siglip", tmp_path / "out", vision_feature_layers=TAPS,
                                       projector=PROJECTOR, **TOKENS)
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_is_named(sources, tmp_path):
    broken = tmp_path / "siglip"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(json.loads((sources / "siglip" / "config.json").read_text())))
    tensors = load_file(sources / "siglip" / "model.safetensors")
    tensors["encoder.layers.0.mlp.fc3.weight"] = torch.zeros(2, 2)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no place for: encoder\.layers\.0\.mlp\.fc3\.weight"):
        convert_omnimoe_vl_checkpoints(sources / "qwen3", broken, tmp_path / "out", vision_feature_layers=TAPS,
                                       projector=PROJECTOR, **TOKENS)
    assert not (tmp_path / "out").exists()


def test_command_line_options_reach_the_converter(sources):
    """`moezoo convert --to omnimoe_vl --from QWEN3 --vision SIGLIP ...`: the converter's own options, as the command
    parses them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tokens = [f"--{name.replace('_', '-')}={value}" for name, value in TOKENS.items()]
    projector = [f"--projector={name}={json.dumps(value)}" for name, value in PROJECTOR.items()]
    options = vars(parser.parse_args(
        [f"--vision={sources / 'siglip'}", "--vision-feature-layers=1,3,5", "--no-verify", *tokens, *projector]
    ))
    result = convert(sources / "qwen3", **options)
    assert result.provenance["max_abs_diff"] is None  # --no-verify
    config = result.model.config
    assert config.vision_feature_layers == TAPS and config.image_token_id == TOKENS["image_token_id"]
    assert all(getattr(config, name) == value for name, value in PROJECTOR.items())


def qwen3_with_tokenizer(sources, folder, special_tokens):
    """The Qwen3 source with a 160-token tokenizer holding `special_tokens` (token -> id)."""
    from moezoo.processors.tiny_tokenizers import build_tiny_qwen_tokenizer

    shutil.copytree(sources / "qwen3", folder)
    build_tiny_qwen_tokenizer(QWEN3["vocab_size"], {"<|endoftext|>": 0, **special_tokens}).save_pretrained(folder)
    return folder


def test_vision_token_ids_come_from_the_source_tokenizer(sources, tmp_path):
    """Issue 29: the released Qwen3's ids (151655, ...) do not fit a 160-token source; its own tokenizer's do."""
    ids = {"<|image_pad|>": 150, "<|vision_start|>": 151, "<|vision_end|>": 152}
    text = qwen3_with_tokenizer(sources, tmp_path / "qwen3", ids)
    convert_omnimoe_vl_checkpoints(text, sources / "siglip", tmp_path / "out", vision_feature_layers=TAPS,
                                   projector=PROJECTOR)
    config = OmniMoeVlConfig.from_pretrained(tmp_path / "out")
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (150, 151, 152)


def test_a_vision_token_the_source_tokenizer_lacks_is_named_with_its_option(sources, tmp_path):
    text = qwen3_with_tokenizer(sources, tmp_path / "qwen3", {"<|vision_start|>": 151, "<|vision_end|>": 152})
    with pytest.raises(ValueError, match=r"has no <\|image_pad\|> in its tokenizer.*--image-token-id"):
        convert_omnimoe_vl_checkpoints(text, sources / "siglip", tmp_path / "out", vision_feature_layers=TAPS,
                                       projector=PROJECTOR)
    with pytest.raises(ValueError, match=r"has no tokenizer.*--image-token-id"):
        convert_omnimoe_vl_checkpoints(sources / "qwen3", sources / "siglip", tmp_path / "out",
                                       vision_feature_layers=TAPS, projector=PROJECTOR)
    assert not (tmp_path / "out").exists()


def test_a_bf16_source_is_written_in_bf16_unless_dtype_says_otherwise(sources, tmp_path):
    text = tmp_path / "qwen3-bf16"
    Qwen3ForCausalLM.from_pretrained(sources / "qwen3", dtype=torch.bfloat16).save_pretrained(text)
    for dtype, written in ((None, torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"out-{dtype}"
        convert_omnimoe_vl_checkpoints(text, sources / "siglip", out, vision_feature_layers=TAPS, projector=PROJECTOR,
                                       dtype=dtype, **TOKENS)
        assert {tensor.dtype for tensor in load_file(out / "model.safetensors").values()
                if tensor.is_floating_point()} == {written}  # fmt: skip
        assert json.loads((out / "config.json").read_text())["dtype"] == str(written).removeprefix("torch.")
