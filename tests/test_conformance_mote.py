"""transformers' common tests on every MoTE class (issue 16), run as transformers runs them on the base models.

The testers follow the base models' own test files (`tests/models/llama/test_modeling_llama.py` through
`tests/causal_lm_tester.py`, `tests/models/glm_ocr/test_modeling_glm_ocr.py`), with tiny configs: a 32-wide,
two-layer decoder whose FFNs are two task experts and a shared expert, and tiny vision towers. Every batch routes its
examples to both experts (`task_ids`), so the mixed-route dispatch runs in every test and every expert gets
gradients.

No test is skipped here: the common tests skip themselves where they need an accelerator, flash-attn, DeepSpeed or
kernels, or where they do not apply (a composite-model test on a text model and the reverse, checkpoint conversion
mappings, which no zoo class has). `test_moe_models_record_router_logits`, which skips itself on a model file without
`@use_experts_implementation`, runs through `RoutedExpertsTests`. GLM-OCR-MoTE overrides the two input-embedding
tests as `GlmOcrModelTest` does; VideoLLM-MoTE applies the multimodal-outputs test, written for images, to its videos.
"""

import copy
import unittest

import pytest
import torch
from transformers import AutoModel

from moezoo.configuration.mote import GlmOcrMoteConfig, GlmOcrMoteTextConfig, LlamaMoteConfig, VideoLlmMoteConfig
from moezoo.modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration, GlmOcrMoteModel, GlmOcrMoteTextModel
from moezoo.modeling.mote.llama import LlamaMoteForCausalLM, LlamaMoteModel
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration, VideoLlmMoteModel
from transformers_tests.generation.test_utils import GenerationTesterMixin
from transformers_tests.routed_experts import RoutedExpertsTests
from transformers_tests.test_configuration_common import ConfigTester
from transformers_tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor
from transformers_tests.zoo import ListedInTransformersMappings


# Two task experts and a shared expert in every decoder layer; examples without task_ids take "step".
MOTE_FIELDS = dict(mote_expert_names=["step", "next"], mote_default_route="step")


def alternating_routes(batch_size: int) -> torch.LongTensor:
    """task_ids 0, 1, 0, ...: both experts in every batch."""
    return torch.arange(batch_size) % 2


class LlamaMoteModelTester:
    """`CausalLMModelTester`'s config (hidden 32, 2 layers, 2 heads, intermediate 37, vocab 99) with experts."""

    config_class = LlamaMoteConfig

    def __init__(self, parent, batch_size=3, seq_length=7, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.text_config = dict(
            vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, hidden_act="gelu", max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **MOTE_FIELDS,
        )
        self.vocab_size = self.text_config["vocab_size"]
        self.hidden_size = self.text_config["hidden_size"]
        self.num_hidden_layers = self.text_config["num_hidden_layers"]
        self.num_attention_heads = self.text_config["num_attention_heads"]

    def get_config(self):
        return self.config_class(**self.text_config)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.tril(torch.ones_like(input_ids)),
            "task_ids": alternating_routes(self.batch_size),
        }
        return self.get_config(), inputs


class LlamaMoteModelTest(
    ListedInTransformersMappings, RoutedExpertsTests, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase
):
    all_model_classes = (LlamaMoteModel, LlamaMoteForCausalLM)

    def setUp(self):
        super().setUp()
        self.model_tester = LlamaMoteModelTester(self)
        self.config_tester = ConfigTester(self, config_class=LlamaMoteConfig)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_tp_plan_matches_params_with_dense_layers(self):
        """The common check on a decoder whose first layer keeps its dense FFN (`mote_layers=[1]`): the plan then
        needs the dense FFN's rules as well as the experts'."""
        self.model_tester.text_config["mote_layers"] = [1]
        self.test_tp_plan_matches_params()


class GlmOcrMoteTextModelTester(LlamaMoteModelTester):
    """GLM-OCR's decoder as `GlmOcrModelTest` configures it (M-RoPE sections of an 8-wide head), with experts."""

    config_class = GlmOcrMoteTextConfig

    def __init__(self, parent, batch_size=3, seq_length=7, is_training=True):
        super().__init__(parent, batch_size=batch_size, seq_length=seq_length, is_training=is_training)
        self.text_config.update(
            hidden_act="silu", head_dim=8, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        )


class GlmOcrMoteTextModelTest(ListedInTransformersMappings, RoutedExpertsTests, ModelTesterMixin, unittest.TestCase):
    """GLM-OCR-MoTE's decoder on its own. transformers maps `glm_ocr_text` to GlmOcrTextModel but tests it only inside
    the composite (`GlmOcrModelTest`, which skips nothing), so there is no skip to carry over."""

    all_model_classes = (GlmOcrMoteTextModel,)

    def setUp(self):
        super().setUp()
        self.model_tester = GlmOcrMoteTextModelTester(self)
        self.config_tester = ConfigTester(self, config_class=GlmOcrMoteTextConfig)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_auto_model_resolves_the_text_config(self):
        """As `AutoModel` builds GlmOcrTextModel from a `glm_ocr_text` config."""
        self.assertIsInstance(AutoModel.from_config(self.model_tester.get_config()), GlmOcrMoteTextModel)


class GlmOcrMoteModelTester:
    """`GlmOcrVisionText2TextModelTester` with experts in the decoder and a smaller image (2x2 patches of 14 pixels,
    no spatial merge: 4 image tokens)."""

    def __init__(self, parent, batch_size=3, seq_length=7, image_size=28, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.is_training = is_training
        self.text_config = GlmOcrMoteTextModelTester(parent).text_config
        self.vision_config = dict(
            depth=2, hidden_act="silu", hidden_size=48, num_heads=12, out_hidden_size=self.text_config["hidden_size"],
            intermediate_size=22, patch_size=14, spatial_merge_size=1, temporal_patch_size=2,
        )
        self.token_ids = dict(
            video_start_token_id=3, video_end_token_id=4, image_start_token_id=5, image_end_token_id=6,
            image_token_id=7, video_token_id=8,
        )
        self.num_image_tokens = (image_size // self.vision_config["patch_size"]) ** 2
        self.seq_length = seq_length + self.num_image_tokens
        self.vocab_size = self.text_config["vocab_size"]
        self.hidden_size = self.text_config["hidden_size"]
        self.num_hidden_layers = self.text_config["num_hidden_layers"]
        self.num_attention_heads = self.text_config["num_attention_heads"]

    def get_config(self) -> GlmOcrMoteConfig:
        return GlmOcrMoteConfig(text_config=self.text_config, vision_config=self.vision_config, **self.token_ids)

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        patch_size, temporal_patch_size = config.vision_config.patch_size, config.vision_config.temporal_patch_size
        pixel_values = floats_tensor(
            [self.batch_size * self.num_image_tokens, 3 * patch_size**2 * temporal_patch_size]
        )
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        for token_id in self.token_ids.values():
            input_ids[input_ids == token_id] = config.text_config.pad_token_id
        input_ids[:, 0] = config.image_start_token_id
        input_ids[:, 1 : 1 + self.num_image_tokens] = config.image_token_id
        input_ids[:, 1 + self.num_image_tokens] = config.image_end_token_id
        mm_token_type_ids = torch.zeros_like(input_ids)
        mm_token_type_ids[:, 1 : 1 + self.num_image_tokens] = 1
        side = self.image_size // patch_size
        inputs = {
            "pixel_values": pixel_values,
            "image_grid_thw": torch.tensor([[1, side, side]] * self.batch_size),
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": mm_token_type_ids,
            "task_ids": alternating_routes(self.batch_size),
        }
        return config, inputs


# Every common test runs through a vision tower too: over a minute of CPU per class.
@pytest.mark.slow
class GlmOcrMoteModelTest(
    ListedInTransformersMappings, RoutedExpertsTests, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase
):
    all_model_classes = (GlmOcrMoteModel, GlmOcrMoteForConditionalGeneration)
    model_split_percents = [0.7, 0.9]  # as GlmOcrModelTest: too small to split at 0.5
    _is_composite = True

    def setUp(self):
        super().setUp()
        self.model_tester = GlmOcrMoteModelTester(self)
        self.config_tester = ConfigTester(self, config_class=GlmOcrMoteConfig, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()

    # As GlmOcrModelTest: images are (patches, features) rows, which embeddings cannot replace.
    def test_inputs_embeds(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            inputs = copy.deepcopy(self._prepare_for_class(inputs_dict, model_class))
            input_ids = inputs.pop("input_ids")
            del inputs["pixel_values"], inputs["image_grid_thw"]
            inputs["inputs_embeds"] = model.get_input_embeddings()(input_ids)
            with torch.no_grad():
                model(**inputs)

    def test_inputs_embeds_matches_input_ids(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            inputs = self._prepare_for_class(inputs_dict, model_class)
            input_ids = inputs.pop("input_ids")
            del inputs["pixel_values"], inputs["image_grid_thw"]
            inputs_embeds = model.get_input_embeddings()(input_ids)
            with torch.no_grad():
                out_ids = model(input_ids=input_ids, **inputs)[0]
                out_embeds = model(inputs_embeds=inputs_embeds, **inputs)[0]
            torch.testing.assert_close(out_embeds, out_ids)


class VideoLlmMoteModelTester:
    """The Llama-MoTE decoder of `LlamaMoteModelTester` and a SigLIP tower on 16x16 frames (2x2 patches of 8 pixels);
    each frame is `1 + 1x1` tokens (the pooled output and the average of its patches), one frame per example."""

    def __init__(self, parent, batch_size=3, seq_length=7, image_size=16, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.is_training = is_training
        self.text_config = LlamaMoteModelTester(parent).text_config
        self.vision_config = dict(
            hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
            patch_size=8, vision_use_head=True,
        )
        self.frame_num_tokens = 2
        self.seq_length = seq_length + self.frame_num_tokens
        self.vocab_size = self.text_config["vocab_size"]
        self.hidden_size = self.text_config["hidden_size"]
        self.num_hidden_layers = self.text_config["num_hidden_layers"]
        self.num_attention_heads = self.text_config["num_attention_heads"]

    def get_config(self) -> VideoLlmMoteConfig:
        return VideoLlmMoteConfig(
            text_config=self.text_config, vision_config=self.vision_config, video_token="<v>", video_token_id=3,
            frame_token_interval_id=4, frame_token_pooled=[1, 1], frame_num_tokens=self.frame_num_tokens,
            max_num_frames=4, frame_resolution=self.image_size,
        )

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_ids[input_ids == config.video_token_id] = config.text_config.pad_token_id
        input_ids[:, 1 : 1 + self.frame_num_tokens] = config.video_token_id
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "pixel_values_videos": floats_tensor([self.batch_size, 3, self.image_size, self.image_size]),
            "task_ids": alternating_routes(self.batch_size),
        }
        return config, inputs


# Every common test runs through a vision tower too: over a minute of CPU per class.
@pytest.mark.slow
class VideoLlmMoteModelTest(
    ListedInTransformersMappings, RoutedExpertsTests, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase
):
    all_model_classes = (VideoLlmMoteModel, VideoLlmMoteForConditionalGeneration)
    _is_composite = True

    def setUp(self):
        super().setUp()
        self.model_tester = VideoLlmMoteModelTester(self)
        self.config_tester = ConfigTester(self, config_class=VideoLlmMoteConfig, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_multimodal_outputs_are_returned(self):
        """The common test checks `image_outputs` and leaves videos to a FIXME; VideoLLM-MoTE reads videos only, so
        its checks apply to `video_outputs`: the vision tower's attentions and hidden states, one pooled entry per
        video."""
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_generative_model_classes:
            model = model_class(copy.deepcopy(config))
            model.set_attn_implementation("eager")
            model.eval()
            with torch.no_grad():
                outputs = model(**inputs_dict, output_hidden_states=True, output_attentions=True)
            vision_layers = config.vision_config.num_hidden_layers
            self.assertEqual(len(outputs.video_outputs.attentions), vision_layers)
            self.assertEqual(len(outputs.video_outputs.hidden_states), vision_layers + 1)
            self.assertEqual(len(outputs.video_outputs.pooler_output), self.model_tester.batch_size)
