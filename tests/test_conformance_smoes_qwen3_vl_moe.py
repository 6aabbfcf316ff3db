"""transformers' common model, generation and configuration tests applied to SMoES on Qwen3-VL-MoE: the Qwen3.5-MoE
host's conformance test (tests/test_conformance_smoes.py, with its reentrant-checkpointing override and its skip)
run with a Qwen3-VL-MoE tester, whose every layer is softmax attention (so transformers' own `test_attention_outputs`
applies) and whose vision tower feeds DeepStack. SMoES is on in the tester's config (attention scores, two bins), so
the common training tests run its losses and bookkeeping. Overrides: transformers' own `test_attention_outputs`, the
reverse-mapping test without key changes (Qwen3-VL-MoE's conversion transposes tensors under their names), and a skip
for a failure of transformers' Qwen3-VL-MoE itself (the reason says which).
"""

import unittest
from unittest.mock import patch

from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

import test_conformance_smoes
from moezoo.configuration.smoes import SmoesQwen3VLMoeConfig
from moezoo.modeling.smoes import SmoesQwen3VLMoeForConditionalGeneration, SmoesQwen3VLMoeModel
from transformers_tests.test_modeling_common import ModelTesterMixin


LISTED_AS_BASE_MODEL = patch.dict(MODEL_MAPPING_NAMES, {"smoes_qwen3_vl_moe": "SmoesQwen3VLMoeModel"})
LISTED_AS_IMAGE_TEXT_TO_TEXT = patch.dict(
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, {"smoes_qwen3_vl_moe": "SmoesQwen3VLMoeForConditionalGeneration"}
)


class SmoesQwen3VLMoeModelTester(test_conformance_smoes.SmoesQwen3_5MoeModelTester):
    """The Qwen3.5-MoE host's tester (seven rows, one image token per row after a vision start marker) with a
    Qwen3-VL-MoE: two softmax-attention layers, 8 experts top-2 without a shared expert, a 2-block vision tower whose
    16x16 images are one patch and whose both blocks feed DeepStack."""

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.text_config = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=2, head_dim=8, intermediate_size=37,
            max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=self.pad_token_id,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                 mrope_interleaved=True),
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
            smoes_score_type="attention", smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=0.1,
        )  # fmt: skip
        self.vision_config = dict(
            depth=2, in_channels=3, hidden_act="gelu_pytorch_tanh", hidden_size=32, intermediate_size=32,
            out_hidden_size=self.hidden_size, num_heads=4, patch_size=16, spatial_merge_size=1, temporal_patch_size=2,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        )  # fmt: skip

    def get_config(self) -> SmoesQwen3VLMoeConfig:
        return SmoesQwen3VLMoeConfig(text_config=self.text_config, vision_config=self.vision_config, **self.token_ids)


@LISTED_AS_BASE_MODEL
@LISTED_AS_IMAGE_TEXT_TO_TEXT
class SmoesQwen3VLMoeModelTest(test_conformance_smoes.SmoesQwen3_5MoeModelTest):
    all_model_classes = (SmoesQwen3VLMoeModel, SmoesQwen3VLMoeForConditionalGeneration)
    model_tester_class = SmoesQwen3VLMoeModelTester
    test_attention_outputs = ModelTesterMixin.test_attention_outputs

    def test_reverse_loading_mapping(self):
        """Qwen3-VL-MoE's checkpoint conversion transposes the fused experts under their own names: no key changes."""
        super().test_reverse_loading_mapping(check_keys_were_modified=False)

    @unittest.skip(
        reason="transformers 5.24's Qwen3VLMoeForConditionalGeneration fails it with the same error (a shape mismatch "
        "in the step continued from the cache with the full attention_mask and no position_ids; checked with this "
        "tester's config without the smoes_* fields); generate(), which passes position ids, is tested by the other "
        "generation checks"
    )
    def test_forward_continues_from_cache_under_both_names(self):
        pass
