"""transformers' common processor tests (`ProcessorTesterMixin`, from the installed version's source distribution) on
the zoo's processors, the way transformers' own processor test files apply them to the base models' processors:
tiny components built offline, saved once per class, and every common test run on them.

Skips, all made by the common tests themselves:
- chat-template tests: MoE-ViE's processor has none, like Siglip's (`tests/models/siglip/test_processor_siglip.py`);
- replacement-offset tests ("doesn't support `_get_num_multimodal_tokens`"): a dual encoder's text has no image or
  video placeholders to expand, like Siglip's;
- audio tests ("feature_extractor attribute not present"): the processor takes no audio, like Siglip's;
- typed video-kwargs tests ("video_processor attribute not present"): MoE-ViE's video processor is not a saved
  component but the image processor applied frame by frame, built on access (transformers' video processors need
  torchvision); its options are tested here through `test_model_input_names` and `test_processor_text_has_no_visual`
  and in tests/test_moe_vie_processor.py;
- tests that decode video or audio files need torchcodec or librosa, which are not installed.
"""

import unittest

from moezoo.processors.moe_vie import MoeVieImageProcessor, MoeVieProcessor
from moezoo.processors.tiny_tokenizers import build_tiny_clip_tokenizer
from transformers_tests.test_processing_common import ProcessorTesterMixin


class MoeVieProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    """As Siglip's processor test: an image processor and a CLIP tokenizer, no placeholder tokens; plus videos, whose
    frames the image processor processes."""

    processor_class = MoeVieProcessor

    @classmethod
    def _setup_image_processor(cls):
        return MoeVieImageProcessor(size=16, patch_size=4)

    @classmethod
    def _setup_tokenizer(cls):
        return build_tiny_clip_tokenizer()
