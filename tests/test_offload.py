"""Every zoo model class loads larger than its memory the transformers way (issue 29 item 3):
`from_pretrained(folder, device_map="auto", max_memory={"cpu": a share of the model}, offload_folder=...)` puts part
of it on the disk, accelerate's hooks bring the offloaded weights back for each forward, and the outputs are those of
the model loaded whole (1e-5, fp32); the device map never splits a `_no_split_modules` layer, and every MoE block
(with its fused experts) lies inside one. MoEMB's other designs and its trained gates load the same way; an
`offload_folder` that cannot be written is refused in one line before anything is written (docs/hub.md#offloading).
"""

import copy
import os
import re

import pytest
import torch

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.registry import ARCHITECTURES, PRESETS, ZOO_ARCHITECTURES, resolve
from moezoo.zoo import create_from_preset

from test_backends_matrix import assert_same_outputs, run, sample_inputs


# MoEMB's designs beyond the tiny preset's native one, and its trained gates with the inference settings that run
# them (the gates get random weights, so a gate read from an empty offloaded weight would show).
MOEMB_DESIGNS = {
    "upcycled": {"moe_variant": "upcycled", "upcycle_granularity": 4},
    "modality": {"moe_variant": "modality", "modality_expert_map": {0: 0, 1: 1, 2: 1},
                 "text_config": dict(TINY_MOEMB["text_config"], num_experts=2, num_experts_per_tok=1)},
    "trained-gates": {
        "gates": {"token_pruner": True, "efficiency_head": "skip_gate", "layer_skip": True, "null_experts": 2},
        "adaptive": {"token_pruning": "learned", "expert_skip": "learned", "layer_skip": "learned",
                     "top_k": "null_experts"},
    },
}  # fmt: skip
GATES = ("efficiency_head", "skip_gate", "token_pruner", "null_router")
# The share of the model's bytes the CPU may hold; the rest goes to the disk. Half splits each model within a tower or
# its language model; OmniMoE-VL's projector is split (its injection kept on the CPU) at 30%; at half, Llama-MoTE's
# embeddings would leave no room for any layer beside the one accelerate keeps free for loading.
CPU_SHARE = {"omnimoe_vl": 0.3, "llama_mote": 0.7}


def tiny_preset(architecture: str) -> str:
    return next(p.name for p in PRESETS.values() if p.architecture == architecture and p.name.startswith("tiny-"))


CASES = [
    *(pytest.param(architecture, path, id=path.rpartition(":")[2])
      for architecture in ZOO_ARCHITECTURES for path in dict.fromkeys(ARCHITECTURES[architecture].models.values())),
    *(pytest.param(f"moemb-{design}", "moezoo.modeling.moemb:MoEmbForEmbedding", id=f"MoEmbForEmbedding-{design}")
      for design in MOEMB_DESIGNS),
]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each case's checkpoint folder and sample inputs, written once per module when a case first needs them."""
    made = {}

    def folder_and_inputs(case: str):
        if case not in made:
            out = tmp_path_factory.mktemp(case) / "model"
            if case.startswith("moemb-"):
                config = MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | MOEMB_DESIGNS[case.removeprefix("moemb-")]))
                torch.manual_seed(0)
                model = MoEmbForEmbedding(config)
                with torch.no_grad():
                    for name, parameter in model.named_parameters():
                        if any(gate in name for gate in GATES):
                            parameter.normal_(0, 0.5)
                model.save_pretrained(out)
                made[case] = out, sample_inputs("moemb", make_moemb_processor(config), config)
            else:
                create_from_preset(tiny_preset(case), out)
                entry = ARCHITECTURES[case]
                processor = resolve(entry.processor or entry.tokenizer).from_pretrained(out)
                made[case] = out, sample_inputs(case, processor, entry.config_class().from_pretrained(out))
        return made[case]

    return folder_and_inputs


def assert_layers_whole(model, device_map: dict) -> None:
    """No device-map entry lies inside a `_no_split_modules` layer, and every MoE block (a module with `experts`)
    lies inside one, so its experts, its router and its decoder layer share one device."""
    layers = [name for name, module in model.named_modules() if type(module).__name__ in model._no_split_modules]
    for layer in layers:
        inside = [entry for entry in device_map if entry.startswith(f"{layer}.")]
        assert not inside, f"{type(model).__name__}: layer {layer} is split: {inside}"
    blocks = [name for name, module in model.named_modules() if hasattr(module, "experts")]
    assert blocks, f"{type(model).__name__} has no MoE block"
    for block in blocks:
        assert any(block == layer or block.startswith(f"{layer}.") for layer in layers), (
            f"{type(model).__name__}: MoE block {block} lies in no `_no_split_modules` layer"
        )


@pytest.mark.parametrize("case, class_path", CASES)
def test_every_class_loads_partly_on_disk_with_the_outputs_of_a_whole_load(folders, case, class_path, tmp_path):
    folder, inputs = folders(case)
    model_class = resolve(class_path)
    whole = model_class.from_pretrained(folder).eval()
    expected = run(whole, inputs)
    size = sum(tensor.numel() * tensor.element_size() for tensor in whole.state_dict().values())
    share = CPU_SHARE.get(case, 0.5)
    what = f"{model_class.__name__} ({case}) with {share:.0%} of it on the CPU"
    model = model_class.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": int(share * size)}, offload_folder=tmp_path
    ).eval()
    device_map = model.hf_device_map
    assert set(device_map.values()) == {"cpu", "disk"}, f"{what}: {device_map}"
    assert_layers_whole(model, device_map)
    assert_same_outputs(run(model, inputs), expected, what)
    # The hooks load the disk's weights for a forward and drop them after it.
    assert any(parameter.is_meta for parameter in model.parameters()), what


def test_a_bf16_load_partly_on_disk_equals_the_whole_bf16_load(folders, tmp_path):
    """MoE-ViE keeps its routers' correction bias in fp32 whatever the load dtype (`_keep_in_fp32_modules_strict`)."""
    folder, inputs = folders("moe_vie")
    model_class = ARCHITECTURES["moe_vie"].model_class()
    whole = model_class.from_pretrained(folder, dtype=torch.bfloat16).eval()
    size = sum(tensor.numel() * tensor.element_size() for tensor in whole.state_dict().values())
    model = model_class.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                        max_memory={"cpu": size // 3}, offload_folder=tmp_path).eval()  # fmt: skip
    assert "disk" in model.hf_device_map.values()
    assert_same_outputs(run(model, inputs), run(whole, inputs), f"{model_class.__name__} in bf16")


@pytest.mark.parametrize("bad, problem", [("file", "is a file"), ("file/offload", "lies under the file")])
def test_an_offload_folder_that_cannot_be_written_is_refused_before_anything_is_written(folders, tmp_path, bad,
                                                                                        problem):
    folder, _ = folders("llama_mote")
    (tmp_path / "file").write_text("not a folder")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=f"^{re.escape(f'offload_folder {tmp_path / bad} {problem}')}"):
        ARCHITECTURES["llama_mote"].model_class().from_pretrained(
            folder, device_map="auto", max_memory={"cpu": 1000}, offload_folder=tmp_path / bad
        )
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_read_only_offload_folder_is_refused(folders, tmp_path):
    folder, _ = folders("llama_mote")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=f"^{re.escape(f'offload_folder {read_only} is not writable')}"):
        ARCHITECTURES["llama_mote"].model_class().from_pretrained(
            folder, device_map="auto", max_memory={"cpu": 1000}, offload_folder=read_only
        )
