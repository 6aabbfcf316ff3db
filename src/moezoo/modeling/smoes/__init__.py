"""SMoES hosts: zoo and transformers MoE models trained with the SMoES regulariser of `moezoo.modeling.moe.smoes`.

    common.py        what the Qwen-style VLM hosts share (sparse block, decoder layer, models, training forward)
    qwen3_5_moe.py   transformers' Qwen3.5-MoE VLM (hybrid Gated DeltaNet / softmax attention, shared expert)
    qwen3_vl_moe.py  transformers' Qwen3-VL-MoE VLM (softmax attention, DeepStack, no shared expert)
"""

from .common import SmoesCausalLMOutputWithPast
from .qwen3_5_moe import (
    SmoesQwen3_5MoeCausalLMOutputWithPast,
    SmoesQwen3_5MoeForConditionalGeneration,
    SmoesQwen3_5MoeModel,
    SmoesQwen3_5MoePreTrainedModel,
    SmoesQwen3_5MoeTextModel,
)
from .qwen3_vl_moe import (
    SmoesQwen3VLMoeCausalLMOutputWithPast,
    SmoesQwen3VLMoeForConditionalGeneration,
    SmoesQwen3VLMoeModel,
    SmoesQwen3VLMoePreTrainedModel,
    SmoesQwen3VLMoeTextModel,
)


__all__ = [
    "SmoesCausalLMOutputWithPast",
    "SmoesQwen3VLMoeCausalLMOutputWithPast",
    "SmoesQwen3VLMoeForConditionalGeneration",
    "SmoesQwen3VLMoeModel",
    "SmoesQwen3VLMoePreTrainedModel",
    "SmoesQwen3VLMoeTextModel",
    "SmoesQwen3_5MoeCausalLMOutputWithPast",
    "SmoesQwen3_5MoeForConditionalGeneration",
    "SmoesQwen3_5MoeModel",
    "SmoesQwen3_5MoePreTrainedModel",
    "SmoesQwen3_5MoeTextModel",
]
