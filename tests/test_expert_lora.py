"""Expert LoRA (`moezoo.training.expert_lora`): per-expert `GroupedExpertLoRA` adapters compute what PEFT's
`LoraConfig(target_parameters=...)` computes for the same A / B values (so that SMoES, OmniMoE-VL and MoE-ViE, which
used PEFT's, keep their recipe), on both fused experts classes of the core, and an unmerged adapter round-trips
through `save_pretrained` / `from_pretrained` onto a fresh model."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from moezoo.modeling.moe import MoeLayerSpec
from moezoo.modeling.moe.experts import EXPERTS_CLASSES
from moezoo.training.expert_lora import (
    EXPERT_LORA_FILE,
    EXPERT_WEIGHTS,
    ExpertLoraModel,
    add_expert_adapters,
    expert_adapters,
    merge_lora,
    peft_target_modules,
)
from test_moe_core import experts_config, randomize

RANK, ALPHA, NUM_EXPERTS = 2, 4, 4


class ExpertsHolder(nn.Module):
    """A fused experts module under the name `experts`, as in the models' MoE blocks."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    @property
    def device(self) -> torch.device:  # as a PreTrainedModel's, which `ExpertLoraModel.load_adapter` reads
        return self.experts.down_proj.device

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_index, top_k_weights)


def experts_of(expert_type: str) -> nn.Module:
    spec = MoeLayerSpec(hidden_size=8, num_experts=NUM_EXPERTS, num_experts_per_tok=2, expert_intermediate_size=6,
                        expert_type=expert_type, hidden_act="silu" if expert_type == "swiglu" else "gelu")  # fmt: skip
    return randomize(EXPERTS_CLASSES[expert_type](experts_config(), spec))


def routed_tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(10, 8, generator=generator)
    top_k_index = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:2] for _ in range(10)])
    return hidden, top_k_index, torch.rand(10, 2, generator=generator)


def ours(experts: nn.Module) -> ExpertLoraModel:
    """Our per-expert adapters on a copy of `experts`, in the PEFT model the recipes use (no PEFT layer here)."""
    model = ExpertLoraModel(ExpertsHolder(copy.deepcopy(experts)),
                            LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=peft_target_modules([])))  # fmt: skip
    add_expert_adapters(model.get_base_model(), RANK, ALPHA)
    return model


@pytest.mark.parametrize("expert_type", ["swiglu", "gelu"])
def test_per_expert_adapters_compute_peft_target_parameters_lora(expert_type):
    experts = experts_of(expert_type)
    names = EXPERT_WEIGHTS[type(experts)]
    peft = PeftModel(ExpertsHolder(copy.deepcopy(experts)),
                     LoraConfig(r=RANK, lora_alpha=ALPHA, target_parameters=[f"experts.{name}" for name in names]))
    model = ours(experts)
    adapters = expert_adapters(model.get_base_model())
    assert sorted(adapters) == sorted(f"experts.{name}" for name in names)  # the GELU biases stay untouched
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for wrapper in (module for module in peft.modules() if isinstance(module, ParamWrapper)):
            lora_A, lora_B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
            lora_A.copy_(torch.randn(lora_A.shape, generator=generator))
            lora_B.copy_(torch.randn(lora_B.shape, generator=generator))  # PEFT starts B at zero: make it count
            # PEFT's factors: A rows are (expert, rank), B columns are (rank, expert)
            adapter = adapters[f"experts.{wrapper.parameter_name}"]
            adapter.lora_A.copy_(lora_A.reshape(NUM_EXPERTS, RANK, -1))
            adapter.lora_B.copy_(lora_B.reshape(len(lora_B), RANK, NUM_EXPERTS).permute(2, 0, 1))
    tokens = routed_tokens()
    torch.testing.assert_close(model(*tokens), peft(*tokens))
    assert not torch.allclose(model(*tokens), experts(*tokens))  # the adapters change the experts
    merged, peft_merged = merge_lora(model), peft.merge_and_unload()
    for name, parameter in peft_merged.named_parameters():
        torch.testing.assert_close(merged.get_parameter(name), parameter)
    assert not any(isinstance(module, ParamWrapper) for module in peft_merged.modules())


def test_unmerged_expert_adapters_round_trip(tmp_path):
    experts = experts_of("gelu")
    model = ours(experts)
    with torch.no_grad():
        for adapter in expert_adapters(model.get_base_model()).values():  # as if trained
            adapter.lora_B.normal_(generator=torch.Generator().manual_seed(3))
    tokens = routed_tokens()
    expected = model(*tokens)
    model.save_pretrained(tmp_path)
    assert (tmp_path / EXPERT_LORA_FILE).is_file()
    reloaded = ExpertLoraModel.from_pretrained(ExpertsHolder(copy.deepcopy(experts)), tmp_path, is_trainable=True)
    torch.testing.assert_close(reloaded(*tokens), expected)
    assert all(parameter.requires_grad for adapter in expert_adapters(reloaded.get_base_model()).values()
               for parameter in adapter.parameters())  # fmt: skip
    torch.testing.assert_close(merge_lora(reloaded)(*tokens), expected)


def test_adapting_a_weight_that_is_no_fused_expert_weight_names_it():
    with pytest.raises(ValueError, match="experts.up_proj_bias is no fused expert weight"):
        add_expert_adapters(ExpertsHolder(experts_of("gelu")), RANK, ALPHA, weights=["experts.up_proj_bias"])
