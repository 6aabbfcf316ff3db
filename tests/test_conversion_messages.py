"""What the converters tell a user: options named as flags and keywords, short errors, no minutes of Hub retries,
no LOAD REPORT tables after a successful conversion."""

import json
import time

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    SiglipConfig,
    SiglipModel,
)

from conftest import free_port, run_moezoo
from moe_vie_reference import make_official_state_dict, official_model_config
from moezoo.configuration.mote import TINY_LLAMA, TINY_SIGLIP_VISION
from moezoo.conversion import moe_vie_upcycle
from moezoo.conversion.moemb_qwen3_5 import convert as convert_to_moemb
from moezoo.conversion.moemb_qwen3_5 import convert_qwen3_5_checkpoint
from moezoo.conversion.mote_llama import convert_llama_to_mote
from test_moemb_conversion import EMB, source_config


TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def qwen_source(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**source_config())).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def siglip_folder(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("siglip")
    SiglipModel(SiglipConfig(vision_config=TINY_SIGLIP_VISION, text_config=TINY_TEXT)).save_pretrained(folder)
    return folder


def test_moemb_errors_name_the_flags_and_the_keywords(qwen_source, tmp_path):
    with pytest.raises(ValueError, match=r"pass --emb-token-id \(emb_token_id=\)"):
        convert_qwen3_5_checkpoint(qwen_source, tmp_path / "out")
    with pytest.raises(ValueError, match=r"--num-experts \(num_experts=\), --top-k \(top_k=\) only apply to "
                                         r"--variant upcycled"):
        convert_qwen3_5_checkpoint(qwen_source, tmp_path / "out", emb_token_id=EMB, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=r"--variant upcycled \(variant='upcycled'\) converts a 'qwen3_5' checkpoint"):
        convert_qwen3_5_checkpoint(qwen_source, tmp_path / "out", "upcycled", emb_token_id=EMB)


def test_upcycling_errors_name_the_flags(siglip_folder):
    with pytest.raises(ValueError, match=r"--top-k 1 \(top_k=1\) must lie between"):
        moe_vie_upcycle.upcycle_siglip_checkpoint(siglip_folder, top_k=1)


def test_a_siglip_source_without_a_tokenizer_fails_in_a_few_lines(siglip_folder):
    with pytest.raises(FileNotFoundError) as error:
        moe_vie_upcycle.convert(siglip_folder)
    message = str(error.value)
    assert "pass --tokenizer" in message and "\n" not in message and len(message) < 600


def test_the_official_converter_fails_fast_without_a_reachable_hub(tmp_path):
    folder = tmp_path / "official"
    folder.mkdir()
    torch.save({f"module.{key}": value for key, value in make_official_state_dict(seed=1).items()},
               folder / "MoEViE-tiny.pt")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": official_model_config()}))
    port = free_port()
    start = time.monotonic()
    result = run_moezoo("convert", "--to", "moe_vie", "--from", folder, "--out", tmp_path / "out",
                        env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")}, timeout=120)
    assert time.monotonic() - start < 60  # huggingface_hub's own retries would take minutes
    stderr = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in stderr
    assert "--tokenizer" in stderr and "HF_HUB_OFFLINE=1" in stderr and "Traceback" not in stderr


def test_successful_conversions_print_no_load_report(qwen_source, siglip_folder, tmp_path, capfd):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "llama")
    capfd.readouterr()
    convert_llama_to_mote(tmp_path / "llama", experts=["a", "b"], vision=siglip_folder, video_token_id=5,
                          frame_token_interval_id=6)
    convert_to_moemb(qwen_source, emb_token_id=EMB)  # measures against the source, whose lm_head it does not load
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_a_bad_max_shard_size_is_refused_while_parsing(tmp_path):
    result = run_moezoo("export", tmp_path / "missing", "--out", tmp_path / "out", "--max-shard-size", "abc")
    assert result.returncode == 2
    assert "'abc' is not a size: write it like 5GB" in result.stderr and "missing" not in result.stderr
