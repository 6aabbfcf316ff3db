"""transformers' common model and configuration tests applied to MoEMB, as transformers applies them to Qwen3.5-MoE
(`tests/models/qwen3_5_moe/test_modeling_qwen3_5_moe.py` of transformers 5.24): its tester for the VLM (one image
token per row) on `MoEmbModel` and `MoEmbForEmbedding`, and its text-model test on `MoEmbTextModel` with
`MoEmbTextConfig`. MoEMB embeds and never generates, so no generation mixin applies.

Skips: only where that file skips the same test (quoted), or where the test needs a GPU or the network.
"""

import copy
import unittest
from unittest.mock import patch

import torch
from torch.nn import functional as F
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
from transformers.testing_utils import torch_device

from moezoo.configuration.moemb import MoEmbConfig, MoEmbTextConfig
from moezoo.modeling.moemb import MoEmbForEmbedding, MoEmbModel, MoEmbTextModel
from transformers_tests.routed_experts import RoutedExpertsTests
from transformers_tests.test_configuration_common import ConfigTester
from transformers_tests.test_modeling_common import (
    ModelTesterMixin,
    floats_tensor,
    ids_tensor,
    random_attention_mask,
)


# The common tests recognise base models (no loss to train on) by transformers' own name mapping, where
# `Qwen3_5MoeModel` and `Qwen3_5MoeTextModel` are listed; MoEMB's are listed the same way while their tests run.
AS_BASE_MODELS = patch.dict(MODEL_MAPPING_NAMES, {"moemb": "MoEmbModel", "moemb_text": "MoEmbTextModel"})

# What transformers' Qwen3.5-MoE file gives as its reasons for the same skips.
QWEN3_5_MOE_TEXT_NOT_REVERSIBLE = (
    "as transformers' Qwen3.5-MoE text-model test: 'Intentionally not reversable (no changes) as only load time within "
    "a VLM depends on this'"
)
QWEN3_5_MOE_NO_REVERSE_MAPPING = (
    "as transformers' Qwen3.5-MoE test: 'Conversion only for the `CausalLM` loading from saved `ConditionalLM`, "
    "doesn't apply to simple VLM' (no key mapping is registered for MoEMB either)"
)


# transformers' Qwen3.5-MoE testers' text model: one gated-attention and one Gated DeltaNet layer, 8 experts top-2 with
# the gated shared expert.
TEXT_CONFIG = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "layer_types": ["full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    # MoEMB checks that the MRoPE sections (time, height, width) sum to rotary_dim / 2 = 8 / 2.
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True,
    },
    "linear_conv_kernel_dim": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 36,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}  # fmt: skip


class MoEmbTextModelTester:
    """`MoEmbTextModel` alone, in the shape of transformers' `Qwen3_5MoeTextModelTester` (a `CausalLMModelTester`:
    batch 13, 7 tokens, a random padding mask) on the text config of the VLM tester below."""

    def __init__(self, parent, batch_size=13, seq_length=7):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.vocab_size = TEXT_CONFIG["vocab_size"]
        self.hidden_size = TEXT_CONFIG["hidden_size"]
        self.num_hidden_layers = TEXT_CONFIG["num_hidden_layers"]

    def get_config(self) -> MoEmbTextConfig:
        return MoEmbTextConfig(**TEXT_CONFIG)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": random_attention_mask(input_ids.shape)}


@AS_BASE_MODELS
class MoEmbTextModelTest(ModelTesterMixin, unittest.TestCase):
    """`MoEmbTextModel` and `MoEmbTextConfig`, as transformers' `Qwen3_5MoeTextModelTest` tests
    `Qwen3_5MoeTextModel` (without its causal-LM head, which MoEMB does not have)."""

    all_model_classes = (MoEmbTextModel,)

    def setUp(self):
        self.model_tester = MoEmbTextModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MoEmbTextConfig, hidden_size=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_attention_outputs(self):
        """transformers' override for the Qwen3.5-MoE text model: only the gated-attention layers return attention
        weights, asked for by argument or by the config, and they come last."""
        check_attention_outputs(self, lambda config: config)

    @unittest.skip(reason=QWEN3_5_MOE_TEXT_NOT_REVERSIBLE)
    def test_reverse_loading_mapping(self):
        pass


class MoEmbModelTester:
    """Tiny MoEMB in the shape of transformers' `Qwen3_5MoeVisionText2TextModelTester`: two text layers (one gated
    attention, one Gated DeltaNet), 8 experts top-2 with the gated shared expert, a 2-block vision tower whose 16x16
    images are one patch (one image token), and an `<emb>` token in every row (what MoEMB pools), followed by two
    text tokens: the common SDPA test masks the last two tokens of a row as right padding.

    Seven rows, where transformers' tester has three: the SDPA test cuts or extends every input it passes (pixels and
    grids too) to seven rows, with random values; only a batch of seven keeps ids, pixels and grids matching, and an
    `<emb>` in every row."""

    def __init__(self, parent, batch_size=7, seq_length=7, num_image_tokens=8, image_size=16):
        self.parent = parent
        self.batch_size = batch_size
        self.num_image_tokens = num_image_tokens  # text before the image token (transformers' tester: 32)
        self.seq_length = seq_length + num_image_tokens
        self.image_size = image_size
        self.is_training = True
        self.vocab_size = TEXT_CONFIG["vocab_size"]
        self.hidden_size = TEXT_CONFIG["hidden_size"]
        self.num_hidden_layers = TEXT_CONFIG["num_hidden_layers"]
        self.num_attention_heads = TEXT_CONFIG["num_attention_heads"]
        self.pad_token_id = TEXT_CONFIG["pad_token_id"]
        self.image_token_id, self.video_token_id = 3, 4
        self.vision_start_token_id, self.vision_end_token_id = 5, 6
        self.emb_token_id = 7
        self.text_config = TEXT_CONFIG
        self.vision_config = {
            "depth": 2,
            "in_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "intermediate_size": 32,
            "out_hidden_size": self.hidden_size,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 1,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
        }

    def get_config(self) -> MoEmbConfig:
        return MoEmbConfig(
            text_config=self.text_config,
            vision_config=self.vision_config,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
            emb_token_id=self.emb_token_id,
        )

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        special = [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id,
                   self.emb_token_id]  # fmt: skip
        input_ids[torch.isin(input_ids, torch.tensor(special, device=input_ids.device))] = self.pad_token_id
        input_ids[:, -3] = self.emb_token_id
        input_ids[:, self.num_image_tokens - 1] = self.vision_start_token_id
        input_ids[:, self.num_image_tokens] = self.image_token_id
        input_ids[:, self.num_image_tokens + 1] = self.vision_end_token_id
        vision = config.vision_config
        patches_per_image = (self.image_size // vision.patch_size) ** 2
        pixel_values = floats_tensor(
            [self.batch_size * patches_per_image, 3 * vision.temporal_patch_size * vision.patch_size**2]
        )
        return config, {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "pixel_values": pixel_values,
            "image_grid_thw": torch.tensor([[1, 1, 1]] * self.batch_size, device=torch_device),
            "mm_token_type_ids": (input_ids == self.image_token_id).long(),
        }


@AS_BASE_MODELS
class MoEmbModelTest(RoutedExpertsTests, ModelTesterMixin, unittest.TestCase):
    """`MoEmbModel` and `MoEmbForEmbedding` on text with an image, as transformers' `Qwen3_5MoeModelTest`."""

    all_model_classes = (MoEmbModel, MoEmbForEmbedding)
    # What the SDPA test passes besides input_ids (it cuts the batch to seven rows, the tester's batch).
    additional_model_inputs = ["pixel_values", "image_grid_thw", "mm_token_type_ids"]

    def setUp(self):
        self.model_tester = MoEmbModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MoEmbConfig, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_attention_outputs(self):
        """transformers' override for the Qwen3.5-MoE VLM: only the gated-attention layers (not the Gated DeltaNet
        ones) return attention weights, asked for by argument or by the text config, and they come last."""
        check_attention_outputs(self, lambda config: config.text_config)

    @unittest.skip(reason=QWEN3_5_MOE_NO_REVERSE_MAPPING)
    def test_reverse_loading_mapping(self):
        pass

    # The embedder's loss is InfoNCE between two forwards (queries and their targets), computed by the trainer: the
    # common training tests, which take `.loss` from one forward, run on it through that loss instead.
    def test_training(self):
        check_embedder_training(self)

    def test_training_gradient_checkpointing(self):
        check_embedder_training(self, checkpointing={})

    def test_training_gradient_checkpointing_use_reentrant_false(self):
        check_embedder_training(self, checkpointing={"use_reentrant": False})

    def test_training_gradient_checkpointing_use_reentrant_true(self):
        check_embedder_training(self, checkpointing={"use_reentrant": True})


def check_attention_outputs(test: ModelTesterMixin, text_config_of):
    """transformers' `test_attention_outputs` of the Qwen3.5-MoE models: only the gated-attention layers (not the
    Gated DeltaNet ones) return attention weights, asked for by argument or by the text config (`text_config_of`
    of the model's config), and they come last."""
    config, inputs_dict = test.model_tester.prepare_config_and_inputs_for_common()
    text_config = text_config_of(config)
    num_attention_layers = text_config.layer_types.count("full_attention")
    seq_len = test.model_tester.seq_length
    for model_class in test.all_model_classes:
        inputs_dict["output_attentions"] = True
        inputs_dict["output_hidden_states"] = False
        model = model_class._from_config(config, attn_implementation="eager").to(torch_device).eval()
        config = model.config
        with torch.no_grad():
            outputs = model(**test._prepare_for_class(inputs_dict, model_class))
        test.assertEqual(len(outputs.attentions), num_attention_layers)

        del inputs_dict["output_attentions"]
        text_config_of(config).output_attentions = True
        model = model_class(config).to(torch_device).eval()
        with torch.no_grad():
            outputs = model(**test._prepare_for_class(inputs_dict, model_class))
        attentions = outputs.attentions
        test.assertEqual(len(attentions), num_attention_layers)
        test.assertListEqual(list(attentions[0].shape[-3:]), [text_config.num_attention_heads, seq_len, seq_len])
        out_len = len(outputs)

        inputs_dict["output_attentions"] = True
        inputs_dict["output_hidden_states"] = True
        model = model_class(config).to(torch_device).eval()
        with torch.no_grad():
            outputs = model(**test._prepare_for_class(inputs_dict, model_class))
        test.assertEqual(out_len + 1, len(outputs))
        test.assertEqual(len(outputs.attentions), num_attention_layers)
        test.assertListEqual(list(outputs.attentions[0].shape[-3:]), [text_config.num_attention_heads, seq_len, seq_len])


def check_embedder_training(test: ModelTesterMixin, checkpointing: dict | None = None):
    """`MoEmbForEmbedding` learns from the InfoNCE loss of its `contrastive_logits` (queries: the tester's rows,
    targets: the rows in another order): every parameter gets a gradient, as in transformers' `test_training`, and
    with activation checkpointing the same gradients as without it."""
    config, inputs = test.model_tester.prepare_config_and_inputs_for_common()
    targets = copy.deepcopy(inputs)
    targets["input_ids"] = torch.roll(targets["input_ids"], 1, dims=0)

    def gradients(checkpointing_kwargs):
        torch.manual_seed(0)
        model = MoEmbForEmbedding(copy.deepcopy(config)).to(torch_device).train()
        if checkpointing_kwargs is not None:
            model.activation_checkpointing_enable(checkpointing_kwargs)
        logits = model.contrastive_logits(model(**inputs).embeddings, model(**targets).embeddings)
        F.cross_entropy(logits, torch.arange(len(logits), device=torch_device)).backward()
        return {name: parameter.grad for name, parameter in model.named_parameters() if parameter.requires_grad}

    plain = gradients(None)
    missing = [name for name, grad in plain.items() if grad is None]
    test.assertEqual(missing, [], "parameters without a gradient from the embedding loss")
    test.assertTrue(any(grad is not None and grad.abs().sum() > 0 for grad in plain.values()))
    if checkpointing is not None:
        checkpointed = gradients(checkpointing)
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, msg=name)
