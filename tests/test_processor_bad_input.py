"""The mistakes users make with the zoo's processors, and with models fed one modality too few: each ends in an
exception whose message names the input and says what to pass instead (issue 17, item 6).

One table per processor. Cases that tests/test_*processor*.py already check (resize modes, placeholder counts of
MoEMB, VideoLLM-MoTE's video counts and sampling options, ...) are not repeated here.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from moezoo.configuration.moe_vie import TINY_MOE_VIE, MoeVieConfig
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.configuration.mote import TINY_GLM_OCR_MOTE, TINY_VIDEOLLM_MOTE, GlmOcrMoteConfig, VideoLlmMoteConfig
from moezoo.modeling.moe_vie import MoeVieModel
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from moezoo.processors.build import make_moe_vie_processor
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.processors.build_mote import make_glm_ocr_mote_processor, make_videollm_mote_processor
from moezoo.processors.mote import task_prompt


IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
FRAME = np.zeros((16, 16, 3), np.uint8)
GREY = np.zeros((16, 16), np.uint8)
MASK = np.zeros((16, 16, 3), bool)
FIVE_CHANNELS = np.zeros((16, 16, 5), np.uint8)
VIDEO = [FRAME, FRAME]


@pytest.fixture(scope="module")
def moe_vie():
    return make_moe_vie_processor(MoeVieConfig(**TINY_MOE_VIE))


@pytest.fixture(scope="module")
def moemb():
    return make_moemb_processor(MoEmbConfig(**TINY_MOEMB))


@pytest.fixture(scope="module")
def videollm():
    return make_videollm_mote_processor(VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE))


@pytest.fixture(scope="module")
def glm():
    return make_glm_ocr_mote_processor(GlmOcrMoteConfig(**TINY_GLM_OCR_MOTE))


def check(call, processor, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call(processor)


# --- MoE-ViE ---------------------------------------------------------------------------------------------------------

MOE_VIE_CASES = {
    "text a number": (lambda p: p(text=123), ValueError, "`text` is an int; pass a string or a list of strings"),
    "text with a number": (lambda p: p(text=["a cat", 7]), ValueError, "text 1 is an int; pass a string"),
    "images a number": (lambda p: p(images=123), ValueError, "`images` is an int; each image must be a PIL image"),
    "images a dict": (lambda p: p(images={"image": IMAGE}), ValueError, "`images` is a dict; each image must be"),
    "images a mask": (lambda p: p(images=MASK), ValueError, "dtype bool; images hold numbers: uint8 .*astype"),
    "images five channels": (lambda p: p(images=[FIVE_CHANNELS]), ValueError, "image 0 .* no channel axis of size"),
    "images an empty batch": (lambda p: p(images=np.zeros((0, 16, 16, 3), np.uint8)), ValueError, "`images` is empty"),
    "images an empty sublist": (lambda p: p(images=[IMAGE, []]), ValueError, "image 1 is empty: pass at least one"),
    "videos a frame": (lambda p: p(videos=FRAME), ValueError, r"A frame alone is not a video: pass .* as \[frame\]"),
    "videos a file": (lambda p: p(videos="clip.mp4"), ValueError, "`videos` is a str.* Decode video files"),
    "videos files": (lambda p: p(videos=["a.mp4", "b.mp4"]), ValueError, "Video 0 is a str.* Decode video files"),
    "videos a number": (lambda p: p(videos=5), ValueError, r"`videos` is an int; expected a video \(a list of frames"),
    "videos too deep": (lambda p: p(videos=np.zeros((1, 1, 2, 16, 16, 3), np.uint8)), ValueError,
                        r"shape \(1, 1, 2, 16, 16, 3\).* expected a video"),
    "video greyscale": (lambda p: p(videos=[[GREY]]), ValueError, "Video 0, frame 0 .* Add a channel axis"),
    "video of masks": (lambda p: p(videos=[[MASK, MASK]]), ValueError, "Video 0, frame 0 .* dtype bool"),
    "an option nobody takes": (lambda p: p(text="a cat", sise=112), ValueError,
                               r"Unknown option\(s\) sise for MoeVieProcessor; it takes .*size"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), MOE_VIE_CASES.values(), ids=MOE_VIE_CASES)
def test_moe_vie_processor(moe_vie, call, error, message):
    check(call, moe_vie, error, message)


def test_moe_vie_one_frame_videos_take_the_forms_its_error_names(moe_vie):
    """A flat list of frames is one video, so `[frame]` is a one-frame video and `[[frame]]` a batch of it."""
    flat, nested = moe_vie(videos=[FRAME])["pixel_values_videos"], moe_vie(videos=[[FRAME]])["pixel_values_videos"]
    assert flat.shape[:2] == (1, 1) and np.array_equal(flat, nested)
    assert moe_vie(videos=[FRAME, FRAME])["pixel_values_videos"].shape[:2] == (1, 2)  # one video of two frames


@pytest.fixture(scope="module")
def moe_vie_model():
    torch.manual_seed(0)
    return MoeVieModel(MoeVieConfig(**TINY_MOE_VIE)).eval()


MOE_VIE_MODEL_CASES = {
    "text only": (dict(text=["a cat"]), "got text only: pass the output of processor.* get_text_features"),
    "images only": (dict(images=[IMAGE]), "got images only: pass the output of processor"),
    "videos only": (dict(videos=[VIDEO]), "got videos only: pass the output of processor"),
    "images and videos": (dict(text=["a cat"], images=[IMAGE], videos=[VIDEO]),
                          "texts with images or with videos, not both: call it once with"),
}  # fmt: skip


@pytest.mark.parametrize(("inputs", "message"), MOE_VIE_MODEL_CASES.values(), ids=MOE_VIE_MODEL_CASES)
def test_moe_vie_model_fed_the_wrong_modalities(moe_vie, moe_vie_model, inputs, message):
    with pytest.raises(ValueError, match=message):
        moe_vie_model(**moe_vie(**inputs, return_tensors="pt"))


# --- MoEMB -----------------------------------------------------------------------------------------------------------

MOEMB_CASES = {
    "inputs a number": (lambda p: p(123), ValueError, "the inputs are an int; pass a list of inputs, each a text or"),
    "queries a number": (lambda p: p(queries=5), ValueError, "the inputs are an int; pass a list of inputs"),
    "text a number": (lambda p: p([{"text": 5}]), ValueError, "input 0: 'text' must be a string, got int"),
    "image a mask": (lambda p: p([{"images": [MASK]}]), ValueError, "input 0: image 0 .* dtype bool; images hold"),
    "image five channels": (lambda p: p([{"text": "x", "images": [IMAGE, FIVE_CHANNELS]}]), ValueError,
                            "input 0: image 1 .* no channel axis of size"),
    "image a missing file": (lambda p: p([{"images": ["missing.png"]}]), FileNotFoundError, "no image file missing"),
    "video a still image": (lambda p: p([{"video": IMAGE}]), ValueError, "got an Image .*still image goes in 'images'"),
    "video empty": (lambda p: p([{"video": []}]), ValueError, "a video must be a non-empty list of frames"),
    "video nested": (lambda p: p([{"video": [[IMAGE]]}]), ValueError, "video 0, frame 0 is a list; each image must"),
    "video greyscale": (lambda p: p([{"video": [GREY, GREY]}]), ValueError, "video 0, frame 0 .* Add a channel axis"),
    "an option nobody takes": (lambda p: p(["a cat"], sise=112), ValueError, "MoEmbProcessor has no option sise"),
    "MoEMB's inputs and transformers' text=": (lambda p: p(queries=["a cat"], text=["a dog"]), ValueError,
                                               "pass either MoEMB's inputs .* or transformers' text=, images= and"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), MOEMB_CASES.values(), ids=MOEMB_CASES)
def test_moemb_processor(moemb, call, error, message):
    check(call, moemb, error, message)


def test_moemb_model_fed_pixels_without_the_prompt(moemb):
    torch.manual_seed(0)
    model = MoEmbForEmbedding(MoEmbConfig(**TINY_MOEMB)).eval()
    inputs = moemb([{"images": [IMAGE]}], return_tensors="pt")
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds, got neither: images"):
        model(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])


# --- VideoLLM-MoTE ---------------------------------------------------------------------------------------------------


def videollm_prompt(processor) -> str:
    return processor.render_prompt(task_prompt("step"))


VIDEOLLM_CASES = {
    "task a route id": (lambda p: p(text=videollm_prompt(p), videos=[VIDEO], task=7), ValueError,
                        r"`task` is an int; pass a task name, .* \['step', .*\(names, not route ids\)"),
    "task route ids": (lambda p: p(text=videollm_prompt(p), videos=[VIDEO], task=[0]), ValueError,
                       "`task` is a list; pass a task name, or a list of one name per text"),
    "route selector a name": (lambda p: p(text=videollm_prompt(p), videos=[VIDEO], route_selector="step"),
                              ValueError, "`route_selector` is a str; pass a MoteRouteSelector, or the task name as"),
    "text a number": (lambda p: p(text=5, videos=[VIDEO]), ValueError, "`text` is an int; pass a string"),
    "text empty": (lambda p: p(text=[], videos=[VIDEO]), ValueError, "`text` is an empty list: pass at least one"),
    "videos a frame": (lambda p: p(text=videollm_prompt(p), videos=FRAME), ValueError, r"pass .* as \[frame\]"),
    "videos files": (lambda p: p(text=videollm_prompt(p), videos=["clip.mp4"]), ValueError,
                     "Video 0 is a str.* Decode video files into frames first"),
    "video greyscale": (lambda p: p(text=videollm_prompt(p), videos=[[GREY]]), ValueError,
                        "Video 0, frame 0 .* Add a channel axis"),
    "video of masks": (lambda p: p(text=videollm_prompt(p), videos=[[MASK]]), ValueError, "frame 0 .* dtype bool"),
    "video five channels": (lambda p: p(text=videollm_prompt(p), videos=[[FIVE_CHANNELS]]), ValueError,
                            "Video 0, frame 0 .* no channel axis of size"),
    "images instead of videos": (lambda p: p(text=videollm_prompt(p), images=[IMAGE]), ValueError,
                                 r"1 '<v>' placeholders for 0 videos.* A still image is written <image>"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), VIDEOLLM_CASES.values(), ids=VIDEOLLM_CASES)
def test_videollm_mote_processor(videollm, call, error, message):
    check(call, videollm, error, message)


# --- GLM-OCR-MoTE ----------------------------------------------------------------------------------------------------


def glm_prompt(processor, num_images: int = 1) -> str:
    return processor.render_prompt("Text Recognition:", num_images=num_images)


GLM_CASES = {
    "task a route id": (lambda p: p(images=[IMAGE], text=glm_prompt(p), task=7), ValueError,
                        r"`task` is an int; pass a task name, .* \['ocr', 'kie'\] \(names, not route ids\)"),
    "task without text": (lambda p: p(images=[IMAGE], task="ocr"), ValueError, "pass the prompt as text= too"),
    "text a number": (lambda p: p(images=[IMAGE], text=5), ValueError, "`text` is an int; pass a string"),
    "text empty": (lambda p: p(images=[IMAGE], text=[]), ValueError, "`text` is an empty list: pass at least one"),
    "images a number": (lambda p: p(images=5, text=glm_prompt(p)), ValueError, "`images` is an int; each image"),
    "images empty": (lambda p: p(images=[], text=glm_prompt(p)), ValueError, "`images` is empty: pass at least one"),
    "image a mask": (lambda p: p(images=[MASK], text=glm_prompt(p)), ValueError, "image 0 .* dtype bool"),
    "image greyscale": (lambda p: p(images=[GREY], text=glm_prompt(p)), ValueError, "image 0 .* Add a channel axis"),
    "image five channels": (lambda p: p(images=[FIVE_CHANNELS], text=glm_prompt(p)), ValueError,
                            "image 0 .* no channel axis of size"),
    "more images than placeholders": (lambda p: p(images=[IMAGE, IMAGE], text=glm_prompt(p)), ValueError,
                                      r"1 <\|image\|> placeholder\(s\) for 2 image\(s\).*render_prompt\(prompt, "
                                      r"num_images=2\)"),
    "a prompt without placeholders": (lambda p: p(images=[IMAGE], text="Text Recognition:"), ValueError,
                                      r"0 <\|image\|> placeholder\(s\) for 1 image\(s\): write one per image"),
    "placeholders without images": (lambda p: p(text=glm_prompt(p)), ValueError,
                                    r"1 <\|image\|> placeholder\(s\) for 0 image\(s\)"),
    "an option nobody takes": (lambda p: p(images=[IMAGE], text=glm_prompt(p), sise=112), ValueError,
                               r"Unknown option\(s\) sise for GlmOcrMoteProcessor"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), GLM_CASES.values(), ids=GLM_CASES)
def test_glm_ocr_mote_processor(glm, call, error, message):
    check(call, glm, error, message)


def test_glm_ocr_mote_model_fed_images_without_the_prompt(glm):
    torch.manual_seed(0)
    model = GlmOcrMoteForConditionalGeneration(GlmOcrMoteConfig(**TINY_GLM_OCR_MOTE)).eval()
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(**glm(images=[IMAGE], return_tensors="pt"))
