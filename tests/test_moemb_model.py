"""MoEMB model: configuration, pooling, padding and packing invariance, routing outputs (spec moemb.md §2, §3.14,
§4, §10 A-B-C). Exactness against transformers' Qwen3.5-MoE is in test_moemb_conversion.py."""

import copy

import pytest
import torch
from torch.nn import functional as F
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from moezoo.configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB, MoEmbConfig
from moezoo.modeling.moe.accounting import count_parameters
from moezoo.modeling.moemb import (
    MoEmbForEmbedding,
    MoEmbModel,
    PackedSequences,
    fla_chunk_gated_delta_rule,
    packed_gated_delta_net,
    packed_sequences,
    text_positions,
)


EMB, IMAGE, VIDEO, START, END = 124, 120, 121, 122, 123
PATCH = 3 * 2 * 4 * 4  # channels * temporal patch * patch * patch of the tiny vision tower


def make_model(seed=0, **overrides) -> MoEmbForEmbedding:
    torch.manual_seed(seed)
    return MoEmbForEmbedding(MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | overrides))).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def words(count, generator):
    return torch.randint(1, IMAGE, (count,), generator=generator).tolist()


@pytest.fixture(scope="module")
def items():
    """An image item, a text-only item and a video item longer than a Gated DeltaNet chunk (64 tokens)."""
    generator = torch.Generator().manual_seed(1)
    step = [START] + [VIDEO] * 4 + [END]
    return [
        {"ids": words(3, generator) + [START] + [IMAGE] * 4 + [END] + words(2, generator) + [EMB],
         "pixel_values": torch.randn(16, PATCH, generator=generator), "image_grid_thw": [1, 4, 4]},
        {"ids": words(7, generator) + [EMB]},
        {"ids": words(2, generator) + step + words(1, generator) + step + words(70, generator) + [EMB],
         "pixel_values_videos": torch.randn(32, PATCH, generator=generator), "video_grid_thw": [2, 4, 4]},
    ]


def visual_inputs(items) -> dict:
    inputs = {}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        with_visual = [item for item in items if pixels in item]
        if with_visual:
            inputs[pixels] = torch.cat([item[pixels] for item in with_visual])
            inputs[grid] = torch.tensor([item[grid] for item in with_visual])
    return inputs


def padded_batch(items, side="right") -> dict:
    length = max(len(item["ids"]) for item in items)
    input_ids = torch.zeros(len(items), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, item in enumerate(items):
        span = slice(0, len(item["ids"])) if side == "right" else slice(length - len(item["ids"]), length)
        input_ids[row, span] = torch.tensor(item["ids"])
        attention_mask[row, span] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, **visual_inputs(items)}


def packed_batch(items) -> dict:
    lengths = torch.tensor([len(item["ids"]) for item in items])
    return {
        "input_ids": torch.tensor([sum((item["ids"] for item in items), [])]),
        "cu_seqlens": F.pad(lengths.cumsum(0), (1, 0)),
        **visual_inputs(items),
    }


def tiny_qwen3_5_moe():
    torch.manual_seed(0)
    config = {key: value for key, value in copy.deepcopy(TINY_MOEMB).items() if key != "emb_token_id"}
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**config)).eval()


# --- configuration --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"moe_variant": "dense"}, "moe_variant"),
        ({"pooling": "cls"}, "pooling"),
        ({"emb_token_id": 128}, "emb_token_id"),
        ({"emb_token_id": IMAGE}, "emb_token_id"),
        ({"video_token_id": IMAGE}, "video_token_id"),
        ({"vision_start_token_id": END}, "vision_start_token_id"),
        ({"vision_config": dict(TINY_MOEMB["vision_config"], num_heads=3)}, "num_heads"),
        ({"vision_config": dict(TINY_MOEMB["vision_config"], patch_size=0)}, "patch_size"),
        ({"vision_config": dict(TINY_MOEMB["vision_config"], depth=-1)}, "vision_config.depth"),
        ({"text_config": dict(TINY_MOEMB["text_config"], pad_token_id=500)}, "pad_token_id"),
        ({"emb_token_id": TINY_MOEMB["text_config"]["pad_token_id"]}, "equals text_config.pad_token_id"),
        ({"text_config": dict(TINY_MOEMB["text_config"], rope_parameters=dict(
            TINY_MOEMB["text_config"]["rope_parameters"], mrope_section=[2, 2, 2]))}, "mrope_section"),
        ({"logit_scale": 0.0}, "logit_scale"),
        ({"source_model_type": "llama"}, "source_model_type"),
        ({"vision_config": dict(TINY_MOEMB["vision_config"], out_hidden_size=32)}, "out_hidden_size"),
        ({"upcycle_granularity": 2}, "upcycle_granularity"),
        ({"moe_variant": "upcycled", "upcycle_granularity": 0}, "upcycle_granularity"),
        ({"moe_variant": "upcycled", "upcycle_granularity": 1, "upcycle_router_init": "ones"}, "upcycle_router_init"),
        ({"moe_variant": "upcycled", "upcycle_granularity": 16}, "upcycle_granularity=16 exceeds"),  # 8 experts
        ({"moe_variant": "upcycled", "upcycle_granularity": 2}, "num_experts_per_tok=4 must equal"),  # top-4
        ({"modality_expert_map": {0: 0, 1: 1, 2: 2}}, "modality_expert_map"),
        ({"moe_variant": "modality", "text_config": dict(TINY_MOEMB["text_config"], num_experts=3,
                                                         num_experts_per_tok=1),
          "modality_expert_map": {0: 0, 1: 1}}, "modality_expert_map"),
        ({"moe_variant": "modality", "text_config": dict(TINY_MOEMB["text_config"], num_experts=3,
                                                         num_experts_per_tok=2)}, "num_experts_per_tok"),
        ({"moe_variant": "modality", "router_bias": True,
          "text_config": dict(TINY_MOEMB["text_config"], num_experts=3, num_experts_per_tok=1)}, "router_bias"),
        ({"use_shared_expert": True, "text_config": dict(TINY_MOEMB["text_config"], shared_expert_intermediate_size=0)},
         "use_shared_expert"),
        ({"text_config": dict(TINY_MOEMB["text_config"], num_experts_per_tok=9)}, "num_experts_per_tok"),
    ],
)
def test_invalid_config_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | overrides))


def test_variant_defaults_and_json_round_trip(tmp_path):
    native = MoEmbConfig(**TINY_MOEMB)
    assert (native.use_shared_expert, native.router_bias, native.router_trainable) == (True, False, False)
    upcycled = MoEmbConfig(**TINY_MOEMB, moe_variant="upcycled", upcycle_granularity=4)
    assert (upcycled.use_shared_expert, upcycled.router_bias, upcycled.router_trainable) == (False, True, True)
    assert upcycled.routed_scaling_factor == 4.0
    modality = MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | {
        "moe_variant": "modality", "modality_expert_map": {0: 0, 1: 1, 2: 1},
        "text_config": dict(TINY_MOEMB["text_config"], num_experts=2, num_experts_per_tok=1),
    }))
    modality.save_pretrained(tmp_path)
    reloaded = MoEmbConfig.from_pretrained(tmp_path)
    assert reloaded.modality_expert_map == {0: 0, 1: 1, 2: 1}  # integer keys again after JSON
    assert reloaded.to_dict() == modality.to_dict()
    assert reloaded.moe_layer_spec().router_type == "given"


def test_parameter_names_and_shapes_are_qwen3_5_moe_without_lm_head(model):
    reference = tiny_qwen3_5_moe().state_dict()
    ours = model.state_dict()
    assert {key: value.shape for key, value in ours.items()} == {
        key: value.shape for key, value in reference.items() if not key.startswith("lm_head.")
    }


def test_parameter_counts_of_the_presets():
    """Spec §4.2 / §10 A-6: A3B is 34.60 B parameters without lm_head, active ≈ 3 B; A10B ≈ 122 B."""
    counts = {}
    for name, config in MOEMB_CONFIGS.items():
        with torch.device("meta"):
            counts[name] = count_parameters(MoEmbForEmbedding(MoEmbConfig(**config)))
    assert round(counts["MoEMB-A3B"].total / 1e9, 2) == 34.60
    assert 3.0e9 < counts["MoEMB-A3B"].active < 3.5e9
    assert round(counts["MoEMB-A10B"].total / 1e9) == 122
    assert 9.0e9 < counts["MoEMB-A10B"].active < 10.5e9
    assert count_parameters(make_model()).total == 640_752


# --- padding, pooling, packing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_embeddings_do_not_depend_on_padding_or_batch(items, attn_implementation):
    model = make_model()
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():
        alone = torch.cat([model(**padded_batch([item])).embeddings for item in items])
        right = model(**padded_batch(items, "right")).embeddings
        left = model(**padded_batch(items, "left")).embeddings
        reordered = model(**padded_batch(items[::-1], "right")).embeddings.flip(0)
    for batched in (right, left, reordered):
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_embeddings_are_unit_float32_vectors_of_the_emb_token(model, items):
    batch = padded_batch(items)
    with torch.no_grad():
        outputs = model(**batch)
        bf16_embeddings = copy.deepcopy(model).to(torch.bfloat16)(**batch).embeddings
    lengths = batch["attention_mask"].sum(-1)
    assert torch.equal(outputs.pooled_index, lengths - 1)  # <emb> is each item's last real token
    expected = F.normalize(outputs.last_hidden_state[torch.arange(3), lengths - 1], dim=-1)
    torch.testing.assert_close(outputs.embeddings, expected, atol=0, rtol=0)
    torch.testing.assert_close(outputs.embeddings.norm(dim=-1), torch.ones(3))
    assert bf16_embeddings.dtype == torch.float32
    torch.testing.assert_close(bf16_embeddings.norm(dim=-1), torch.ones(3))


def test_last_token_pooling_and_explicit_pooled_index(model, items):
    """With <emb> last, <emb> pooling equals last-token pooling (left padding included); a pooled_index picks any
    token, and the last of several <emb> tokens is pooled."""
    last_token = make_model(pooling="last_token")
    batch = padded_batch(items, "left")
    with torch.no_grad():
        by_emb = model(**batch).embeddings
        assert torch.equal(last_token(**batch).embeddings, by_emb)
        first_tokens = model(**batch, pooled_index=torch.zeros(3, dtype=torch.long))
        twice = dict(items[1], ids=items[1]["ids"][:3] + [EMB] + items[1]["ids"][3:])
        with_two_emb = model(**padded_batch([twice]))
    assert torch.equal(first_tokens.pooled_index, torch.zeros(3, dtype=torch.long))
    assert not torch.allclose(first_tokens.embeddings, by_emb)
    assert with_two_emb.pooled_index.item() == len(twice["ids"]) - 1


def test_a_batch_without_its_emb_token_is_rejected(model, items):
    truncated = dict(items[1], ids=items[1]["ids"][:-1])
    with pytest.raises(ValueError, match=r"items \[1\] .*no <emb> token .*truncate"):
        model(**padded_batch([items[0], truncated]))
    with pytest.raises(ValueError, match=r"items \[1\] .*no <emb> token"):
        model(**packed_batch([items[0], truncated]))
    with pytest.raises(ValueError, match="emb_token_id is not set"):
        make_model(emb_token_id=None)(**padded_batch(items[1:2]))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_batches_equal_padded_batches(items, attn_implementation):
    """Spec §10 C-14: the packed (varlen) forward equals the per-item padded one, token by token."""
    model = make_model()
    model.set_attn_implementation(attn_implementation)
    padded, packed = padded_batch(items), packed_batch(items)
    with torch.no_grad():
        expected = model(**padded, output_router_logits=True, output_routing_counts=True)
        got = model(**packed, output_router_logits=True, output_routing_counts=True)
    real = padded["attention_mask"].bool()
    torch.testing.assert_close(got.embeddings, expected.embeddings, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.last_hidden_state[0], expected.last_hidden_state[real], atol=1e-5, rtol=0)
    for packed_logits, padded_logits in zip(got.router_logits, expected.router_logits):
        torch.testing.assert_close(packed_logits, padded_logits, atol=1e-5, rtol=0)
    assert torch.equal(got.routing_counts, expected.routing_counts)
    lengths = real.sum(-1)
    assert torch.equal(got.pooled_index, lengths.cumsum(0) - 1)


def test_stock_gated_deltanet_leaks_across_packed_sequences(model, items):
    """Why packing needs its own Gated DeltaNet path (spec §3.14): transformers' layer on a packed row carries the
    convolution window and the recurrent state from one sequence into the next."""
    layer = model.model.language_model.layers[0].linear_attn
    lengths = [len(item["ids"]) for item in items]
    packed = PackedSequences.from_cu_seqlens(F.pad(torch.tensor(lengths).cumsum(0), (1, 0)), sum(lengths))
    hidden_states = torch.randn(1, sum(lengths), model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        one_by_one = torch.cat([layer(hidden_states[:, start:end]) for start, end in packed.bounds()], dim=1)
        stock = layer(hidden_states)
        ours = packed_gated_delta_net(layer, hidden_states, packed)
    first, *others = packed.bounds()
    torch.testing.assert_close(stock[:, : first[1]], one_by_one[:, : first[1]], atol=1e-6, rtol=0)
    for start, end in others:
        assert (stock[:, start:end] - one_by_one[:, start:end]).abs().max() > 1e-3
    torch.testing.assert_close(ours, one_by_one, atol=0, rtol=0)


@pytest.mark.skipif(
    fla_chunk_gated_delta_rule is None or not torch.cuda.is_available(), reason="needs flash-linear-attention and a GPU"
)
def test_fla_varlen_gated_deltanet_matches_the_per_sequence_reference(model, items):
    layer = copy.deepcopy(model.model.language_model.layers[0].linear_attn).cuda()
    lengths = [len(item["ids"]) for item in items]
    packed = PackedSequences.from_cu_seqlens(F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).cuda(), sum(lengths))
    hidden_states = torch.randn(1, sum(lengths), model.config.hidden_size, device="cuda")
    with torch.no_grad():
        reference = torch.cat([layer(hidden_states[:, start:end]) for start, end in packed.bounds()], dim=1)
        torch.testing.assert_close(packed_gated_delta_net(layer, hidden_states, packed), reference, atol=1e-4, rtol=0)


def test_packed_inputs_are_checked(model, items):
    packed = packed_batch(items)
    with pytest.raises(ValueError, match="end at the packed length"):
        model(**(packed | {"cu_seqlens": packed["cu_seqlens"][:-1]}))
    with pytest.raises(ValueError, match="no attention_mask"):
        model(**packed, attention_mask=torch.ones_like(packed["input_ids"]))


def test_placeholders_without_their_visual_inputs_are_named(model, items):
    """A collator that drops the visual keys: the error counts the placeholders and names what is missing."""
    batch = padded_batch(items)
    for kind, pixels, grid, count in (("image", "pixel_values", "image_grid_thw", 4),
                                      ("video", "pixel_values_videos", "video_grid_thw", 8)):  # fmt: skip
        with pytest.raises(ValueError, match=f"hold {count} {kind} placeholder tokens .*but {pixels} and {grid} are"):
            model(**{key: value for key, value in batch.items() if key not in (pixels, grid)})
        with pytest.raises(ValueError, match=f"hold {count} {kind} placeholder tokens .*but {grid} is missing"):
            model(**{key: value for key, value in batch.items() if key != grid})


# --- routing and other outputs --------------------------------------------------------------------------------------


def test_routing_outputs_count_real_tokens_by_modality(model, items):
    batch = padded_batch(items)
    with torch.no_grad():
        outputs = model(**batch, output_router_logits=True, output_routing_counts=True)
    text_config = model.config.text_config
    real = batch["attention_mask"].bool()
    assert len(outputs.router_logits) == text_config.num_hidden_layers
    assert all(logits.shape == (real.sum(), text_config.num_experts) for logits in outputs.router_logits)
    assert all(logits.dtype == torch.float32 for logits in outputs.router_logits)
    counts = outputs.routing_counts  # (layers, modalities, experts)
    assert counts.shape == (text_config.num_hidden_layers, 3, text_config.num_experts)
    is_image, is_video = batch["input_ids"] == IMAGE, batch["input_ids"] == VIDEO
    top_k = text_config.num_experts_per_tok
    per_modality = torch.tensor([(real & ~is_image & ~is_video).sum(), is_image.sum(), is_video.sum()]) * top_k
    assert torch.equal(counts.sum(-1), per_modality.expand(text_config.num_hidden_layers, 3))
    # the counts are the top-k of the returned logits
    top_experts = outputs.router_logits[0].topk(top_k, dim=-1).indices.flatten()
    assert torch.equal(counts[0].sum(0), torch.bincount(top_experts, minlength=text_config.num_experts))


def test_hidden_states_output(model, items):
    batch = padded_batch(items[1:2])
    with torch.no_grad():
        outputs = model(**batch, output_hidden_states=True)
        token_embeddings = model.get_input_embeddings()(batch["input_ids"])
    assert len(outputs.hidden_states) == model.config.text_config.num_hidden_layers + 1
    assert torch.equal(outputs.hidden_states[0], token_embeddings)
    assert torch.equal(outputs.hidden_states[-1], outputs.last_hidden_state)


def test_output_flags_from_the_config_and_selected_hidden_states(items, tmp_path):
    """Issue 16: `output_router_logits=True` in the config is honoured (and kept by save/load, on the text config where
    transformers' MoE configs hold it); a list of indices as `output_hidden_states` returns only those."""
    model = make_model(output_router_logits=True)
    batch = padded_batch(items[:2])
    with torch.no_grad():
        assert len(model(**batch).router_logits) == model.config.text_config.num_hidden_layers
        assert not model(**batch, output_router_logits=False).router_logits
        everything = model(**batch, output_hidden_states=True).hidden_states
        selected = model(**batch, output_hidden_states=[0, 3, -1]).hidden_states
    model.save_pretrained(tmp_path)
    assert MoEmbForEmbedding.from_pretrained(tmp_path).config.output_router_logits is True
    assert [i for i, state in enumerate(selected) if state is not None] == [0, 3, len(everything) - 1]
    for i in (0, 3, -1):
        assert torch.equal(selected[i], everything[i])


def test_text_positions_are_qwen_mrope_positions_of_text(model, items):
    """Without visual inputs the text model positions the tokens itself: from each item's first real token (left
    padding shifts nothing), every packed item from 0. These are the positions Qwen3.5's `get_rope_index` gives text
    (on all three MRoPE axes), which the backbone uses when there are images or videos."""
    text_items = [{"ids": [token for token in item["ids"] if token not in (IMAGE, VIDEO)]} for item in items]
    for batch in (padded_batch(text_items, side="left"), packed_batch(text_items)):
        input_ids, mask, cu_seqlens = batch["input_ids"], batch.get("attention_mask"), batch.get("cu_seqlens")
        packed = packed_sequences(input_ids, None, mask, cu_seqlens)
        expected = model.model.rope_positions(torch.zeros_like(input_ids), None, None, mask, packed)
        got = text_positions(input_ids.shape, mask, packed, input_ids.device)
        real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        assert all(torch.equal(got[real], axis[real]) for axis in expected)
    assert got[0, -1] == len(text_items[-1]["ids"]) - 1  # the last packed item counts from 0


def test_contrastive_logits_are_scaled_cosines(model):
    queries = F.normalize(torch.randn(3, 64), dim=-1)
    targets = F.normalize(torch.randn(5, 64), dim=-1)
    logits = model.contrastive_logits(queries, targets)
    assert logits.shape == (3, 5)
    torch.testing.assert_close(logits, 50.0 * F.cosine_similarity(queries[:, None], targets[None], dim=-1))


def test_save_and_load_keep_outputs_exact(model, items, tmp_path):
    model.save_pretrained(tmp_path)
    reloaded = MoEmbForEmbedding.from_pretrained(tmp_path)
    backbone = MoEmbModel.from_pretrained(tmp_path)  # the "model." prefix is the base model's
    batch = padded_batch(items)
    with torch.no_grad():
        expected = model(**batch)
        assert torch.equal(reloaded(**batch).embeddings, expected.embeddings)
        assert torch.equal(backbone(**batch).last_hidden_state, expected.last_hidden_state)


def test_gradient_checkpointing_gives_the_same_gradients(items):
    batch = packed_batch(items)
    gradients = []
    for checkpointing in (False, True):
        model = make_model().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        embeddings = model(**batch).embeddings
        loss = F.cross_entropy(model.contrastive_logits(embeddings, embeddings.roll(1, 0)), torch.arange(3))
        loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    assert "model.language_model.layers.3.mlp.experts.gate_up_proj" in gradients[0]
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=0, msg=name)
