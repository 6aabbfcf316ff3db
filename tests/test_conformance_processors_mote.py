"""transformers' common processor tests (`ProcessorTesterMixin`, from the installed version's source distribution) on
the MoTE processors, the way transformers' own processor test files apply them to the base models' processors: tiny
components built offline, saved once per class, and every common test run on them.

- `GlmOcrMoteProcessor` as `tests/models/glm46v/test_processor_glm46v.py` tests GLM-OCR's processor
  (`Glm46VProcessor`): its small image sizes and its `_setup_test_attributes` (the image token only).
- `VideoLlmMoteProcessor` as LLaVA-style video LLMs (`tests/models/llava_onevision/test_processor_llava_onevision.py`,
  which skips nothing): a still image is a one-frame video, so image outputs are `pixel_values_videos`.
- The text-only LlamaMote has a tokenizer and no processor, as Llama in transformers has no processor test file.

Skips, each for a package not installable here:
- torchvision: transformers' video processors need it. GLM-OCR-MoTE's processor takes images only (its video
  processor would be `Glm46VVideoProcessor`), and VideoLLM-MoTE's frame processor is saved as its image processor and
  only exposed as its `video_processor`. Hence the mixin's own "video_processor attribute not present" skips of the
  typed video-kwargs tests, and three tests skipped here: they give videos to every processor whose `__call__` takes
  them, or choose inputs by the saved sub-processors while writing the video placeholder into the text;
- torchcodec and librosa, for the tests that decode video or audio files (the mixin skips them itself).
The mixin also skips, by itself, the audio tests (no feature extractor: MoTE models take no audio), and the tool-call
test (the chat templates have no tools).
"""

import unittest

from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

from moezoo.configuration.mote import TINY_GLM_OCR_MOTE, TINY_VIDEOLLM_MOTE, GlmOcrMoteConfig, VideoLlmMoteConfig
from moezoo.processors.build_mote import build_tiny_glm_ocr_tokenizer, build_tiny_videollm_tokenizer
from moezoo.processors.mote import (
    GLM_CHAT_TEMPLATE,
    GlmOcrMoteProcessor,
    VideoLlmMoteFrameProcessor,
    VideoLlmMoteProcessor,
)
from transformers_tests.test_processing_common import ProcessorTesterMixin


TORCHVISION_VIDEOS = "transformers' video processors need torchvision, which is not installable here: "


class GlmOcrMoteProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = GlmOcrMoteProcessor

    @classmethod
    def _setup_test_attributes(cls, processor):
        cls.image_token = processor.image_token

    @classmethod
    def _setup_image_processor(cls):
        # Glm46V's test sizes: a few image tokens per image, so that texts fit the common tests' max lengths.
        return Glm46VImageProcessorPil(patch_size=4, size={"shortest_edge": 12 * 12, "longest_edge": 18 * 18})

    @classmethod
    def _setup_tokenizer(cls):
        return build_tiny_glm_ocr_tokenizer(GlmOcrMoteConfig(**TINY_GLM_OCR_MOTE))

    @staticmethod
    def prepare_processor_dict():
        return {"chat_template": GLM_CHAT_TEMPLATE, "expert_names": ["ocr", "kie"]}

    def test_model_input_names(self):
        # As the common test, with a task: `task_ids` is returned when a task (or a route selector) is given.
        # Glm46V's own test overrides this test too, to leave out inputs its processor does not take.
        processor = self.get_processor()
        text = self.prepare_text_inputs(modalities=["image"])
        inputs = processor(text=text, images=self.prepare_images_inputs(), task="kie", return_tensors="pt")
        self.assertSetEqual(set(inputs.keys()), set(processor.model_input_names))

    @unittest.skip(TORCHVISION_VIDEOS + "the test gives videos to this image-only processor (Glm46VVideoProcessor's)")
    def test_flat_kwarg_applied_when_modality_dict_lacks_it(self):
        pass


class VideoLlmMoteProcessorTest(ProcessorTesterMixin, unittest.TestCase):
    processor_class = VideoLlmMoteProcessor
    images_input_name = "pixel_values_videos"  # a still image is a one-frame video

    @classmethod
    def _setup_image_processor(cls):
        return VideoLlmMoteFrameProcessor(size=32, max_num_frames=16)

    @classmethod
    def _setup_tokenizer(cls):
        return build_tiny_videollm_tokenizer(VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE))

    @staticmethod
    def prepare_processor_dict():
        return {"expert_names": TINY_VIDEOLLM_MOTE["text_config"]["mote_expert_names"], "frame_num_tokens": 10}

    def test_model_input_names(self):
        # As the common test, with a task (see GlmOcrMoteProcessorTest.test_model_input_names).
        processor = self.get_processor()
        text = self.prepare_text_inputs(modalities=["image", "video"])
        inputs = processor(
            text=text, images=self.prepare_images_inputs(), videos=self.prepare_videos_inputs(), task="step",
            do_sample_frames=False, return_tensors="pt",
        )  # fmt: skip
        self.assertSetEqual(set(inputs.keys()), set(processor.model_input_names))

    @unittest.skip(TORCHVISION_VIDEOS + "inputs follow the saved sub-processors, the text holds a video placeholder")
    def test_processor_with_multiple_inputs(self):
        pass

    @unittest.skip(TORCHVISION_VIDEOS + "inputs follow the saved sub-processors, the text holds a video placeholder")
    def test_replacement_offsets(self):
        pass
