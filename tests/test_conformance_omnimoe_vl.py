"""transformers' common model, generation and configuration tests applied to OmniMoE-VL, as transformers applies them to
its LLaVA-style VLMs (`tests/models/llava/test_modeling_llava.py` of transformers 5.24: a tiny vision tower whose
patches fill image placeholders at the start of every row).

The tester is a 32-wide, two-layer Qwen3-MoE decoder (MoE on layer 0, 4 experts top-2) and a 2-block SigLIP tower
(MoE on block 0, 4 experts top-1) on 16x16 images of 8-pixel patches: 4 image tokens per row, two streams (taps after
blocks 1 and 2) anchored before both decoder layers, top-1 of 2 depths. The injection gate is non-zero,
so every test runs the routed injection as well as the fusion. Each row carries the `prompt_mask` a processor gives
(the question after the image), which the common tests extend with zeros where they append or prepend tokens. Skips are
only those of the common tests themselves (GPU, Flash Attention, slow, not applicable); none is added here.
"""

import unittest

import torch

from moezoo.configuration.omnimoe_vl import OmniMoeVlConfig
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration, OmniMoeVlModel
from transformers_tests.generation.test_utils import GenerationTesterMixin
from transformers_tests.routed_experts import RoutedExpertsTests
from transformers_tests.test_configuration_common import ConfigTester
from transformers_tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor
from transformers_tests.zoo import ListedInTransformersMappings


class OmniMoeVlModelTester:
    def __init__(self, parent, batch_size=3, seq_length=7, image_size=16, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.is_training = is_training
        self.text_config = dict(
            vocab_size=99, hidden_size=32, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[1], max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        self.vision_config = dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
            patch_size=8, num_experts=4, moe_layers=[0],
        )
        self.token_ids = dict(image_token_id=3, vision_start_token_id=4, vision_end_token_id=5)
        self.num_image_tokens = (image_size // self.vision_config["patch_size"]) ** 2
        self.seq_length = seq_length + self.num_image_tokens + 2
        self.vocab_size = self.text_config["vocab_size"]
        self.hidden_size = self.text_config["hidden_size"]
        self.num_hidden_layers = self.text_config["num_hidden_layers"]
        self.num_attention_heads = self.text_config["num_attention_heads"]

    def get_config(self) -> OmniMoeVlConfig:
        return OmniMoeVlConfig(
            text_config=self.text_config, vision_config=self.vision_config, vision_feature_layers=[1, 2],
            injection_layers=[0, 1], num_query_prototypes=4, num_router_queries=2, depth_top_k=1, fusion_top_k=1,
            fusion_group_size=2, injection_rank=2, adapter_rank=2, projector_attn_dim=16, projector_attn_heads=2,
            depth_score_hidden=8, injection_gate_init=0.5, injection_max_relative_norm=None, exploration_steps=0,
            **self.token_ids,
        )

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        for token_id in self.token_ids.values():
            input_ids[input_ids == token_id] = config.text_config.pad_token_id
        input_ids[:, 0] = config.vision_start_token_id
        input_ids[:, 1 : 1 + self.num_image_tokens] = config.image_token_id
        input_ids[:, 1 + self.num_image_tokens] = config.vision_end_token_id
        # What the processor marks as the question: the text after the image (spec §6).
        prompt_mask = torch.zeros_like(input_ids)
        prompt_mask[:, 2 + self.num_image_tokens :] = 1
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "pixel_values": floats_tensor([self.batch_size, 3, self.image_size, self.image_size]),
            "prompt_mask": prompt_mask,
        }
        return config, inputs


class OmniMoeVlModelTest(
    ListedInTransformersMappings, RoutedExpertsTests, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase
):
    all_model_classes = (OmniMoeVlModel, OmniMoeVlForConditionalGeneration)
    _is_composite = True

    def setUp(self):
        super().setUp()
        self.model_tester = OmniMoeVlModelTester(self)
        self.config_tester = ConfigTester(self, config_class=OmniMoeVlConfig, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()
