"""MoTE conversions (spec mote.md §5, §9.9-9.10): tiny GLM-OCR, Llama and SigLIP checkpoints saved with transformers'
own classes, converted tensor by tensor, and checked tensor for tensor and route for route against the source."""

import argparse
import json
import shutil

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GlmOcrConfig,
    GlmOcrForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    SiglipConfig,
    SiglipModel,
)
from transformers.models.glm_ocr.modeling_glm_ocr import GlmOcrTextMLP
from transformers.models.llama.modeling_llama import LlamaMLP

from conftest import run_moezoo_in_this_process
from moezoo.configuration.mote import TINY_GLM_OCR, TINY_LLAMA, TINY_SIGLIP_VISION
from moezoo.conversion import mote_glm_ocr, mote_llama
from moezoo.conversion.common import find_converter, local_source, save_conversion
from moezoo.conversion.mote_common import GLM_FFN, LLAMA_FFN, build_experts, parse_experts, split_groups
from moezoo.conversion.mote_glm_ocr import convert_glm_ocr_to_mote, synthetic_inputs
from moezoo.conversion.mote_llama import convert_llama_to_mote, synthetic_video_inputs
from moezoo.hub.folders import read_provenance
from moezoo.modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from moezoo.modeling.mote.llama import LlamaMoteForCausalLM
from moezoo.processors.build_mote import build_tiny_glm_ocr_tokenizer
from moezoo.processors.mote import GlmOcrMoteProcessor, VideoLlmMoteProcessor
from moezoo.registry import architectures_named


COIN = ["step", "next", "proc", "task", "proc_plus"]
MTP = "model.language_model.layers.2."  # the tiny decoder has layers 0 and 1


@pytest.fixture(scope="module")
def glm_source(tmp_path_factory):
    """A tiny GLM-OCR checkpoint with an MTP layer as the release has one (`num_nextn_predict_layers: 1`)."""
    torch.manual_seed(0)
    base = GlmOcrForConditionalGeneration(GlmOcrConfig(**TINY_GLM_OCR)).eval()
    folder = tmp_path_factory.mktemp("glm_ocr")
    base.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for key in [key for key in tensors if key.startswith("model.language_model.layers.1.")]:
        tensors[key.replace("layers.1.", "layers.2.")] = torch.randn(tensors[key].shape, generator=generator)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return base, folder, tensors


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    folder = tmp_path_factory.mktemp("llama")
    base.save_pretrained(folder)
    tiny_tokenizer(["<|reserved_special_token_0|>", ","]).save_pretrained(folder)
    return base, folder


@pytest.fixture(scope="module")
def siglip_source(tmp_path_factory):
    torch.manual_seed(1)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    siglip = SiglipModel(SiglipConfig(vision_config=TINY_SIGLIP_VISION, text_config=text)).eval()
    folder = tmp_path_factory.mktemp("siglip")
    siglip.save_pretrained(folder)
    return siglip, folder


def tiny_tokenizer(extra_tokens):
    """A word-level tokenizer of 128 tokens whose `extra_tokens` get ids 120 and up (ids 0-2: pad, bos, eos)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 120)}
    vocab |= {token: 120 + i for i, token in enumerate(extra_tokens)}
    vocab |= {f"x{i}": i for i in range(len(vocab), 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# --- GLM-OCR -> GLM-OCR-MoTE (spec §5.1, §5.4) -------------------------------------------------------------------


def test_glm_ocr_conversion_turns_only_decoder_ffns_into_experts(glm_source, tmp_path):
    base, folder, source = glm_source
    model, report = convert_glm_ocr_to_mote(folder)
    state = model.state_dict()

    ffn = {f"model.language_model.layers.{i}.mlp.{p}" for i in (0, 1) for p in GLM_FFN.projections}
    mtp = {key for key in source if key.startswith(MTP)}
    experts = {
        f"model.language_model.layers.{i}.mlp.{owner}.{p}"
        for i in (0, 1) for owner in ("experts.ocr", "experts.kie", "shared_expert") for p in GLM_FFN.projections
    }
    assert set(state) == (set(source) - ffn - mtp) | experts
    assert all(torch.equal(state[key], source[key]) for key in set(source) - ffn - mtp)
    # the vision MLPs and the merger have the same projection names and are not converted
    assert "model.visual.blocks.0.mlp.gate_proj.weight" in state and "model.visual.merger.gate_proj.weight" in state
    for i in (0, 1):
        prefix = f"model.language_model.layers.{i}.mlp"
        for name in ("ocr", "kie"):
            assert all(torch.equal(state[f"{prefix}.experts.{name}.{p}"], source[f"{prefix}.{p}"])
                       for p in GLM_FFN.projections)
        shared = state[f"{prefix}.shared_expert.gate_up_proj.weight"]
        assert torch.equal(shared, source[f"{prefix}.gate_up_proj.weight"])
        assert not state[f"{prefix}.shared_expert.down_proj.weight"].any()

    accounting = report["key_accounting"]
    assert accounting["source_tensors"] == len(source)
    assert set(accounting["dropped"]) == mtp and all("MTP" in reason for reason in accounting["dropped"].values())
    assert accounting["turned_into_experts"] == len(ffn) and accounting["copied"] == len(source) - len(ffn) - len(mtp)
    assert report["max_abs_diff"] == 0.0 and set(report["max_abs_diff_by_route"]) == {"ocr", "kie"}
    assert report["parameters"]["total"] == 262_720
    text_config = model.config.text_config
    assert not hasattr(text_config, "num_nextn_predict_layers")
    assert text_config.mote_default_route == "ocr" and text_config.mote_base_model == str(folder)
    assert text_config.mote_expert_descriptions["kie"] == "extract key fields from a receipt as JSON"

    model.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(state)
    reloaded = GlmOcrMoteForConditionalGeneration.from_pretrained(tmp_path).eval()
    inputs = synthetic_inputs(model.config)
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, base(**inputs).logits)


def test_copy_half_is_exact_and_the_paper_literal_mode_doubles_the_ffn(glm_source):
    base, folder, source = glm_source
    half, report = convert_glm_ocr_to_mote(folder, construction="copy_half")
    assert report["max_abs_diff"] == 0.0
    shared = half.model.language_model.layers[0].mlp.shared_expert
    assert torch.equal(shared.down_proj.weight, source["model.language_model.layers.0.mlp.down_proj.weight"])
    assert half.config.text_config.mote_shared_expert_scale == half.config.text_config.mote_routed_expert_scale == 0.5

    literal, report = convert_glm_ocr_to_mote(folder, construction="paper_literal")
    assert report["max_abs_diff"] > 0 and literal.config.text_config.mote_init == {"experts": "copy", "shared": "copy"}
    dense = base.model.language_model.layers[0].mlp
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = literal.model.language_model.layers[0].mlp(hidden, task_ids=torch.tensor([1, 1]))
        assert torch.equal(output, 2 * dense(hidden))


def test_copy_half_without_a_shared_expert_is_rejected_naming_the_construction_to_use(llama_source):
    _, folder = llama_source
    with pytest.raises(ValueError, match=r"needs one: keep the shared expert .*, or use --construction copy \(construction='copy'\)"):
        convert_llama_to_mote(folder, experts=["a", "b"], construction="copy_half", num_shared_experts=0)
    model, report = convert_llama_to_mote(folder, experts=["a", "b"], num_shared_experts=0)
    assert report["max_abs_diff"] == 0.0 and model.config.mote_num_shared_experts == 0


# --- the split construction (spec §5.3, §9.10) --------------------------------------------------------------------


def test_split_groups_partition_the_neurons():
    groups = split_groups(128, 6, torch.Generator().manual_seed(0))  # 128 % 6 != 0
    assert sorted(torch.cat(groups).tolist()) == list(range(128))
    assert {len(group) for group in groups} == {21, 22}
    with pytest.raises(ValueError, match="at least one neuron per expert"):
        split_groups(4, 6, torch.Generator())


@pytest.mark.parametrize("layout, mlp_class", [(LLAMA_FFN, LlamaMLP), (GLM_FFN, GlmOcrTextMLP)])
def test_split_experts_sum_to_the_dense_ffn(layout, mlp_class):
    config = LlamaConfig(**TINY_LLAMA)  # hidden 64, intermediate 128: the fields both FFN classes read
    torch.manual_seed(0)
    dense = mlp_class(config)
    names = ["a", "b", "c", "d", "e"]
    tensors = build_experts(dense.state_dict(), layout, names, "split", 1, torch.Generator().manual_seed(0))
    expert_config = LlamaConfig(**TINY_LLAMA | dict(intermediate_size=22))  # ceil(128 / 6), smaller groups padded
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    total = torch.zeros(3, 64)
    for owner in ["shared_expert"] + [f"experts.{name}" for name in names]:
        expert = mlp_class(expert_config)
        expert.load_state_dict({key.removeprefix(owner + "."): value for key, value in tensors.items()
                                if key.startswith(owner + ".")})
        with torch.no_grad():
            total += expert(hidden)
    with torch.no_grad():
        torch.testing.assert_close(total, dense(hidden), atol=1e-5, rtol=0)


def test_split_conversion_partitions_every_layer(llama_source):
    base, folder = llama_source
    model, report = convert_llama_to_mote(folder, construction="split")
    config = model.config
    assert config.mote_expert_intermediate_size == 22 and config.mote_init == {"experts": "split", "shared": "split"}
    assert report["max_abs_diff"] > 0  # no single route is the dense model
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    for layer, dense_layer in zip(model.model.layers, base.model.layers):
        ffn = layer.mlp
        with torch.no_grad():
            total = ffn.shared_expert(hidden) + sum(expert(hidden) for expert in ffn.experts.values())
            torch.testing.assert_close(total, dense_layer.mlp(hidden), atol=1e-5, rtol=0)


# --- Llama (+ SigLIP) -> LlamaMote / VideoLLM-MoTE (spec §5.2) -----------------------------------------------------


def test_llama_conversion_reproduces_the_dense_model_and_reloads(llama_source, tmp_path):
    base, folder = llama_source
    model, report = convert_llama_to_mote(folder)
    assert report["max_abs_diff"] == 0.0 and list(report["max_abs_diff_by_route"]) == COIN
    assert report["key_accounting"]["source_tensors"] == len(load_file(folder / "model.safetensors"))
    assert report["parameters"] == {"total": 328_000, "active": 131_392, "language_model_total": 328_000,
                                    "language_model_active": 131_392}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(3))
    generated = base.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids, task_ids=torch.tensor([4, 4]), max_new_tokens=8, do_sample=False),
                       generated)
    model.save_pretrained(tmp_path)
    reloaded = LlamaMoteForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.mote_expert_names == COIN
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids, task_ids=torch.tensor([1, 1])).logits, base(input_ids).logits)


def test_bfloat16_conversion_reproduces_the_bfloat16_model(llama_source):
    _, folder = llama_source
    model, report = convert_llama_to_mote(folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and report["max_abs_diff"] == 0.0


def test_sharded_sources_are_streamed_shard_by_shard(tmp_path):
    torch.manual_seed(2)
    base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    base.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, report = convert_llama_to_mote(tmp_path, experts=["a", "b"])
    assert report["max_abs_diff"] == 0.0 and report["key_accounting"]["source_tensors"] == 20


def test_videollm_conversion_copies_the_vision_tower_and_starts_a_projector(llama_source, siglip_source):
    base, folder = llama_source
    siglip, vision_folder = siglip_source
    model, report = convert_llama_to_mote(folder, vision=vision_folder, seed=3)
    config = model.config
    # the placeholder ids come from the Llama tokenizer
    assert (config.video_token, config.video_token_id, config.frame_token_interval_id) == (
        "<|reserved_special_token_0|>", 120, 121)
    assert report["max_abs_diff"] == 0.0 and report["max_abs_diff_by_route"]["vision_tower"] == 0.0
    state = model.state_dict()
    for key, value in siglip.vision_model.state_dict().items():
        assert torch.equal(state[f"model.vision_tower.{key}"], value)
    accounting = report["key_accounting"]
    assert all(key.startswith(("text_model.", "logit_")) for key in accounting["dropped"])
    assert len(accounting["dropped"]) == sum(1 for key in siglip.state_dict() if not key.startswith("vision_model."))
    assert set(accounting["initialised"]) == {
        f"model.multi_modal_projector.linear_{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")
    }
    assert not model.model.multi_modal_projector.linear_1.bias.any()
    again, _ = convert_llama_to_mote(folder, vision=vision_folder, seed=3, verify=False)
    projector, projector_again = model.model.multi_modal_projector, again.model.multi_modal_projector
    assert torch.equal(projector_again.linear_2.weight, projector.linear_2.weight)
    for key, value in base.state_dict().items():
        target = key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
        if ".mlp." not in key:
            assert torch.equal(state[target], value), key
    with torch.no_grad():  # 3 text tokens, two frames of 10 <v> with "," between, 3 text tokens
        assert model(**synthetic_video_inputs(config), task_ids=torch.tensor([0, 3])).logits.shape == (2, 27, 128)


# --- bad sources and options ---------------------------------------------------------------------------------------


def copy_source(folder, destination, drop=(), add=None):
    destination.mkdir()
    (destination / "config.json").write_text((folder / "config.json").read_text())
    tensors = {key: value for key, value in load_file(folder / "model.safetensors").items() if key not in drop}
    save_file(tensors | (add or {}), destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_a_source_without_the_ffn_tensors_fails_naming_them(llama_source, tmp_path):
    _, folder = llama_source
    broken = copy_source(folder, tmp_path / "broken", drop={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"lacks the FFN tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_llama_to_mote(broken, verify=False)


def test_unexpected_and_mismatched_tensors_fail(llama_source, tmp_path):
    _, folder = llama_source
    extra = copy_source(folder, tmp_path / "extra", add={"model.layers.0.adapter.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="model.layers.0.adapter.weight .* unexpected"):
        convert_llama_to_mote(extra, verify=False)
    resized = copy_source(folder, tmp_path / "resized", drop={"model.norm.weight"},
                          add={"model.norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(32,\)"):
        convert_llama_to_mote(resized, verify=False)


def test_sources_of_the_wrong_kind_are_rejected(glm_source, llama_source, tmp_path):
    _, glm_folder, _ = glm_source
    _, llama_folder = llama_source
    with pytest.raises(ValueError, match="not a Llama checkpoint"):
        convert_llama_to_mote(glm_folder, verify=False)
    with pytest.raises(ValueError, match="not a GLM-OCR checkpoint"):
        convert_glm_ocr_to_mote(llama_folder, verify=False)
    with pytest.raises(ValueError, match="not a FixRes SigLIP"):
        convert_llama_to_mote(llama_folder, vision=llama_folder, verify=False)
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        convert_llama_to_mote(tmp_path, verify=False)
    with pytest.raises(ValueError, match=r"--construction half \(construction='half'\) is not one of"):
        convert_llama_to_mote(llama_folder, construction="half", verify=False)
    with pytest.raises(ValueError, match="mote_default_route='ocr' is not an expert"):
        convert_glm_ocr_to_mote(glm_folder, experts=["text", "kie"], verify=False)


@pytest.mark.parametrize("text, message", [("Step,next", "not valid"), ("a,a", "already exists"), (",", "names no")])
def test_bad_expert_lists_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_experts(text)


# --- the command-line pair -----------------------------------------------------------------------------------------


def test_cli_options_reach_the_glm_ocr_converter(glm_source):
    _, folder, _ = glm_source
    parser = argparse.ArgumentParser()
    mote_glm_ocr.add_arguments(parser)
    options = vars(parser.parse_args(["--experts", "ocr,kie:read receipts,table", "--construction", "copy_half"]))
    assert options["experts"] == {"ocr": None, "kie": "read receipts", "table": None}
    assert options["default_route"] == "ocr" and options["verify"] and options["dtype"] is None  # the source's
    result = mote_glm_ocr.convert(folder, **options)
    assert result.processor is None  # the tiny source has no tokenizer
    assert result.provenance["max_abs_diff"] == 0.0 and result.provenance["construction"] == "copy_half"
    assert result.model.config.text_config.mote_expert_descriptions == {
        "ocr": "recognize and transcribe the text in the document", "kie": "read receipts"}


def videollm_online_checkpoint(folder, vision_size, text_size, lora_rank=2, lora_alpha=4, seed=0):
    """A checkpoint in VideoLLM-online's PEFT layout: the connector saved as a module to save, a LoRA on its first
    layer and one on the LLM's attention."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "connector.0.weight": (text_size, vision_size), "connector.0.bias": (text_size,),
        "connector.2.weight": (text_size, text_size), "connector.2.bias": (text_size,),
        "connector.0.lora_A.weight": (lora_rank, vision_size), "connector.0.lora_B.weight": (text_size, lora_rank),
        "model.layers.0.self_attn.q_proj.lora_A.weight": (lora_rank, text_size),
    }  # fmt: skip
    tensors = {f"base_model.model.{key}": torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"r": lora_rank, "lora_alpha": lora_alpha}))
    return {key.removeprefix("base_model.model."): tensor for key, tensor in tensors.items()}


def test_the_projector_can_be_videollm_onlines_connector_with_its_lora_merged(llama_source, siglip_source, tmp_path):
    _, folder = llama_source
    _, vision_folder = siglip_source
    online = videollm_online_checkpoint(tmp_path / "online", TINY_SIGLIP_VISION["hidden_size"],
                                        TINY_LLAMA["hidden_size"])  # fmt: skip
    model, report = convert_llama_to_mote(folder, vision=vision_folder, projector_from=tmp_path / "online")
    projector = model.model.multi_modal_projector
    lora = online["connector.0.lora_B.weight"] @ online["connector.0.lora_A.weight"]
    merged = online["connector.0.weight"] + 2.0 * lora  # lora_alpha / r = 4 / 2
    torch.testing.assert_close(projector.linear_1.weight, merged, atol=1e-6, rtol=0)
    assert torch.equal(projector.linear_1.bias, online["connector.0.bias"])
    assert torch.equal(projector.linear_2.weight, online["connector.2.weight"])
    assert report["projector_source"] == str(tmp_path / "online") and report["max_abs_diff"] == 0.0
    dropped = report["key_accounting"]["dropped"]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in dropped
    assert "merged" in dropped["base_model.model.connector.0.lora_A.weight"]
    assert not report["key_accounting"]["initialised"]

    (tmp_path / "online" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="carries a LoRA, but there is no .*adapter_config.json"):
        convert_llama_to_mote(folder, vision=vision_folder, projector_from=tmp_path / "online", verify=False)
    save_file({"connector.0.weight": online["connector.0.weight"]}, tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match="has no connector.0.bias, connector.2.weight, connector.2.bias"):
        convert_llama_to_mote(folder, vision=vision_folder, projector_from=tmp_path / "partial.safetensors",
                              verify=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs --vision \(vision=\)"):
        convert_llama_to_mote(folder, projector_from=tmp_path / "online", verify=False)


def test_a_glm_ocr_source_with_a_tokenizer_gets_the_mote_processor(glm_source, tmp_path):
    _, folder, _ = glm_source
    shutil.copytree(folder, tmp_path / "glm")
    build_tiny_glm_ocr_tokenizer(GlmOcrConfig(**TINY_GLM_OCR)).save_pretrained(tmp_path / "glm")
    result = mote_glm_ocr.convert(tmp_path / "glm", experts={"ocr": None, "kie": None}, verify=False)
    assert isinstance(result.processor, GlmOcrMoteProcessor) and result.processor.expert_names == ["ocr", "kie"]


def test_cli_options_reach_the_llama_converter(llama_source, siglip_source):
    _, folder = llama_source
    _, vision_folder = siglip_source
    parser = argparse.ArgumentParser()
    mote_llama.add_arguments(parser)
    options = vars(parser.parse_args(["--vision", str(vision_folder), "--mote-layers", "1", "--no-verify"]))
    result = mote_llama.convert(folder, **options)
    assert isinstance(result.processor, VideoLlmMoteProcessor)  # around the Llama tokenizer, saved with the model
    assert result.processor.frame_interval_token_id == 121 and result.processor.video_token_id == 120
    assert result.processor.expert_names == COIN
    assert result.provenance["max_abs_diff"] is None and result.provenance["experts"] == COIN
    text_config = result.model.config.text_config
    assert text_config.mote_layers == [1]
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in result.model.load().state_dict()
    dense = mote_llama.convert(folder, **vars(parser.parse_args(["--dense"])))  # the text-only dense baseline
    assert dense.model.model_class is LlamaMoteForCausalLM and dense.model.config.mote_expert_names == []
    assert dense.provenance["max_abs_diff"] == 0.0


def test_a_hub_source_is_recorded_by_its_repo_id_not_its_cache_path(llama_source, tmp_path, monkeypatch):
    _, folder = llama_source
    # The Hub cache's layout, as `snapshot_download` leaves it, read offline.
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--my-org--tiny-llama"
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = local_source("my-org/tiny-llama")  # what `moezoo convert --from my-org/tiny-llama` reads
    result = mote_llama.convert(snapshot, experts={"a": None, "b": None}, verify=False)
    save_conversion(result, find_converter("llama_mote", "llama"), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mote_base_model"] == "my-org/tiny-llama"
    provenance = read_provenance(tmp_path / "out")
    assert provenance["base_model"] == provenance["source"] == "my-org/tiny-llama"
    local = mote_llama.convert(folder, experts={"a": None}, verify=False)  # a folder is named by its path
    assert local.model.config.mote_base_model == local.provenance["base_model"] == str(folder)


def test_convert_to_the_mote_family_picks_the_member_from_the_source(llama_source, siglip_source, tmp_path, capfd):
    _, folder = llama_source
    _, vision_folder = siglip_source
    text = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", folder, "--out", tmp_path / "text",
                                      "--experts", "a,b")
    assert text.returncode == 0, text.stderr
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "llama_mote"
    assert read_provenance(tmp_path / "text")["converter"] == "mote-llama-text"
    video = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", folder, "--vision", vision_folder,
                                       "--out", tmp_path / "video", "--experts", "a,b")
    assert video.returncode == 0, video.stderr
    assert json.loads((tmp_path / "video" / "config.json").read_text())["model_type"] == "videollm_mote"
    assert VideoLlmMoteProcessor.from_pretrained(tmp_path / "video").expert_names == ["a", "b"]  # ready to train
    wrong = run_moezoo_in_this_process(capfd, "convert", "--to", "videollm_mote", "--from", folder, "--out",
                                       tmp_path / "wrong")
    assert wrong.returncode != 0 and "produced a llama_mote model" in " ".join(wrong.stderr.split())
    assert not (tmp_path / "wrong").exists()
    with pytest.raises(KeyError, match="and the families mote"):
        architectures_named("motes")
