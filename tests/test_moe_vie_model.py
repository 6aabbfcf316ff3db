"""MoE-ViE configuration and model: spec moe_vie.md §2, §5, §10 on the tiny configuration of §5.2."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from moezoo.configuration.moe_vie import (
    OFFICIAL_MOE_VIE_CONFIGS,
    TINY_MOE_VIE,
    MoeVieConfig,
    MoeVieTextConfig,
    MoeVieVisionConfig,
)
from moezoo.modeling.moe.accounting import count_parameters
from moezoo.modeling.moe.router import TopKRouter
from moezoo.modeling.moe_vie import MoeVieModel, MoeVieVisionModel, MoeVieVisionRotaryEmbedding


PATCH_DIM = 4 * 4 * 3


def tiny_config(**changes):
    fields = copy.deepcopy(TINY_MOE_VIE)
    for section in ("vision_config", "text_config"):
        fields[section] |= changes.pop(section, {})
    return MoeVieConfig(**fields | changes)


def tiny_model(seed=0, **changes):
    """A tiny model with every weight perturbed (routers and balancing biases included), so that routing is
    neither uniform nor near-tied."""
    torch.manual_seed(seed)
    model = MoeVieModel(tiny_config(**changes))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for router in routers(model):
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=generator) * 0.3)
    return model.eval()


def routers(model):
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def naflex_batch(shapes, seed=0, padding_value=0.0):
    """Random patches for images of the given (rows, cols), padded to the largest with `padding_value`."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes = torch.tensor(shapes)
    max_patches = int(spatial_shapes.prod(-1).max())
    pixel_values = torch.full((len(shapes), max_patches, PATCH_DIM), padding_value)
    mask = torch.zeros(len(shapes), max_patches, dtype=torch.long)
    for i, (rows, cols) in enumerate(shapes):
        pixel_values[i, : rows * cols] = torch.randn(rows * cols, PATCH_DIM, generator=generator)
        mask[i, : rows * cols] = 1
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask, "spatial_shapes": spatial_shapes}


def texts(lengths, total=12, seed=0):
    """bos, random tokens, eos (id 98), then padding 0 up to `total`."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), total, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, length in enumerate(lengths):
        input_ids[i, :length] = torch.randint(1, 97, (length,), generator=generator)
        input_ids[i, 0], input_ids[i, length - 1] = 97, 98
        attention_mask[i, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def batch(seed=0):
    return naflex_batch([(3, 5), (4, 4), (2, 3)], seed) | texts([5, 12, 8], seed=seed)


# --- configuration --------------------------------------------------------------------------------------------------


def test_tiny_config_round_trips_and_describes_the_moe_layer():
    config = tiny_config()
    assert MoeVieConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    spec = config.vision_config.moe_layer_spec()
    assert (spec.router_type, spec.routing_bias, spec.norm_topk_prob) == ("sigmoid", True, True)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.expert_intermediate_size) == (7, 3, 16)
    assert spec.shared_expert_intermediate_size == 16 and spec.bias_update_rate == 1e-2
    assert config.vision_config.expert_granularity == 4
    assert MoeVieVisionConfig(num_hidden_layers=4).moe_layers == [1, 2, 3]  # all blocks but the first


@pytest.mark.parametrize(
    "config_class,changes,field",
    [
        (MoeVieVisionConfig, {"num_experts_per_tok": 32}, "num_experts_per_tok"),
        (MoeVieVisionConfig, {"moe_layers": [1, 12]}, "moe_layers"),
        (MoeVieVisionConfig, {"moe_layers": [1, 1]}, "moe_layers"),
        (MoeVieVisionConfig, {"hidden_size": 64, "num_attention_heads": 32}, "head_dim"),
        (MoeVieVisionConfig, {"num_attention_heads": 7}, "num_attention_heads"),
        (MoeVieVisionConfig, {"mlp_type": "relu"}, "mlp_type"),
        (MoeVieVisionConfig, {"hidden_act": "swishy"}, "hidden_act"),
        (MoeVieVisionConfig, {"position_embedding_type": "sincos"}, "position_embedding_type"),
        (MoeVieVisionConfig, {"position_embedding_type": "learned"}, "num_patches"),
        (MoeVieVisionConfig, {"position_embedding_type": "learned", "num_patches": 15}, "num_patches"),
        (MoeVieVisionConfig, {"expert_bias_update_rate": -1e-3}, "expert_bias_update_rate"),
        (MoeVieVisionConfig, {"expert_bias_update_rule": "adam"}, "expert_bias_update_rule"),
        (MoeVieVisionConfig, {"router_aux_loss_type": "entropy"}, "router_aux_loss_type"),
        (MoeVieVisionConfig, {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
        (MoeVieVisionConfig, {"scoring_func": "softmax"}, "scoring_func"),
        (MoeVieVisionConfig, {"n_shared_experts": -1}, "n_shared_experts"),
        (MoeVieVisionConfig, {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        (MoeVieVisionConfig, {"attention_dropout": 1.5}, "attention_dropout"),
        (MoeVieTextConfig, {"pooling_type": "mean"}, "pooling_type"),
        (MoeVieTextConfig, {"eos_token_id": None}, "eos_token_id"),
        (MoeVieTextConfig, {"num_attention_heads": 5}, "num_attention_heads"),
        (MoeVieTextConfig, {"mlp_type": "moe"}, "mlp_type"),
        (MoeVieConfig, {"loss_type": "hinge"}, "loss_type"),
        (MoeVieConfig, {"projection_dim": 0}, "projection_dim"),
        (MoeVieConfig, {"max_logit_scale": -1.0}, "max_logit_scale"),
        (MoeVieConfig, {"logit_scale_init_value": float("nan")}, "logit_scale_init_value"),
        (MoeVieConfig, {"logit_bias_init_value": float("inf")}, "logit_bias_init_value"),
        # a string such as "false" is truthy: every boolean field must be a bool
        (MoeVieConfig, {"text_projection_bias": "false"}, "text_projection_bias"),
        (MoeVieVisionConfig, {"use_pre_layernorm": "false"}, "use_pre_layernorm"),
        (MoeVieVisionConfig, {"rope_interleaved": "false"}, "rope_interleaved"),
        (MoeVieVisionConfig, {"norm_topk_prob": None}, "norm_topk_prob"),
        (MoeVieTextConfig, {"is_causal": 0}, "is_causal"),
    ],
)
def test_invalid_config_names_the_field(config_class, changes, field):
    with pytest.raises(ValueError, match=field):
        config_class(**changes)


def test_invalid_sub_config_fails_inside_the_dual_config():
    with pytest.raises(ValueError, match="MoeVieVisionConfig.num_experts_per_tok"):
        tiny_config(vision_config={"num_experts_per_tok": 8})


@pytest.mark.parametrize(
    "name,vision_total,vision_active,text_blocks",
    [("MoEViE-B16-224", 0.457e9, 0.094e9, 0.302e9), ("MoEViE-L16-384", 1.671e9, 0.318e9, 0.303e9),
     ("MoEViE-H14-448", 3.499e9, 1.059e9, 0.809e9)],
)
def test_official_configs_have_the_recounted_parameter_counts(name, vision_total, vision_active, text_blocks):
    """Spec §2.5 / §10.5: vision tower with head and projection; text blocks without embeddings."""
    with torch.device("meta"):
        model = MoeVieModel(MoeVieConfig(**OFFICIAL_MOE_VIE_CONFIGS[name]))
    vision = count_parameters(model.vision_model)
    projection = model.visual_projection.weight.numel()
    assert vision.total + projection == pytest.approx(vision_total, rel=5e-3)
    assert vision.active + projection == pytest.approx(vision_active, rel=5e-3)
    assert sum(p.numel() for p in model.text_model.encoder.parameters()) == pytest.approx(text_blocks, rel=5e-3)


# --- 2D RoPE ----------------------------------------------------------------------------------------------------


def test_rope_angles_are_one_based_column_first_and_interleaved():
    config = MoeVieVisionConfig(**TINY_MOE_VIE["vision_config"])  # head_dim 8: frequencies 1 and 1/100
    cos, sin = MoeVieVisionRotaryEmbedding(config)(torch.tensor([[2, 3]]), num_patches=8)
    freqs = [1.0, 0.01]
    for slot in range(6):
        row, col = divmod(slot, 3)
        angles = [(col + 1) * f for f in freqs for _ in (0, 1)] + [(row + 1) * f for f in freqs for _ in (0, 1)]
        assert torch.allclose(cos[0, slot], torch.tensor(angles).cos(), atol=1e-6)
        assert torch.allclose(sin[0, slot], torch.tensor(angles).sin(), atol=1e-6)
    # padding slots are not rotated
    assert torch.equal(cos[0, 6:], torch.ones(2, 8)) and torch.equal(sin[0, 6:], torch.zeros(2, 8))


def test_half_split_rope_on_permuted_heads_equals_interleaved_rope():
    """Spec §6.1: interleaved RoPE == half-split RoPE after permuting each head's q/k rows [0, 2, 4, ..., 1, 3, ...]."""
    interleaved = tiny_model()
    half_split = MoeVieModel(tiny_config(vision_config={"rope_interleaved": False})).eval()
    state = interleaved.state_dict()
    head_dim = 8
    within_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    permutation = torch.cat([head * head_dim + within_head for head in range(4)])
    for key in list(state):
        if key.startswith("vision_model.") and (".q_proj." in key or ".k_proj." in key):
            state[key] = state[key][permutation]
    half_split.load_state_dict(state)
    inputs = batch()
    with torch.no_grad():
        expected, got = interleaved(**inputs), half_split(**inputs)
    assert (got.image_embeds - expected.image_embeds).abs().max() < 1e-5
    # and without the permutation the layouts really differ
    half_split.load_state_dict(interleaved.state_dict())
    with torch.no_grad():
        assert (half_split(**inputs).image_embeds - expected.image_embeds).abs().max() > 1e-3


# --- padding ------------------------------------------------------------------------------------------------------


def test_padding_patches_change_nothing_for_valid_patches():
    """Spec §10.9: an image alone == the same image batched (and padded) with a larger one: embeddings, routing,
    and balancing counts; the padding's pixel values do not matter."""
    model = tiny_model()
    alone = naflex_batch([(3, 5)], seed=1)
    together = naflex_batch([(3, 5), (4, 4)], seed=1, padding_value=1e3)
    other = {k: v[1:] for k, v in together.items()}
    text = texts([6])
    with torch.no_grad():
        out_alone = model(**alone, **text, output_router_logits=True)
        out_together = model(**together, **texts([6, 6]), output_router_logits=True)
    assert (out_together.image_embeds[0] - out_alone.image_embeds[0]).abs().max() < 1e-5
    for logits_alone, logits_together in zip(out_alone.router_logits, out_together.router_logits):
        assert logits_together.shape == (15 + 16, 7)  # valid patches only
        assert (logits_together[:15] - logits_alone).abs().max() < 1e-5
        assert torch.equal(logits_together[:15].topk(3).indices, logits_alone.topk(3).indices)

    model.train()  # the balancing counts are kept in training mode (no dropout in this config)

    def counts(inputs):
        for router in routers(model):
            router.tokens_per_expert.zero_()
        model.vision_model(**inputs)
        return torch.stack([router.tokens_per_expert.clone() for router in routers(model)])

    assert torch.equal(counts(together), counts(alone) + counts(other))
    assert counts(together).sum() == len(routers(model)) * 3 * (15 + 16)  # k = 3 slots per valid patch


def test_missing_pixel_attention_mask_is_derived_from_spatial_shapes():
    model = tiny_model()
    inputs = naflex_batch([(3, 5), (4, 4)], padding_value=1e3)
    with torch.no_grad():
        expected = model.get_image_features(**inputs).pooler_output
        got = model.get_image_features(inputs["pixel_values"], spatial_shapes=inputs["spatial_shapes"]).pooler_output
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="spatial_shapes"):
        model.get_image_features(inputs["pixel_values"])
    with pytest.raises(ValueError, match="pre-patchified"):
        model.get_image_features(torch.randn(2, 3, 16, 16), spatial_shapes=inputs["spatial_shapes"])


@pytest.mark.parametrize(
    "spatial_shapes,pixel_attention_mask,message",
    [
        ([[3, 5]], None, r"`spatial_shapes` \(batch, 2\).*for a batch of 2; got \(1, 2\)"),  # would broadcast
        ([[5, 5], [4, 4]], None, r"rows \* cols <= 16"),  # 25 patches claimed in 16 slots
        ([[0, 4], [4, 4]], None, r"rows, cols >= 1"),
        ([[4, 4], [4, 4]], torch.arange(16) < torch.tensor([[15], [16]]), r"marks \[15, 16\] slots"),
        ([[3, 5], [4, 4]], torch.ones(2, 15), r"pixel_attention_mask must be \(batch, num_patches\)"),
    ],
)
def test_spatial_shapes_that_do_not_describe_the_pixel_values_are_rejected(
    spatial_shapes, pixel_attention_mask, message
):
    model = tiny_model()
    pixel_values = naflex_batch([(3, 5), (4, 4)])["pixel_values"]  # (2, 16, 48)
    with pytest.raises(ValueError, match=message):
        model.get_image_features(pixel_values, pixel_attention_mask, torch.tensor(spatial_shapes))


# --- video ---------------------------------------------------------------------------------------------------------


def test_video_embedding_is_the_projected_mean_of_its_real_frames():
    model = tiny_model()
    frames = naflex_batch([(3, 4)] * 5, seed=2)
    videos = frames["pixel_values"].reshape(1, 5, 12, PATCH_DIM).repeat(2, 1, 1, 1)
    videos[1, 3:] = float("nan")  # padded frames of the second video are never computed
    padding_mask_videos = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        video = model.get_video_features(videos, video_spatial_shapes=torch.tensor([[3, 4], [3, 4]]),
                                         padding_mask_videos=padding_mask_videos)
        pooled = model.vision_model(**frames).pooler_output  # (5, H) pooled, before the projection
    expected = model.visual_projection(torch.stack([pooled.mean(0), pooled[:3].mean(0)]))
    assert (video.pooler_output - expected).abs().max() < 1e-5
    assert (video.frame_embeds[0] - model.visual_projection(pooled)).abs().max() < 1e-5
    assert torch.equal(video.frame_embeds[1, 3:], torch.zeros(2, 24))
    assert video.last_hidden_state.shape == (8, 12, 32)  # the 5 + 3 real frames


def test_video_of_identical_frames_equals_the_image():
    model = tiny_model()
    image = naflex_batch([(4, 4)], seed=3)
    with torch.no_grad():
        image_embeds = model.get_image_features(**image).pooler_output
        video = model.get_video_features(image["pixel_values"][:, None].repeat(1, 4, 1, 1),
                                         video_spatial_shapes=image["spatial_shapes"])
    assert (video.pooler_output - image_embeds).abs().max() < 1e-5
    with pytest.raises(ValueError, match="at least one frame"):
        model.get_video_features(image["pixel_values"][:, None].repeat(1, 2, 1, 1),
                                 video_spatial_shapes=image["spatial_shapes"],
                                 padding_mask_videos=torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match=r"`video_spatial_shapes`.*rows \* cols <= 16"):
        model.get_video_features(image["pixel_values"][:, None], video_spatial_shapes=torch.tensor([[5, 4]]))


# --- text ------------------------------------------------------------------------------------------------------------


def test_causal_text_pooled_at_the_first_eos_ignores_padding():
    """Spec §10.13: padding to the maximum length or to the longest text gives the same embeddings."""
    model = tiny_model()
    short = texts([5, 9], total=9, seed=4)
    long = {key: F.pad(value, (0, 7)) for key, value in short.items()}  # pad id 0, mask 0
    long["input_ids"][0, 9] = 98  # a second EOS after the first one changes nothing
    with torch.no_grad():
        expected = model.get_text_features(**short).pooler_output
        assert (model.get_text_features(**long).pooler_output - expected).abs().max() < 1e-5
        no_mask = {"input_ids": long["input_ids"]}  # the official model never masks padding
        assert (model.get_text_features(**no_mask).pooler_output - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="eos_token_id=98"):
        model.get_text_features(torch.randint(1, 97, (2, 6)))


def test_bidirectional_text_pooled_at_the_last_position():
    model = tiny_model(text_config={"is_causal": False, "pooling_type": "last", "use_final_layer_norm": True})
    inputs = texts([5, 12], seed=5)
    with torch.no_grad():
        output = model.text_model(**inputs)
        changed_start = inputs["input_ids"].clone()
        changed_start[:, 1] = 50  # a bidirectional tower pooled at the end sees the first tokens
        changed = model.text_model(changed_start, inputs["attention_mask"])
    assert torch.equal(output.pooler_output, output.last_hidden_state[:, -1])
    assert (changed.pooler_output - output.pooler_output).abs().max() > 1e-4


# --- losses ---------------------------------------------------------------------------------------------------------


def test_softmax_loss_is_symmetric_infonce_with_clamped_temperature():
    model = tiny_model()
    with torch.no_grad():
        model.logit_scale.fill_(6.0)  # above ln 100: clamped
        out = model(**batch(), return_loss=True)
    similarity = out.text_embeds @ out.image_embeds.t() * 100.0
    assert torch.allclose(out.logits_per_text, similarity, atol=1e-4)
    n = similarity.shape[0]
    text_to_image = -torch.stack([similarity[i].log_softmax(-1)[i] for i in range(n)]).mean()
    image_to_text = -torch.stack([similarity[:, i].log_softmax(-1)[i] for i in range(n)]).mean()
    assert torch.allclose(out.loss, (text_to_image + image_to_text) / 2, atol=1e-5)
    assert torch.allclose(out.image_embeds.norm(dim=-1), torch.ones(n)) and out.logits_per_image.shape == (n, n)


def test_sigmoid_loss_is_siglips():
    model = tiny_model(loss_type="sigmoid", max_logit_scale=None)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(10))
        model.logit_bias.fill_(-2.0)
        out = model(**batch(), return_loss=True)
    logits = out.text_embeds @ out.image_embeds.t() * 10.0 - 2.0
    n = logits.shape[0]
    expected = -sum(
        math.log(torch.sigmoid((1 if i == j else -1) * logits[i, j]).item()) for i in range(n) for j in range(n)
    ) / n
    assert torch.allclose(out.logits_per_text, logits, atol=1e-5)
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)


def test_contrastive_loss_needs_one_text_per_image():
    model = tiny_model()
    images = naflex_batch([(3, 5), (4, 4)])
    with torch.no_grad():
        for num_texts in (3, 1):
            with pytest.raises(ValueError, match=f"one text per image .* got {num_texts} texts and 2 images"):
                model(**images, **texts([5] * num_texts), return_loss=True)
        assert model(**images, **texts([5] * 3)).logits_per_image.shape == (2, 3)  # fine without the loss


def test_router_z_loss_is_added_to_the_contrastive_loss():
    model = tiny_model(vision_config={"router_aux_loss_type": "z_loss", "router_aux_loss_coef": 0.5})
    plain = tiny_model()
    inputs = batch()
    with torch.no_grad():
        out = model(**inputs, return_loss=True)
        contrastive = plain(**inputs, return_loss=True).loss
    assert out.router_logits is None  # computed for the loss, returned only on request
    assert len(out.vision_model_output.router_logits) == 2
    z_loss = torch.stack(
        [torch.logsumexp(logits, -1).pow(2).mean() for logits in out.vision_model_output.router_logits]
    ).mean()
    assert torch.allclose(out.aux_loss, z_loss, atol=1e-6)
    assert torch.allclose(out.loss, contrastive + 0.5 * z_loss, atol=1e-5)


# --- implementations and plumbing ------------------------------------------------------------------------------------


def loss_and_gradients(model, inputs):
    model.zero_grad()
    loss = model(**inputs, return_loss=True).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "moezoo"])
def test_experts_implementations_agree(implementation):
    model = tiny_model()
    inputs = batch()
    model.set_experts_implementation("eager")
    expected_loss, expected_grads = loss_and_gradients(model, inputs)
    model.set_experts_implementation(implementation)
    assert model.vision_model.encoder.layers[1].mlp.experts.config._experts_implementation == implementation
    loss, grads = loss_and_gradients(model, inputs)
    assert torch.allclose(loss, expected_loss, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert (grad - expected_grads[name]).abs().max() < 1e-5, name


@pytest.mark.parametrize(
    "implementation", ["eager", pytest.param("flex_attention", marks=pytest.mark.slow)]  # flex compiles: ~10 s
)
def test_attention_implementations_agree(implementation):
    model = tiny_model()
    inputs = batch()
    with torch.no_grad():  # flex attention has no backward on the CPU
        expected = model(**inputs).logits_per_image
        model.set_attn_implementation(implementation)
        assert model.vision_model.config._attn_implementation == implementation
        got = model(**inputs).logits_per_image
    assert (got - expected).abs().max() < 1e-4


def test_gradient_checkpointing_gives_the_same_gradients_and_counts():
    model = tiny_model().train()
    inputs = batch()
    expected_loss, expected_grads = loss_and_gradients(model, inputs)
    expected_counts = [router.tokens_per_expert.clone() for router in routers(model)]
    for router in routers(model):
        router.tokens_per_expert.zero_()
    model.activation_checkpointing_enable()  # gradient_checkpointing_enable is deprecated
    assert model.vision_model.encoder.layers[0].gradient_checkpointing
    loss, grads = loss_and_gradients(model, inputs)
    assert torch.allclose(loss, expected_loss, atol=1e-6)
    for name, grad in grads.items():
        assert (grad - expected_grads[name]).abs().max() < 1e-5, name
    # the recomputation in the backward pass does not count the tokens twice
    assert all(torch.equal(router.tokens_per_expert, counts) for router, counts in zip(routers(model), expected_counts))


def test_optional_outputs_and_tuple_return():
    model = tiny_model()
    model.set_attn_implementation("eager")
    inputs = batch()
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, output_attentions=True, output_router_logits=True)
        as_tuple = model(**inputs, return_dict=False)
    vision = out.vision_model_output
    assert len(vision.hidden_states) == 4 and vision.hidden_states[-1].shape == (3, 16, 32)
    assert len(out.text_model_output.hidden_states) == 3
    assert len(vision.attentions) == 3 and vision.attentions[0].shape == (3, 4, 16, 16)
    assert [logits.shape for logits in out.router_logits] == [(15 + 16 + 6, 7)] * 2
    assert torch.equal(as_tuple[0], out.logits_per_image)


def test_zero_shot_image_classification_pipeline():
    """`pipeline("zero-shot-image-classification")` with a NaFlex image processor and a tokenizer that adds sot/eot:
    its scores are the softmax of the model's `logits_per_image`."""
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, pipeline
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    vocab = {"[pad]": 0, "[unk]": 1} | {f"w{i}": i for i in range(2, 97)} | {"<sot>": 97, "<eot>": 98}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<sot> $A <eot>", special_tokens=[("<sot>", 97), ("<eot>", 98)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[pad]")
    image_processor = Siglip2ImageProcessorPil(patch_size=4, max_num_patches=16)
    model = tiny_model()
    image = Image.fromarray(torch.randint(0, 256, (20, 28, 3), dtype=torch.uint8).numpy())
    labels = ["w2 w3", "w4", "w5 w6 w7"]

    classifier = pipeline("zero-shot-image-classification", model=model, tokenizer=tokenizer,
                          image_processor=image_processor)
    scores = {result["label"]: result["score"] for result in classifier(image, candidate_labels=labels,
                                                                        hypothesis_template="{}")}
    with torch.no_grad():
        logits = model(**image_processor(images=[image], return_tensors="pt"),
                       **tokenizer(labels, padding=True, return_tensors="pt")).logits_per_image
    expected = logits.softmax(-1)[0]
    assert [scores[label] for label in labels] == pytest.approx(expected.tolist(), abs=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model()
    inputs = batch()
    model.save_pretrained(tmp_path)
    loaded = MoeVieModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected, got = model(**inputs), loaded(**inputs)
    assert torch.equal(got.logits_per_image, expected.logits_per_image)
    assert all(router.tokens_per_expert.sum() == 0 for router in routers(loaded))
    # bf16 weights keep the balancing bias in fp32
    bf16 = MoeVieModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf16.text_projection.weight.dtype == torch.bfloat16
    assert all(router.e_score_correction_bias.dtype == torch.float32 for router in routers(bf16))
    assert torch.equal(routers(bf16)[0].e_score_correction_bias, routers(model)[0].e_score_correction_bias)
    # the vision tower alone loads from the dual encoder's checkpoint (for VLMs: patch tokens)
    vision = MoeVieVisionModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        patches = vision(**naflex_batch([(3, 5)])).last_hidden_state
        assert torch.equal(patches, model.vision_model(**naflex_batch([(3, 5)])).last_hidden_state)
