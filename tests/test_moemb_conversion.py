"""Qwen3.5 checkpoints -> MoEMB: exact against transformers' own Qwen3.5(-MoE) models on the same inputs (spec
moemb.md §5, §10 A-1, A-2, A-7), for the native, upcycled and modality designs; and the errors bad sources raise."""

import argparse
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from moezoo.configuration.moemb import TINY_MOEMB
from moezoo.conversion.moemb_qwen3_5 import add_arguments, convert, convert_qwen3_5_checkpoint, synthetic_batch
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.tiny_tokenizers import build_tiny_qwen_tokenizer


EMB = TINY_MOEMB["emb_token_id"]
DENSE_WIDTH = 128  # divisible by every granularity tested
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def source_config(dense: bool = False) -> dict:
    config = {key: value for key, value in copy.deepcopy(TINY_MOEMB).items() if key != "emb_token_id"}
    if dense:
        config["text_config"] = {key: value for key, value in config["text_config"].items() if key not in MOE_FIELDS}
        config["text_config"]["intermediate_size"] = DENSE_WIDTH
    return config


def randomize_norms(model):
    """transformers initialises the zero-centred norms to 0 (identity); random ones make the comparison stricter."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    """A tiny Qwen3.5-MoE saved by transformers (per-expert layout on disk), plus an `mtp.*` tensor as released
    checkpoints have."""
    torch.manual_seed(0)
    model = randomize_norms(Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**source_config()))).eval()
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, model


@pytest.fixture(scope="module")
def fused_source(moe_source, tmp_path_factory):
    """The same weights with fused 3D experts (the layout transformers holds in memory)."""
    folder, model = moe_source
    fused = tmp_path_factory.mktemp("qwen3_5_moe_fused")
    (fused / "config.json").write_text((folder / "config.json").read_text())
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, fused / "model.safetensors",
              metadata={"format": "pt"})
    return fused


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory):
    torch.manual_seed(0)
    model = randomize_norms(Qwen3_5ForConditionalGeneration(Qwen3_5Config(**source_config(dense=True)))).eval()
    folder = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(folder)
    return folder, model


def converted(source, folder, **options) -> MoEmbForEmbedding:
    convert_qwen3_5_checkpoint(source, folder, **options)
    model = MoEmbForEmbedding.from_pretrained(folder).eval()
    model.set_experts_implementation("eager")
    return model


def assert_same_hidden_states(moemb, reference, batch, atol=0.0):
    with torch.no_grad():
        got = moemb.model(**batch).last_hidden_state
        expected = reference.model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], atol=atol, rtol=0)


# --- native ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_native_conversion_is_exact(moe_source, fused_source, layout, tmp_path):
    """Spec §5.1: hidden states, router logits and vision features equal transformers' Qwen3_5MoeModel on text,
    image and video inputs with right padding (same experts implementation on both sides)."""
    folder, reference = moe_source
    moemb = converted(folder if layout == "per_expert" else fused_source, tmp_path, emb_token_id=EMB)
    reference.set_experts_implementation("eager")
    batch = synthetic_batch(moemb.config)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        got = moemb.model(**batch, output_router_logits=True)
        expected = reference.model(**batch, output_router_logits=True)
        for features in ("get_image_features", "get_video_features"):
            pixels, grid = (batch["pixel_values"], batch["image_grid_thw"]) if "image" in features else (
                batch["pixel_values_videos"], batch["video_grid_thw"])
            ours, theirs = (getattr(model.model, features)(pixels, grid).pooler_output for model in (moemb, reference))
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert torch.equal(got.last_hidden_state[real], expected.last_hidden_state[real])
    assert len(got.router_logits) == len(expected.router_logits) == 8
    for ours, theirs in zip(got.router_logits, expected.router_logits):
        assert torch.equal(ours, theirs[real.flatten()])


def test_native_keys_and_the_emb_row(moe_source, fused_source, tmp_path):
    """Every Qwen3.5 tensor but lm_head/mtp is written under its own name; both expert layouts give the same
    tensors; the <emb> row is the mean of the other rows (spec §5.2-5.3); nothing else is added."""
    folder, reference = moe_source
    report = convert_qwen3_5_checkpoint(folder, tmp_path / "a", emb_token_id=EMB)
    convert_qwen3_5_checkpoint(fused_source, tmp_path / "b", emb_token_id=EMB)
    per_expert, fused = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    source = reference.state_dict()
    assert per_expert.keys() == fused.keys() == {key for key in source if not key.startswith("lm_head.")}
    assert all(torch.equal(per_expert[key], fused[key]) for key in per_expert)
    embedding, source_embedding = per_expert["model.language_model.embed_tokens.weight"], source[
        "model.language_model.embed_tokens.weight"]
    others = torch.cat([source_embedding[:EMB], source_embedding[EMB + 1 :]])
    torch.testing.assert_close(embedding[EMB], others.mean(0))
    assert torch.equal(torch.cat([embedding[:EMB], embedding[EMB + 1 :]]), others)
    assert all(torch.equal(per_expert[key], source[key]) for key in per_expert if "embed_tokens" not in key)
    assert report["key_accounting"]["fused_from_per_expert"] == 8 * 8 * 3
    dropped = report["key_accounting"]["dropped"]
    assert {name: kind["tensors"] for name, kind in dropped.items()} == {"lm_head": 1, "mtp": 1}
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["model_type"], config["moe_variant"], config["emb_token_id"]) == ("moemb", "native", EMB)


def copy_weights(folder, destination):
    destination.mkdir()
    for name in ("config.json", "model.safetensors"):
        (destination / name).write_bytes((folder / name).read_bytes())
    return destination


def test_tokenizer_gets_emb_and_processor_files_are_copied(moe_source, tmp_path):
    source = copy_weights(moe_source[0], tmp_path / "source")
    vocabulary = {f"w{i}": i for i in range(100)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocabulary, unk_token="w0")))
    tokenizer.save_pretrained(source)
    (source / "preprocessor_config.json").write_text(json.dumps({"patch_size": 4, "merge_size": 2}))

    report = convert_qwen3_5_checkpoint(source, tmp_path / "out")
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    # config.json makes it the Qwen3.5 tokenizer, which adds <|endoftext|> (id 100); <emb> comes after it
    assert saved.convert_tokens_to_ids("<|endoftext|>") == 100
    assert report["emb_token_id"] == saved.convert_tokens_to_ids("<emb>") == 101
    assert report["processor_files"] == ["tokenizer", "preprocessor_config.json"]
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    embedding = load_file(tmp_path / "out" / "model.safetensors")["model.language_model.embed_tokens.weight"]
    torch.testing.assert_close(embedding[101], embedding[:101].mean(0))  # the rows of real tokens only
    with pytest.raises(ValueError, match="disagrees with the source tokenizer"):
        convert_qwen3_5_checkpoint(source, tmp_path / "other", emb_token_id=EMB)


def test_emb_beyond_the_vocabulary_grows_the_embedding_and_shards_load(moe_source, tmp_path):
    folder, reference = moe_source
    report = convert_qwen3_5_checkpoint(folder, tmp_path, emb_token_id=130, max_shard_size=200_000)
    assert report["vocab_size"] == {"source": 128, "converted": 192}  # a multiple of 64 holding id 130
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    moemb = MoEmbForEmbedding.from_pretrained(tmp_path)
    embedding = moemb.get_input_embeddings().weight.detach()
    assert embedding.shape == (192, 64) and moemb.config.emb_token_id == 130
    assert torch.equal(embedding[:128], reference.get_input_embeddings().weight.detach())
    assert not embedding[128:130].any() and not embedding[131:].any() and embedding[130].any()


def test_convert_command_measures_the_source(moe_source):
    folder, _ = moe_source
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = convert(folder, **vars(parser.parse_args(["--emb-token-id", str(EMB)])))
    assert result.provenance["max_abs_diff"] == 0.0
    assert set(result.provenance["max_abs_diff_by_output"]) == {"last_hidden_state", "router_logits"}
    assert result.processor is None  # no tokenizer in the tiny source
    assert result.model.config.emb_token_id == EMB  # streamed into a folder, not loaded
    assert isinstance(result.model.load(), MoEmbForEmbedding)


def test_convert_command_measures_a_source_whose_vocabulary_grew(moe_source, tmp_path):
    """A tokenizer that fills the source's 128 embedding rows puts <emb> beyond them: the conversion grows the matrix
    (spec §5.3), and the verification feeds the source only ids it has."""
    source = copy_weights(moe_source[0], tmp_path / "source")
    placeholders = {"<|image_pad|>": 120, "<|video_pad|>": 121, "<|vision_start|>": 122, "<|vision_end|>": 123}
    tokenizer = build_tiny_qwen_tokenizer(128, placeholders | {"<|endoftext|>": 0, "<|im_start|>": None,
                                                               "<|im_end|>": None})  # fmt: skip
    assert len(tokenizer) == 128
    tokenizer.save_pretrained(source)
    result = convert(source)
    assert result.provenance["vocab_size"] == {"source": 128, "converted": 192}
    assert result.provenance["emb_token_id"] >= 128
    assert result.provenance["max_abs_diff"] == 0.0


# --- bad sources ----------------------------------------------------------------------------------------------------


def copy_source(folder, destination, edit=None):
    destination.mkdir()
    (destination / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    save_file(edit(tensors) if edit else tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_missing_experts_are_named(moe_source, fused_source, tmp_path):
    folder, _ = moe_source

    def drop_experts(tensors):
        return {key: value for key, value in tensors.items()
                if not any(f"layers.3.mlp.experts.{j}." in key for j in (5, 6))}

    source = copy_source(folder, tmp_path / "per_expert", drop_experts)
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.experts .*experts \[5, 6\] are missing"):
        convert_qwen3_5_checkpoint(source, tmp_path / "out", emb_token_id=EMB)
    source = copy_source(fused_source, tmp_path / "fused",
                         lambda tensors: {k: v for k, v in tensors.items() if "layers.2.mlp.experts.down" not in k})
    with pytest.raises(ValueError, match=r"do not give: model\.language_model\.layers\.2\.mlp\.experts\.down_proj"):
        convert_qwen3_5_checkpoint(source, tmp_path / "out", emb_token_id=EMB)
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_a_truncated_source_file_is_named(moe_source, tmp_path):
    """A partly downloaded shard: an error naming the file, not the reader's, which does not say which file."""
    source = copy_source(moe_source[0], tmp_path / "truncated")
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{weights} is not a complete safetensors file .*download or save it again"):
        convert_qwen3_5_checkpoint(source, tmp_path / "out", emb_token_id=EMB)
    assert not (tmp_path / "out").exists()


def test_sources_of_other_types_and_wrong_variants_are_refused(moe_source, dense_source, tmp_path):
    other = copy_source(moe_source[0], tmp_path / "llama")
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' checkpoint; MoEMB converts Qwen3.5-MoE"):
        convert_qwen3_5_checkpoint(other, tmp_path / "out", emb_token_id=EMB)
    with pytest.raises(ValueError, match=r"use --variant upcycled \(variant='upcycled'\) or --variant modality"):
        convert_qwen3_5_checkpoint(dense_source[0], tmp_path / "out", emb_token_id=EMB)
    with pytest.raises(ValueError, match=r"use --variant native \(variant='native'\)"):
        convert_qwen3_5_checkpoint(moe_source[0], tmp_path / "out", "modality", emb_token_id=EMB)
    with pytest.raises(ValueError, match=r"pass --emb-token-id \(emb_token_id=\)"):
        convert_qwen3_5_checkpoint(moe_source[0], tmp_path / "out")
    with pytest.raises(ValueError, match=r"--num-experts \(num_experts=\), --top-k \(top_k=\) only apply to --variant upcycled"):
        convert_qwen3_5_checkpoint(moe_source[0], tmp_path / "out", emb_token_id=EMB, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="num_experts_per_tok=2 must equal upcycle_granularity=4"):
        convert_qwen3_5_checkpoint(dense_source[0], tmp_path / "out", "upcycled", emb_token_id=EMB, num_experts=8,
                                   granularity=4, top_k=2)
    assert not (tmp_path / "out").exists()


# --- dense -> upcycled / modality -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "granularity", "top_k", "router_init"),
    [(4, 1, 1, "zero_bias"), (4, 1, 2, "zero_bias"), (8, 4, 4, "zero_bias"), (32, 4, 4, "zero_bias"),
     (4, 1, 2, "random"), (4, 1, 2, "tiled")],
)
def test_upcycled_conversion_equals_the_dense_model(dense_source, tmp_path, num_experts, granularity, top_k,
                                                    router_init):
    """Spec §2.5 / §10 A-7: exact at initialisation for every (E, G, k) with zero_bias, and for G = 1 with any
    router init."""
    folder, dense = dense_source
    moemb = converted(folder, tmp_path, variant="upcycled", emb_token_id=EMB, num_experts=num_experts,
                      granularity=granularity, top_k=top_k, router_init=router_init)
    config = moemb.config
    assert (config.text_config.num_experts, config.text_config.num_experts_per_tok) == (num_experts, top_k)
    assert config.text_config.moe_intermediate_size == DENSE_WIDTH // granularity
    assert config.routed_scaling_factor == granularity and not config.use_shared_expert
    batch = synthetic_batch(config)
    assert_same_hidden_states(moemb, dense, batch, atol=1e-5)
    gate = moemb.model.language_model.layers[0].mlp.gate
    if router_init == "zero_bias":  # every token picks experts 0..G-1, one replica of each slice
        with torch.no_grad():
            counts = moemb.model(**batch, output_routing_counts=True).routing_counts.sum(1)  # (layers, experts)
        assert (counts[:, :granularity] == batch["attention_mask"].sum()).all()
        assert counts.sum() == counts.shape[0] * top_k * batch["attention_mask"].sum()
        assert not gate.weight.any()
    elif router_init == "tiled":
        assert torch.equal(gate.weight, gate.weight[:1].expand_as(gate.weight)) and gate.weight.any()


@pytest.mark.parametrize("modality_map", [None, "0:0,1:1,2:1"])
def test_modality_conversion_equals_the_dense_model_and_routes_by_modality(dense_source, tmp_path, modality_map):
    folder, dense = dense_source
    moemb = converted(folder, tmp_path, variant="modality", emb_token_id=EMB, modality_map=modality_map)
    expert_of = moemb.config.modality_expert_map
    assert expert_of == ({0: 0, 1: 1, 2: 2} if modality_map is None else {0: 0, 1: 1, 2: 1})
    assert moemb.model.language_model.layers[0].mlp.gate is None
    batch = synthetic_batch(moemb.config)
    assert_same_hidden_states(moemb, dense, batch, atol=1e-5)
    with torch.no_grad():
        counts = moemb.model(**batch, output_routing_counts=True).routing_counts  # (layers, modality, expert)
    for modality, expert in expert_of.items():
        assert counts[:, modality, expert].min() > 0
        assert counts[:, modality].sum() == counts[:, modality, expert].sum()
    with pytest.raises(ValueError, match="no router logits"):
        moemb.model(**batch, output_router_logits=True)


def test_upcycled_convert_command(dense_source):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = vars(parser.parse_args(["--emb-token-id", str(EMB), "--num-experts", "8", "--granularity", "4",
                                      "--top-k", "4", "--router-init", "zero_bias"]))
    result = convert(dense_source[0], variant="upcycled", **options)
    assert result.provenance["max_abs_diff"] < 1e-5
    assert result.provenance["upcycling"]["router_init"] == "zero_bias"
