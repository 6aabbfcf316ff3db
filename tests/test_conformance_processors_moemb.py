"""transformers' common processor tests (`ProcessorTesterMixin`) on MoEMB's processor, as transformers' Qwen3-VL
processor test (`tests/models/qwen3_vl/test_processing_qwen3_vl.py`, Qwen3.5's processor) applies them: a tiny
Qwen-format tokenizer with `<emb>` and MoEMB's image processor, built offline (`make_moemb_processor` of the tiny
preset), every test on transformers' way of calling a processor (`text=`, `images=`, `videos=`); MoEMB's own inputs
are tested in tests/test_moemb_processor.py.

Skips (Qwen3-VL's file itself skips the chat-template video tests, "qwen3_vl can't sample frames from image frames
directly"; here they skip as below):
- made by the common tests themselves, for want of torchvision: transformers' video processors are torchvision
  backends, so MoEMB's video processor is not a saved component (`video_processor` is built on access from the image
  processor, which holds the frame settings, as MoE-ViE's): the typed video-kwargs tests ("video_processor attribute
  not present") and the chat-template video tests do not run; its options are tested through
  `test_model_input_names`, `test_processor_text_has_no_visual` and the vLLM video token count;
- `test_processor_with_multiple_inputs` and `test_replacement_offsets` (skipped here): they pass videos only to
  processors whose video processor is a saved component, which needs torchvision (see above), while writing a video
  placeholder in the text whatever the processor; `test_model_input_names` and
  `test_get_num_multimodal_tokens_matches_processor_call_video` run the same calls with the videos;
- audio tests ("feature_extractor attribute not present"): MoEMB takes no audio, as Qwen3.5;
- "Chat template does not support tools": MoEMB's chat template writes embedding prompts, without tool calls;
- tests that decode video or audio files need torchcodec or librosa, which are not installed.
"""

import unittest

import numpy as np
import torch
from PIL import Image

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.processors.moemb import MoEmbProcessor
from transformers_tests.test_processing_common import ProcessorTesterMixin

CONFIG = MoEmbConfig(**TINY_MOEMB)
NEEDS_A_SAVED_VIDEO_PROCESSOR = (
    "passes videos only to a processor whose video processor is a saved component, which transformers' video "
    "processors need torchvision for; the text still holds a video placeholder"
)


class MoEmbProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = MoEmbProcessor

    @classmethod
    def _setup_from_components(cls):
        return make_moemb_processor(CONFIG)

    def test_get_num_vision_tokens(self):
        """As Qwen3-VL's: the helper vLLM uses counts tokens and patches for every image."""
        processor = self.get_processor()
        output = processor._get_num_multimodal_tokens(image_sizes=[(100, 100), (300, 100), (500, 30)])
        self.assertEqual(len(output["num_image_tokens"]), 3)
        self.assertEqual(len(output["num_image_patches"]), 3)

    @unittest.skip(reason=NEEDS_A_SAVED_VIDEO_PROCESSOR)
    def test_processor_with_multiple_inputs(self):
        pass

    @unittest.skip(reason=NEEDS_A_SAVED_VIDEO_PROCESSOR)
    def test_replacement_offsets(self):
        pass

    def test_chat_template_prompts_embed_as_moemb_inputs(self):
        """A prompt written with the chat template and given to transformers' call gives the same batch as MoEMB's
        own input: the same tokens (a video's template wrapper replaced whole, spec A-34), pixels and pooled token."""
        processor = self.get_processor()
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 256, (40, 24, 3), dtype=np.uint8))
        frames = list(rng.integers(0, 256, (6, 20, 20, 3), dtype=np.uint8))
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Find the caption.\n"}, {"type": "image"}, {"type": "video"},
            {"type": "text", "text": "a red square"},
        ]}]  # fmt: skip
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        called = processor(text=[prompt], images=[image], videos=[frames], return_tensors="pt")
        own = processor([{"instruction": "Find the caption.", "text": "a red square", "images": [image],
                          "video": frames}])  # fmt: skip
        self.assertEqual(set(called), set(own))
        for key in own:
            torch.testing.assert_close(called[key], own[key], msg=key)
        self.assertEqual(called["input_ids"][0, called["pooled_index"][0]], processor.emb_token_id)
