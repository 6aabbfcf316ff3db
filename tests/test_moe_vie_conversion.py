"""MoE-ViE conversions: official OpenCLIP checkpoints (exact, spec moe_vie.md §6.1) against an independent reference
forward, and SigLIP / SigLIP2 upcycling (exact at initialisation, §6.2) against transformers' own models."""

import datetime
import json

import pytest
import torch
from transformers import (
    CLIPConfig,
    CLIPModel,
    Siglip2Config,
    Siglip2ForImageClassification,
    Siglip2Model,
    SiglipConfig,
    SiglipModel,
)

from moe_vie_reference import (
    TINY_DIMS,
    make_official_state_dict,
    official_model_config,
    patchify,
    reference_image_embeds,
    reference_logits_per_image,
    reference_text_embeds,
    reference_video_embeds,
)
from moezoo.configuration.moe_vie import OFFICIAL_MOE_VIE_CONFIGS, MoeVieConfig
from moezoo.conversion import moe_vie_official, moe_vie_upcycle
from moezoo.conversion.moe_vie_official import convert_official_checkpoint, infer_official_config
from moezoo.conversion.moe_vie_upcycle import upcycle_siglip_checkpoint
from moezoo.modeling.moe.router import TopKRouter
from moezoo.processors.build import make_moe_vie_processor
from moezoo.processors.tiny_tokenizers import build_tiny_clip_tokenizer


# --- official checkpoints ---------------------------------------------------------------------------------------


def save_checkpoint(folder, state_dict, model_config=None, name="MoEViE-tiny.pt", wrap=True):
    """As the official release stores it: a DDP-prefixed state dict inside a training checkpoint."""
    folder.mkdir(exist_ok=True)
    contents = {f"module.{key}": value for key, value in state_dict.items()}
    if wrap:
        contents = {"epoch": 32, "name": "moe_vie", "state_dict": contents}
    torch.save(contents, folder / name)
    if model_config is not None:
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_config}))
    return folder


@pytest.fixture(scope="module")
def official():
    return make_official_state_dict(seed=1)


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    folder = save_checkpoint(tmp_path_factory.mktemp("official"), official, official_model_config())
    return convert_official_checkpoint(folder)


def caption_ids(lengths, total=16, seed=0):
    """sot (97), tokens, eot (98, the largest id as in CLIP's BPE), then padding 0."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, length in enumerate(lengths):
        input_ids[i, :length] = torch.randint(1, 97, (length,), generator=generator)
        input_ids[i, 0], input_ids[i, length - 1] = 97, 98
    return input_ids


def test_converted_checkpoint_equals_the_reference_forward(official, converted):
    model, report = converted
    images = torch.randn(3, 3, 12, 20, generator=torch.Generator().manual_seed(0))  # 3 x 5 patches: not square
    input_ids = caption_ids([4, 16, 9])
    inputs = {"pixel_values": patchify(images, 4), "spatial_shapes": torch.tensor([[3, 5]] * 3)}
    with torch.no_grad():
        image_embeds = model.get_image_features(**inputs).pooler_output
        text_embeds = model.get_text_features(input_ids).pooler_output
        logits = model(input_ids=input_ids, **inputs).logits_per_image
        expected_images = reference_image_embeds(official, images)
        expected_texts = reference_text_embeds(official, input_ids)
    assert (image_embeds - expected_images).abs().max() <= 1e-5
    assert (text_embeds - expected_texts).abs().max() <= 1e-5
    assert (logits - reference_logits_per_image(official, expected_images, expected_texts)).abs().max() <= 1e-4
    assert expected_images.abs().mean() > 0.1  # a meaningful comparison, not of near-zero outputs


def test_converted_videos_equal_the_reference_frame_average(official, converted):
    model, _ = converted
    generator = torch.Generator().manual_seed(1)
    videos = [torch.randn(4, 3, 16, 16, generator=generator), torch.randn(2, 3, 16, 16, generator=generator)]
    pixel_values_videos = torch.zeros(2, 4, 16, 48)
    for i, frames in enumerate(videos):
        pixel_values_videos[i, : len(frames)] = patchify(frames, 4)
    with torch.no_grad():
        video = model.get_video_features(
            pixel_values_videos, video_spatial_shapes=torch.tensor([[4, 4], [4, 4]]),
            padding_mask_videos=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        )
        expected = reference_video_embeds(official, videos)
    assert (video.pooler_output - expected).abs().max() <= 1e-5


def test_report_accounts_for_every_official_tensor(official, converted):
    model, report = converted
    accounting = report["key_accounting"]
    assert accounting["source_tensors"] == len(official)
    assert accounting["unexpected"] == []
    assert sorted(accounting["dropped_after_check"]) == sorted(k for k in official if k.endswith("rope.freqs"))
    assert accounting["converted"] + len(accounting["dropped_after_check"]) == len(official)
    assert report["license"] == "cc-by-nc-4.0" and report["config_origin"] == "open_clip_config"
    assert report["parameters"]["vision_active"] < report["parameters"]["vision_total"]
    assert all(router.e_score_correction_bias.dtype == torch.float32
               for router in model.modules() if isinstance(router, TopKRouter))


def test_bare_file_with_its_model_config_beside_and_bf16_conversion(official, tmp_path):
    folder = save_checkpoint(tmp_path / "bare", official, wrap=False)
    (folder / "MoEViE-tiny.json").write_text(json.dumps(official_model_config()))  # as in open_clip/model_configs
    model, report = convert_official_checkpoint(folder / "MoEViE-tiny.pt", dtype=torch.bfloat16)
    assert report["open_clip_config"] == str(folder / "MoEViE-tiny.json")
    assert model.visual_projection.weight.dtype == torch.bfloat16
    router = model.vision_model.encoder.layers[1].mlp.gate
    assert torch.equal(router.e_score_correction_bias, official["visual.transformer.resblocks.1.mlp.moe.expert_bias"])


def test_unexpected_tensors_are_reported_not_converted(official, tmp_path):
    extra = official | {"visual.some_training_buffer": torch.zeros(3)}
    _, report = convert_official_checkpoint(save_checkpoint(tmp_path, extra, official_model_config()))
    assert report["key_accounting"]["unexpected"] == ["visual.some_training_buffer"]


@pytest.mark.parametrize("name,dims", [
    ("MoEViE-B16-224", dict(width=768, layers=12, heads=12, patch=16, mlp=2048, expert_mlp=512, routed=31,
                            moe_layers=list(range(1, 12)), pool_heads=8, pool_mlp=3072, embed_dim=1024, image_size=224,
                            text_width=1024, text_layers=24, text_heads=16, text_mlp=2730, vocab=49408, context=144)),
    ("MoEViE-L16-384", dict(width=1024, layers=24, heads=16, patch=16, mlp=2736, expert_mlp=684, routed=31,
                            moe_layers=list(range(1, 24)), pool_heads=8, pool_mlp=4096, embed_dim=1024, image_size=384,
                            text_width=1024, text_layers=24, text_heads=16, text_mlp=2736, vocab=49408, context=144)),
    ("MoEViE-H14-448", dict(width=1280, layers=32, heads=16, patch=14, mlp=3413, expert_mlp=854, routed=31, coarse_k=2,
                            moe_layers=list(range(1, 32)), pool_heads=16, pool_mlp=5120, embed_dim=1024, image_size=448,
                            text_width=1408, text_layers=34, text_heads=16, text_mlp=3754, vocab=49408, context=144)),
])
def test_released_configurations_are_recognised_from_shapes_alone(name, dims):
    dims = TINY_DIMS | dims
    state_dict = make_official_state_dict(dims, meta=True)
    config, origin = infer_official_config(state_dict)
    expected = MoeVieConfig(**OFFICIAL_MOE_VIE_CONFIGS[name])
    assert origin == name
    assert config.to_dict() == expected.to_dict()
    # the official model config gives the same result
    config, origin = infer_official_config(state_dict, official_model_config(dims))
    assert origin == name and config.to_dict() == expected.to_dict()


@pytest.mark.parametrize("corrupt,message", [
    (lambda sd: sd.pop("visual.transformer.resblocks.2.mlp.moe.w2"), "missing tensors: visual.transformer.resblocks.2"),
    (lambda sd: sd.update({"visual.transformer.resblocks.2.mlp.moe.w1": torch.zeros(7, 30, 32)}),
     r"resblocks.2.mlp.moe.w1: \(7, 30, 32\), expected \(7, 32, 32\)"),
    (lambda sd: sd.update({"transformer.resblocks.1.mlp.mlp.up_proj.weight": torch.zeros(40, 32)}),
     r"transformer.resblocks.1.mlp.mlp.up_proj.weight: \(40, 32\), expected \(48, 32\)"),
    (lambda sd: sd.update({"visual.transformer.resblocks.1.attn.attn.rope.freqs": torch.tensor([1.0, 0.1])}),
     "rope.freqs"),
    (lambda sd: sd.update({"visual.ln_post.weight": torch.ones(32), "visual.ln_post.bias": torch.zeros(32)}),
     "final LayerNorm"),
])
def test_inconsistent_checkpoints_fail_with_the_reason(official, tmp_path, corrupt, message):
    state_dict = dict(official)
    corrupt(state_dict)
    with pytest.raises(ValueError, match=message):
        convert_official_checkpoint(save_checkpoint(tmp_path, state_dict, official_model_config()))


@pytest.mark.parametrize("section,key,value", [
    (None, "embed_dim", 32), ("vision_cfg", "width", 64), ("vision_cfg", "moe_layers", [2]),
    ("text_cfg", "context_length", 77), ("vision_cfg", "num_of_expert", 4),
])
def test_a_config_that_contradicts_the_tensors_fails(official, section, key, value):
    model_config = official_model_config()
    (model_config if section is None else model_config[section])[key] = value
    with pytest.raises(ValueError, match=f"{key}.*do not belong together"):
        infer_official_config(official, model_config)


def test_unknown_shapes_need_the_official_config(official, tmp_path):
    with pytest.raises(ValueError, match="match none of the released MoE-ViE configurations"):
        convert_official_checkpoint(save_checkpoint(tmp_path, official))
    incomplete = official_model_config()
    del incomplete["vision_cfg"]["k"]
    with pytest.raises(ValueError, match="lacks vision_cfg.k"):
        infer_official_config(official, incomplete)


def test_other_architectures_are_rejected(tmp_path):
    """A dense OpenCLIP ViT-B/32-like state dict: class token, absolute positions, GELU MLPs."""
    dense = {
        "visual.conv1.weight": torch.zeros(32, 3, 4, 4), "visual.class_embedding": torch.zeros(32),
        "visual.positional_embedding": torch.zeros(17, 32), "token_embedding.weight": torch.zeros(99, 32),
        "visual.transformer.resblocks.0.mlp.c_fc.weight": torch.zeros(128, 32),
    }
    with pytest.raises(ValueError, match="not a MoE-ViE checkpoint.*dense OpenCLIP ViT"):
        convert_official_checkpoint(save_checkpoint(tmp_path, dense))
    with pytest.raises(ValueError, match="not an OpenCLIP image-text checkpoint"):
        convert_official_checkpoint(save_checkpoint(tmp_path, {"encoder.weight": torch.zeros(2)}))


def test_unreadable_files_fail_clearly(official, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.pt").write_bytes(b"\x80\x04 not a checkpoint at all")
    with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        convert_official_checkpoint(corrupt)
    truncated = save_checkpoint(tmp_path / "truncated", official)
    data = (truncated / "MoEViE-tiny.pt").read_bytes()
    (truncated / "MoEViE-tiny.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        convert_official_checkpoint(truncated)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"state_dict": official, "saved_on": datetime.date(2026, 1, 1)}, pickled / "model.pt")
    with pytest.raises(ValueError, match="weights_only"):  # arbitrary objects are never unpickled
        convert_official_checkpoint(pickled, official_model_config())
    two = save_checkpoint(tmp_path / "two", official)
    save_checkpoint(two, official, name="other.pt")
    with pytest.raises(ValueError, match="exactly one official checkpoint"):
        convert_official_checkpoint(two)


def test_the_official_converter_refuses_a_tokenizer_that_is_not_the_models(official, tmp_path):
    """transformers returns an empty tokenizer instead of raising when the files cannot be found (offline, or a
    mistyped --tokenizer); saved next to the model it would turn every text into end-of-text tokens."""
    source = save_checkpoint(tmp_path / "official", official, official_model_config())
    (tmp_path / "typo").mkdir()  # no tokenizer files in it
    with pytest.raises(FileNotFoundError, match=r"vocabulary of \d+ tokens but the text tower has 99 .*--tokenizer"):
        moe_vie_official.convert(source, tokenizer=str(tmp_path / "typo"))
    build_tiny_clip_tokenizer().save_pretrained(tmp_path / "tokenizer")
    assert len(moe_vie_official.convert(source, tokenizer=str(tmp_path / "tokenizer")).processor.tokenizer) == 99


@pytest.mark.parametrize("text_config,message", [
    (dict(vocab_size=128, bos_token_id=97, eos_token_id=98), "vocabulary of 99 tokens but the text tower has 128"),
    (dict(vocab_size=99, bos_token_id=97, eos_token_id=96), "ends texts with token 98 .* pools at eos_token_id=96"),
])
def test_a_processor_is_never_built_with_a_tokenizer_that_does_not_fit_the_text_tower(text_config, message):
    with pytest.raises(FileNotFoundError, match=message):
        make_moe_vie_processor(MoeVieConfig(text_config=text_config), tokenizer=build_tiny_clip_tokenizer())


# --- upcycling SigLIP / SigLIP2 ----------------------------------------------------------------------------------

# The tiny SigLIP2 of spec §5.3 (3 vision blocks, so that two are upcycled).
TINY_SIGLIP_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=16, projection_size=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
TINY_SIGLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_channels=3, patch_size=4)


def perturbed(model, seed=0):
    """transformers initialises biases and logit_scale/logit_bias to 0: perturb everything so that each is tested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def siglip2():
    torch.manual_seed(0)
    config = Siglip2Config(text_config=TINY_SIGLIP_TEXT, vision_config=TINY_SIGLIP_VISION | {"num_patches": 16})
    return perturbed(Siglip2Model(config))


@pytest.fixture(scope="module")
def siglip():
    torch.manual_seed(0)
    config = SiglipConfig(text_config=TINY_SIGLIP_TEXT, vision_config=TINY_SIGLIP_VISION | {"image_size": 16})
    return perturbed(SiglipModel(config), seed=1)


def naflex_inputs():
    """Two images, 4 x 4 and 3 x 5 patches (the second padded), and two texts."""
    generator = torch.Generator().manual_seed(2)
    spatial_shapes = torch.tensor([[4, 4], [3, 5]])
    mask = (torch.arange(16)[None] < spatial_shapes.prod(-1, keepdim=True)).long()
    return {
        "pixel_values": torch.randn(2, 16, 48, generator=generator) * mask[..., None],
        "pixel_attention_mask": mask,
        "spatial_shapes": spatial_shapes,
        "input_ids": torch.randint(0, 128, (2, 16), generator=generator),
    }


def assert_same_outputs(got, expected, tolerance=1e-5):
    for name in ("image_embeds", "text_embeds", "logits_per_image", "loss"):
        assert (getattr(got, name) - getattr(expected, name)).abs().max() <= tolerance, name


@pytest.mark.parametrize("options", [
    dict(),  # c = 4, 1 shared + 31 routed, top-3: the MoE-ViE-B/L layout
    dict(num_experts=32, granularity=4, top_k=7),  # H's top-7: 4 null experts
    dict(num_experts=16, granularity=2, top_k=1),
    dict(num_experts=32, granularity=8, top_k=7),
    dict(num_experts=8, granularity=4, top_k=4, n_shared_experts=0),  # b2 rides on a routed expert
])
def test_upcycled_siglip2_equals_siglip2(siglip2, options):
    model, report = upcycle_siglip_checkpoint(siglip2, **options)
    inputs = naflex_inputs()
    with torch.no_grad():
        expected = siglip2(**inputs, return_loss=True)
        got = model(**inputs, return_loss=True, output_router_logits=True)
    assert_same_outputs(got, expected)
    assert report["max_abs_diff"] <= 1e-5
    # every valid patch is routed to exactly the designated (and null) experts
    top_k = options.get("top_k", 3)
    for logits in got.router_logits:
        assert logits.shape[0] == 16 + 15
        assert torch.equal(logits, torch.zeros_like(logits))
    router = model.vision_model.encoder.layers[1].mlp.gate
    assert torch.equal(router.e_score_correction_bias[:top_k], torch.ones(top_k))
    assert report["key_accounting"]["unexpected"] == []
    assert report["key_accounting"]["upcycled_into_experts"] == 4 * 2  # fc1/fc2 weight and bias of blocks 1 and 2


def test_upcycled_fixres_siglip_equals_siglip(siglip):
    model, report = upcycle_siglip_checkpoint(siglip)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = siglip(input_ids=input_ids, pixel_values=images, return_loss=True)
        got = model(input_ids=input_ids, pixel_values=patchify(images, 4), spatial_shapes=torch.tensor([[4, 4]] * 2),
                    return_loss=True)
    assert_same_outputs(got, expected)
    assert report["source_model_type"] == "siglip" and report["max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "moezoo"])
def test_upcycled_model_is_exact_with_every_experts_implementation(siglip2, implementation):
    model, _ = upcycle_siglip_checkpoint(siglip2, verify=False)
    model.set_experts_implementation(implementation)
    inputs = naflex_inputs()
    with torch.no_grad():
        assert_same_outputs(model(**inputs, return_loss=True), siglip2(**inputs, return_loss=True))


def test_noisy_upcycling_is_close_and_reproducible(siglip2):
    model, report = upcycle_siglip_checkpoint(siglip2, mode="noisy", router_std=1e-2, seed=3)
    again, _ = upcycle_siglip_checkpoint(siglip2, mode="noisy", router_std=1e-2, seed=3, verify=False)
    router = model.vision_model.encoder.layers[1].mlp.gate.weight
    assert torch.equal(router, again.vision_model.encoder.layers[1].mlp.gate.weight)
    assert 0.005 < router.std() < 0.02
    assert 1e-7 < report["max_abs_diff"] < 0.05  # no longer exact, still close


def test_upcycling_a_saved_folder(siglip2, tmp_path):
    siglip2.save_pretrained(tmp_path)
    model, report = upcycle_siglip_checkpoint(tmp_path, num_experts=16, top_k=3)
    assert report["source"] == str(tmp_path) and report["max_abs_diff"] <= 1e-5
    assert model.config.vision_config.n_routed_experts == 15 and model.config.loss_type == "sigmoid"
    # the folder has no tokenizer files: transformers' empty stand-in must not be taken for the source's tokenizer
    with pytest.raises(FileNotFoundError, match=r"vocabulary of \d+ tokens but the text tower has 128 .*--tokenizer"):
        moe_vie_upcycle.convert(tmp_path, num_experts=16, top_k=3)


@pytest.mark.parametrize("options,message", [
    (dict(granularity=3), r"--granularity 3 \(granularity=3\) does not divide"),
    (dict(granularity=4, n_shared_experts=4), "n_shared_experts=4"),
    (dict(top_k=2), "top_k=2"),
    (dict(num_experts=4, top_k=4), "top_k=4"),
    (dict(mode="random"), "mode='random'"),
    (dict(router_bias=0.0), "router_bias"),
    (dict(moe_layers=[5]), "moe_layers"),
])
def test_invalid_upcycling_options_name_the_option(siglip2, options, message):
    with pytest.raises(ValueError, match=message):
        upcycle_siglip_checkpoint(siglip2, **options, verify=False)


def test_only_siglip_dual_encoders_are_upcycled(siglip2):
    clip = CLIPModel(CLIPConfig(text_config=dict(TINY_SIGLIP_TEXT, projection_dim=32),
                                vision_config=dict(TINY_SIGLIP_VISION, image_size=16)))
    with pytest.raises(ValueError, match="cannot upcycle a 'clip' model"):
        upcycle_siglip_checkpoint(clip)
    with pytest.raises(ValueError, match="cannot upcycle a 'siglip2_vision_model' model"):
        upcycle_siglip_checkpoint(siglip2.vision_model)
    with pytest.raises(ValueError, match="not a dual encoder"):
        upcycle_siglip_checkpoint(Siglip2ForImageClassification(siglip2.config))
