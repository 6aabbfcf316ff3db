"""The processors fed the way transformers users feed transformers' own processors: grouped keyword arguments,
truncation, float pixels with do_rescale=False, and inputs that would silently break the pairing of visual tokens and
pixels."""

import numpy as np
import pytest
import torch
from PIL import Image

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.configuration.mote import TINY_VIDEOLLM_MOTE, VideoLlmMoteConfig
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.processors.build_mote import make_videollm_mote_processor
from moezoo.processors.mote import task_prompt


@pytest.fixture(scope="module")
def videollm():
    return make_videollm_mote_processor(VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE))


@pytest.fixture
def moemb():
    return make_moemb_processor(MoEmbConfig(**TINY_MOEMB))


def random_video(num_frames=5, height=20, width=30, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


# --- VideoLLM-MoTE ---------------------------------------------------------------------------------------------------


def test_videollm_truncation_that_cuts_frame_placeholders_raises(videollm):
    """Truncating a prompt inside its frames would leave every frame in `pixel_values_videos` without placeholders."""
    prompt = videollm.render_prompt(task_prompt("step"))
    with pytest.raises(ValueError, match="Mismatch in `video` token count"):
        videollm(text=prompt, videos=[random_video()], truncation=True, max_length=40)


def test_videollm_takes_options_grouped_by_modality_like_transformers_processors(videollm):
    prompt = videollm.render_prompt(task_prompt("step"))
    flat = videollm(text=prompt, videos=[random_video()], max_num_frames=2, padding="max_length", max_length=120)
    grouped = videollm(
        text=prompt, videos=[random_video()], videos_kwargs={"max_num_frames": 2},
        text_kwargs={"padding": "max_length", "max_length": 120},
    )  # fmt: skip
    assert flat["video_num_frames"].tolist() == grouped["video_num_frames"].tolist() == [2]
    assert flat["input_ids"] == grouped["input_ids"] and len(grouped["input_ids"][0]) == 120


def test_videollm_rejects_options_nobody_takes_instead_of_ignoring_them(videollm):
    prompt = videollm.render_prompt(task_prompt("step"))
    with pytest.raises(ValueError, match="Unknown option.*video_metadata"):
        videollm(text=prompt, videos=[random_video()], video_metadata={"fps": 30})


def test_videollm_accepts_add_special_tokens(videollm):
    prompt = videollm.render_prompt(task_prompt("step"))
    default = videollm(text=prompt, videos=[random_video()])
    assert videollm(text=prompt, videos=[random_video()], add_special_tokens=False)["input_ids"] == default["input_ids"]
    assert videollm(text=prompt, videos=[random_video()], add_special_tokens=True)["input_ids"]


# --- MoEMB -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "images",
    [
        np.zeros((2, 40, 24, 3), np.uint8),  # a batch of images where one image goes
        [[Image.new("RGB", (24, 40)), Image.new("RGB", (24, 40))]],  # a nested list
        [np.zeros((40, 24), np.uint8)],  # greyscale without a channel axis
    ],
)
def test_moemb_rejects_what_is_not_one_image_per_entry(moemb, images):
    """The image processor flattens a 4D array or a nested list into several images while the prompt got one
    placeholder: the image tokens would no longer match `pixel_values`."""
    with pytest.raises(ValueError, match="input 0: image 0 .* each image must be"):
        moemb([{"images": images}])


def test_moemb_video_frames_follow_the_image_processors_do_rescale(moemb):
    frames = random_video(num_frames=4, height=20, width=20)
    expected = moemb([{"images": [frames[0]], "video": frames}])
    moemb.image_processor.do_rescale = False
    floats = frames.astype(np.float32) / 255
    got = moemb([{"images": [floats[0]], "video": floats}])
    assert torch.allclose(got["pixel_values"], expected["pixel_values"], atol=1e-6)
    assert torch.allclose(got["pixel_values_videos"], expected["pixel_values_videos"], atol=1e-6)


def test_moemb_opens_image_paths_as_they_display(moemb, tmp_path):
    """A transparent PNG given by path came out black (transformers' `load_image` keeps the colour transparency
    hides) while the same image in memory came out white, and a truncated file's error did not name it."""
    image = Image.new("RGBA", (24, 40), (0, 0, 0, 0))
    image.paste((200, 30, 30, 255), (0, 0, 12, 40))
    image.save(tmp_path / "half_transparent.png")
    from_path = moemb([{"images": [str(tmp_path / "half_transparent.png")]}])
    in_memory = moemb([{"images": [image]}])
    assert torch.equal(from_path["pixel_values"], in_memory["pixel_values"])
    png = (tmp_path / "half_transparent.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(png[: len(png) // 2])
    with pytest.raises(ValueError, match="truncated.png"):
        moemb([{"images": [tmp_path / "truncated.png"]}])
