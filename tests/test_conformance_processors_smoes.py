"""transformers' common processor tests (`ProcessorTesterMixin`) on SMoES's processor, as transformers' Qwen3-VL
processor test (`tests/models/qwen3_vl/test_processing_qwen3_vl.py`) applies them to `Qwen3VLProcessor`: a tiny
Qwen-format tokenizer, the Qwen2-VL image processor and a ChatML chat template, built offline
(`make_smoes_processor` of the tiny preset).

Skips (Qwen3-VL's file itself skips the chat-template video tests, "qwen3_vl can't sample frames from image frames
directly"; here they skip as below):
- made by the common tests themselves, for want of torchvision: transformers' video processors are torchvision
  backends, so SMoES's processor has no video processor (see `processors/smoes.py`): the typed video-kwargs tests
  ("video_processor attribute not present") and the chat-template video tests do not run;
- `test_processor_with_multiple_inputs` and `test_replacement_offsets` (skipped here): they write a video placeholder
  in the text whatever the processor and pass videos only to a processor with a video processor, which needs
  torchvision (see above);
- audio tests ("feature_extractor attribute not present"): SMoES takes no audio, as Qwen3.5;
- "Chat template does not support tools": the tiny preset's ChatML template writes no tool calls (a converted
  checkpoint keeps Qwen3.5's own template);
- tests that decode video or audio files need torchcodec or librosa, which are not installed.
"""

import unittest

from PIL import Image

from moezoo.configuration.smoes import SmoesQwen3_5MoeConfig
from moezoo.presets.smoes import TINY_SMOES
from moezoo.processors.build_smoes import make_smoes_processor
from moezoo.processors.smoes import SmoesQwen3_5MoeProcessor
from transformers_tests.test_processing_common import ProcessorTesterMixin

CONFIG = SmoesQwen3_5MoeConfig(**TINY_SMOES)
NEEDS_A_VIDEO_PROCESSOR = (
    "passes videos only to a processor with a video processor, which transformers' video processors need "
    "torchvision for; the text still holds a video placeholder"
)


class SmoesQwen3_5MoeProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = SmoesQwen3_5MoeProcessor

    @classmethod
    def _setup_from_components(cls):
        return make_smoes_processor(CONFIG)

    def test_get_num_vision_tokens(self):
        """As Qwen3-VL's: the helper vLLM uses counts tokens and patches for every image, as the call expands them."""
        processor = self.get_processor()
        image_sizes = [(100, 100), (300, 100), (500, 30)]
        output = processor._get_num_multimodal_tokens(image_sizes=image_sizes)
        self.assertEqual(len(output["num_image_tokens"]), 3)
        self.assertEqual(len(output["num_image_patches"]), 3)
        images = [Image.new("RGB", (width, height)) for height, width in image_sizes]
        placeholder = f"{processor.vision_start_token}{processor.image_token}{processor.vision_end_token}"
        text = placeholder * len(images)
        inputs = processor(text=[text], images=images, return_tensors="pt")
        self.assertEqual(int((inputs["input_ids"] == processor.image_token_id).sum()), sum(output["num_image_tokens"]))

    @unittest.skip(reason=NEEDS_A_VIDEO_PROCESSOR)
    def test_processor_with_multiple_inputs(self):
        pass

    @unittest.skip(reason=NEEDS_A_VIDEO_PROCESSOR)
    def test_replacement_offsets(self):
        pass
