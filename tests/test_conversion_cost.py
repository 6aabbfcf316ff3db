"""Issue 29, items 2 and 4 across the converters: one `--dtype` (default: the source's) that the written config states,
a narrowing cast refused naming the tensor, `moezoo convert --dry-run` and `moezoo list --memory` saying the cost
without reading a weight, and a conversion that would not fit on its disk refused before it starts. Tiny Llama sources,
in-process `moezoo` calls."""

import json
import shutil
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import run_moezoo, run_moezoo_in_this_process, run_python
from moezoo.cli import _converter_options_parser
from moezoo.configuration.mote import TINY_LLAMA
from moezoo.conversion import cost as cost_module
from moezoo.conversion.cost import conversion_cost
from moezoo.registry import CONVERTERS
from test_hub import fake_hub  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A tiny Llama saved in bfloat16, as the Hub's releases are."""
    folder = tmp_path_factory.mktemp("sources") / "llama-bf16"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture()
def out_of_range_llama(bf16_llama, tmp_path):
    """The bf16 Llama with one value float16 cannot hold (bf16 reaches 3e38, fp16 65504)."""
    model = LlamaForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[0] = 1e5
    model.save_pretrained(tmp_path / "llama-big")
    return tmp_path / "llama-big"


@pytest.mark.parametrize("name", sorted(CONVERTERS))
def test_every_converter_has_the_same_dtype_option(name):
    converter = CONVERTERS[name]
    action = next(action for action in _converter_options_parser(converter, converter.architecture)._actions
                  if "--dtype" in action.option_strings)  # fmt: skip
    assert (action.choices, action.default) == (["float32", "bfloat16", "float16"], None)
    assert action.help.endswith("(default: the source's)")
    assert converter.plan is not None  # every converter of the zoo says its cost


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_the_source_dtype_or_the_one_asked_for_is_written_and_stated(bf16_llama, tmp_path, capfd, dtype):
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", bf16_llama, "--out",
                                        tmp_path / "out", "--no-verify", *(["--dtype", dtype] if dtype else []))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == dtype or "bfloat16"
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(key).get_dtype() for key in weights.keys()} == {"F32" if dtype else "BF16"}


def test_a_value_fp16_cannot_hold_is_refused_naming_the_tensor(out_of_range_llama, tmp_path, capfd):
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", out_of_range_llama, "--out",
                                        tmp_path / "out", "--dtype", "float16", "--no-verify")
    assert result.returncode == 2
    assert "model.layers.0.input_layernorm.weight" in result.stderr and "--dtype float16" in result.stderr, (
        result.stderr)
    assert "Traceback" not in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama-big"]  # nothing left behind


def test_dry_run_says_the_cost_without_writing(bf16_llama, tmp_path, capfd):
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", bf16_llama, "--out",
                                        tmp_path / "out", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "peak memory" in result.stdout and "bfloat16" in result.stdout and "enough" in result.stdout
    assert "2 x the largest source tensor" in result.stdout
    assert not (tmp_path / "out").exists()


def test_the_estimate_matches_what_the_conversion_writes(bf16_llama, tmp_path, capfd):
    converter = CONVERTERS["mote-llama"]
    options = vars(_converter_options_parser(converter, "llama_mote").parse_args([]))
    cost = conversion_cost(converter, bf16_llama, options)
    assert run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", bf16_llama, "--out",
                                      tmp_path / "out", "--no-verify").returncode == 0
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as weights:
        written = {key: weights.get_tensor(key) for key in weights.keys()}
    assert cost.disk_bytes == sum(tensor.numel() * tensor.element_size() for tensor in written.values())
    assert cost.parameters == sum(tensor.numel() for tensor in written.values())
    embedding = TINY_LLAMA["vocab_size"] * TINY_LLAMA["hidden_size"] * 2  # the largest tensor, in bf16
    assert cost.largest_source_tensor_bytes == embedding
    assert cost.peak_memory_bytes == 2 * embedding + cost.disk_bytes  # one shard holds the whole tiny output


def test_a_conversion_that_does_not_fit_on_disk_is_refused(bf16_llama, tmp_path, capfd, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cost_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", bf16_llama, "--out",
                                        tmp_path / "out", "--no-verify")
    assert result.returncode == 2
    assert "1 KB free" in result.stderr and "needs" in result.stderr and "on disk" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_list_memory_gives_each_preset_its_size_by_dtype(capfd):
    result = run_moezoo_in_this_process(capfd, "list", "--memory", "--json")
    assert result.returncode == 0, result.stderr
    presets = {entry["name"]: entry for entry in json.loads(result.stdout)}
    sizes = presets["tiny-llama_mote"]["size_bytes"] if "tiny-llama_mote" in presets else next(
        entry["size_bytes"] for entry in presets.values() if entry["architecture"] == "llama_mote")
    assert sizes["float32"] == 2 * sizes["bfloat16"] == 2 * sizes["float16"]
    paper = presets["smoes-qwen3.5-35b-a3b"]["size_bytes"]["bfloat16"]
    assert 60e9 < paper < 80e9  # Qwen3.5-35B-A3B in bf16
    table = run_moezoo_in_this_process(capfd, "list", "--memory")
    assert table.returncode == 0 and "bfloat16" in table.stdout


def test_disk_space_is_read_where_the_folder_will_be(tmp_path):
    folder, free = cost_module.free_disk_space(tmp_path / "not" / "yet" / "there")
    assert folder == tmp_path and free == shutil.disk_usage(tmp_path).free


def test_a_corrupt_pytorch_checkpoint_is_named_in_one_line(tmp_path):
    from moezoo.conversion.dtypes import checkpoint_tensors

    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"broken\.pt is not a PyTorch checkpoint") as error:
        checkpoint_tensors(tmp_path / "broken.pt")
    assert "\n" not in str(error.value)


def test_the_streaming_writer_refuses_a_value_its_dtype_cannot_hold(tmp_path):
    """MoEMB's and OmniMoE-VL's converters write through `ShardWriter`: the same refusal, before a shard is written."""
    from moezoo.conversion.streaming import ShardWriter

    writer = ShardWriter(tmp_path, 10**6, torch.float16)
    writer.add("model.embed_tokens.weight", torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"model\.norm\.weight holds values up to 9\.984e\+04 .*--dtype float16"):
        writer.add("model.norm.weight", torch.tensor([1.0, 1e5], dtype=torch.bfloat16))
    assert not list(tmp_path.iterdir())


def test_dry_run_on_a_hub_repo_reads_headers_not_weights(bf16_llama, fake_hub, tmp_path, capfd):
    """`--dry-run --from ORG/NAME` downloads the configs and tokenizer and reads each safetensors header with a range
    request (`get_safetensors_metadata`): the cost is that of the local folder, and the Hub cache holds no weights."""
    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1  # the index and every shard's header are read
    run_python(f"""
        from huggingface_hub import HfApi
        HfApi().create_repo("zoo/llama-bf16")
        HfApi().upload_folder(repo_id="zoo/llama-bf16", folder_path={str(sharded)!r})
    """, env=fake_hub)
    from_hub = run_moezoo("convert", "--to", "mote", "--from", "zoo/llama-bf16", "--dry-run", env=fake_hub)
    assert from_hub.returncode == 0, from_hub.stderr
    local = run_moezoo_in_this_process(capfd, "convert", "--to", "mote", "--from", sharded, "--dry-run")
    cost_table = [line for line in local.stdout.splitlines() if "mote-llama" in line]
    assert cost_table and cost_table == [line for line in from_hub.stdout.splitlines() if "mote-llama" in line]
    cached = [path.name for path in (tmp_path / "hf").rglob("*") if path.is_file()]
    assert "config.json" in cached and not [name for name in cached if name.endswith(".safetensors")], cached
