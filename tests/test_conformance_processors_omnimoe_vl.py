"""transformers' common processor tests (`ProcessorTesterMixin`) on OmniMoE-VL's processor, as transformers' LLaVA
processor test (`tests/models/llava/test_processing_llava.py`) applies them: a tiny Qwen-format tokenizer and a
SigLIP image processor built offline, and LLaVA's own extra checks (the vLLM token counter, placeholders that
truncation would cut).

LLaVA's test file skips no common test. Skips, all made by the common tests themselves:
- video and audio tests ("video_processor / feature_extractor attribute not present", "Processor has no video
  processor"): OmniMoE-VL takes images and text only, as LLaVA;
- "Chat template does not support tools": the plain ChatML template has no tool calls;
- tests that decode video or audio files need torchcodec or librosa, which are not installed.
"""

import copy
import unittest

from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.processors.build_omnimoe_vl import make_omnimoe_vl_processor
from moezoo.processors.omnimoe_vl import OmniMoeVlProcessor
from transformers_tests.test_processing_common import ProcessorTesterMixin

CONFIG = OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL))


class OmniMoeVlProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = OmniMoeVlProcessor

    @classmethod
    def _setup_from_components(cls):
        return make_omnimoe_vl_processor(CONFIG)

    @staticmethod
    def prepare_processor_dict():
        return {"num_image_tokens": CONFIG.num_image_tokens}

    def test_get_num_vision_tokens(self):
        """As LLaVA's: the helper vLLM uses counts every image, whatever its size, as the fixed-size tower's tokens."""
        processor = self.get_processor()
        output = processor._get_num_multimodal_tokens(image_sizes=[(100, 100), (300, 100), (500, 30)])
        self.assertEqual(output["num_image_tokens"], [CONFIG.num_image_tokens] * 3)
        self.assertEqual(output["num_image_patches"], [1] * 3)

    def test_special_mm_token_truncation(self):
        """As LLaVA's: truncation that would cut an image's placeholders is an error, not a silently broken row."""
        processor = self.get_processor()
        text = self.prepare_text_inputs(batch_size=2, modalities="image")
        images = self.prepare_images_inputs(batch_size=2)
        processor(text=text, images=images, return_tensors="pt", truncation=None, padding=True)
        with self.assertRaises(ValueError):
            processor(text=text, images=images, return_tensors="pt", truncation=True, padding=True, max_length=5)
