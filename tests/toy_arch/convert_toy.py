"""A toy converter: a checkpoint that stores experts one by one (like Qwen3-MoE on disk) -> fused experts."""

import json
import re

import torch
from safetensors.torch import load_file

from moezoo.conversion.common import ConversionResult

from .configuration_toy import ToyMoeConfig
from .modeling_toy import ToyMoeModel
from .processing_toy import make_toy_processor


PER_EXPERT = re.compile(r"blocks\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def add_arguments(parser):
    parser.add_argument("--num-labels", type=int, default=2, help="stored in the config")


def convert_per_expert(source, num_labels=2):
    fields = json.loads((source / "config.json").read_text())
    fields.pop("model_type")
    config = ToyMoeConfig(**fields, num_labels=num_labels)
    tensors = load_file(source / "weights.safetensors")
    model = ToyMoeModel(config)
    state = model.state_dict()
    fused = {}
    for key, tensor in tensors.items():
        match = PER_EXPERT.fullmatch(key)
        if match is None:
            if key not in state:
                raise ValueError(f"unexpected tensor {key} in {source}")
            fused[key] = tensor
            continue
        layer, expert, kind = int(match[1]), int(match[2]), match[3]
        fused.setdefault(f"blocks.{layer}.experts.parts", {})[(expert, kind)] = tensor
    for layer in range(config.num_hidden_layers):
        parts = fused.pop(f"blocks.{layer}.experts.parts")
        experts = range(config.num_experts)
        fused[f"blocks.{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts])
        fused[f"blocks.{layer}.experts.down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    missing = sorted(set(state) - set(fused))
    if missing:
        raise ValueError(f"{source} lacks {missing}")
    model.load_state_dict(fused, strict=True)
    return ConversionResult(model, make_toy_processor(config),
                            {"source": str(source), "max_abs_diff": 0.0, "license": "apache-2.0"})
