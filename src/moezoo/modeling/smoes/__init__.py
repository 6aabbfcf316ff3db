"""SMoES hosts: zoo and transformers MoE models trained with the SMoES regulariser of `moezoo.modeling.moe.smoes`."""

from .qwen3_5_moe import (
    SmoesQwen3_5MoeCausalLMOutputWithPast,
    SmoesQwen3_5MoeForConditionalGeneration,
    SmoesQwen3_5MoeModel,
    SmoesQwen3_5MoePreTrainedModel,
    SmoesQwen3_5MoeTextModel,
)


__all__ = [
    "SmoesQwen3_5MoeCausalLMOutputWithPast",
    "SmoesQwen3_5MoeForConditionalGeneration",
    "SmoesQwen3_5MoeModel",
    "SmoesQwen3_5MoePreTrainedModel",
    "SmoesQwen3_5MoeTextModel",
]
