"""Tests for the MoE-ViE processor: image resize modes, NaFlex packing, videos, the tiny CLIP tokenizer, save/load."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, ZeroShotImageClassificationPipeline
from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

from moezoo.processors.moe_vie import (
    MoeVieImageProcessor,
    MoeVieProcessor,
    MoeVieVideoProcessor,
    sample_frame_indices,
)
from moezoo.processors.tiny_tokenizers import build_tiny_clip_tokenizer

PATCH = 4  # the tiny config: patch size 4, image size 16, context length 16


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_clip_tokenizer()


@pytest.fixture
def image_processor():
    return MoeVieImageProcessor(size=16, patch_size=PATCH)


@pytest.fixture
def processor(tokenizer):
    return MoeVieProcessor(MoeVieImageProcessor(size=16, patch_size=PATCH, num_frames=8), tokenizer)


def random_image(height, width, seed=0, channels=3):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)


def normalise(image: Image.Image) -> np.ndarray:
    """(height, width, 3) float32 in [-1, 1], computed directly from a PIL image."""
    return (np.asarray(image, dtype=np.float32) / 255.0 - 0.5) / 0.5


def patchify_hwc(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(H, W, C) -> (rows * cols, patch * patch * C), patches row-major, pixels within a patch in (py, px, c) order."""
    height, width, channels = pixels.shape
    grid = pixels.reshape(height // patch, patch, width // patch, patch, channels)  # (row, py, col, px, c)
    return grid.transpose(0, 2, 1, 3, 4).reshape(-1, patch * patch * channels)


# ----------------------------------------------------------------------------------------------------------- images


def test_square_mode_matches_pil_bicubic_resize_normalise_and_patchify(image_processor):
    image = random_image(23, 31)
    out = image_processor(image, return_tensors="pt")

    assert out["pixel_values"].shape == (1, 16, PATCH * PATCH * 3)
    assert out["pixel_values"].dtype == torch.float32
    assert out["pixel_attention_mask"].dtype == torch.int32
    assert out["pixel_attention_mask"].tolist() == [[1] * 16]
    assert out["spatial_shapes"].dtype == torch.int64
    assert out["spatial_shapes"].tolist() == [[4, 4]]
    expected = patchify_hwc(normalise(image.resize((16, 16), Image.Resampling.BICUBIC)), PATCH)
    np.testing.assert_allclose(out["pixel_values"][0].numpy(), expected, atol=1e-6)
    # The filter matters at this scale, so the comparison above tells bicubic from bilinear.
    bilinear = patchify_hwc(normalise(image.resize((16, 16), Image.Resampling.BILINEAR)), PATCH)
    assert np.abs(expected - bilinear).max() > 0.05


def test_pil_numpy_hwc_numpy_chw_and_torch_inputs_agree(image_processor):
    image = random_image(20, 28)
    pixels = np.asarray(image)
    reference = image_processor(image)["pixel_values"]
    for same_image in (pixels, pixels.transpose(2, 0, 1), torch.from_numpy(pixels.copy())):
        np.testing.assert_array_equal(image_processor(same_image)["pixel_values"], reference)


def test_greyscale_and_opaque_rgba_become_rgb(image_processor):
    grey = random_image(20, 20, channels=1)
    rgb_of_grey = grey.convert("RGB")
    for image in (grey, np.asarray(grey)[..., None]):
        np.testing.assert_array_equal(
            image_processor(image)["pixel_values"], image_processor(rgb_of_grey)["pixel_values"]
        )
    rgb = np.asarray(random_image(20, 20))
    rgba = np.concatenate([rgb, np.full((20, 20, 1), 255, np.uint8)], axis=-1)
    np.testing.assert_array_equal(image_processor(rgba)["pixel_values"], image_processor(rgb)["pixel_values"])


def test_square_mode_zero_pads_centrally_when_size_is_not_a_multiple_of_the_patch(image_processor):
    image = random_image(30, 25)
    out = image_processor(image, size=17)  # 17 -> 20: 1 pixel on top/left, 2 on bottom/right

    assert out["spatial_shapes"].tolist() == [[5, 5]]
    padded = np.pad(normalise(image.resize((17, 17), Image.Resampling.BICUBIC)), ((1, 2), (1, 2), (0, 0)))
    np.testing.assert_allclose(out["pixel_values"][0], patchify_hwc(padded, PATCH), atol=1e-6)


def test_center_crop_mode_resizes_the_shorter_side_and_crops_with_torchvision_offsets(image_processor):
    image = random_image(20, 24)
    out = image_processor(image, resize_mode="center_crop")

    # Shorter side 20 -> 16, longer side int(16 * 24 / 20) = 19; torchvision's CenterCrop starts at
    # round((19 - 16) / 2) = 2 where a floored offset would start at 1.
    resized = normalise(image.resize((19, 16), Image.Resampling.BICUBIC))
    np.testing.assert_allclose(out["pixel_values"][0], patchify_hwc(resized[:, 2:18], PATCH), atol=1e-6)
    assert out["spatial_shapes"].tolist() == [[4, 4]]


def test_naflex_mode_matches_siglip2_image_processor(image_processor):
    images = [random_image(20, 28, seed=1), random_image(32, 16, seed=2)]
    siglip2 = Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=16)(images, return_tensors="pt")
    ours = image_processor(
        images, resize_mode="naflex", max_num_patches=16, resample=Image.Resampling.BILINEAR, return_tensors="pt"
    )

    assert ours["spatial_shapes"].tolist() == [[3, 5], [5, 3]]
    for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
        torch.testing.assert_close(ours[key], siglip2[key], atol=1e-6, rtol=0)
    assert ours["pixel_attention_mask"].sum(-1).tolist() == [15, 15]
    # The official bicubic filter changes pixels, not the patch grid.
    bicubic = image_processor(images, resize_mode="naflex", max_num_patches=16)
    assert bicubic["spatial_shapes"].tolist() == [[3, 5], [5, 3]]


def test_size_can_be_overridden_per_call_for_progressive_resolution(image_processor):
    image = random_image(40, 40)
    assert image_processor(image, size=8)["pixel_values"].shape == (1, 4, 48)
    assert image_processor(image, size=24)["spatial_shapes"].tolist() == [[6, 6]]
    assert image_processor(image)["pixel_values"].shape == (1, 16, 48)


# ----------------------------------------------------------------------------------------------------------- videos


def test_sample_frame_indices_is_the_floored_linspace_including_both_ends():
    assert sample_frame_indices(10, 8) == [0, 1, 2, 3, 5, 6, 7, 9]
    assert sample_frame_indices(8, 8) == list(range(8))
    assert sample_frame_indices(3, 8) == [0, 1, 2]  # shorter videos keep every frame
    assert sample_frame_indices(100, 1) == [0]
    for total in range(2, 60):
        for num in range(2, total + 1):
            assert sample_frame_indices(total, num) == [int(i * (total - 1) / (num - 1)) for i in range(num)]


def test_video_frames_are_sampled_processed_like_images_and_padded(image_processor):
    # Frame k of the first video is uniformly k * 20, so each output frame tells which input frame it came from.
    long_video = np.stack([np.full((20, 28, 3), 20 * k, np.uint8) for k in range(10)])
    short_video = [random_image(24, 24, seed=k) for k in range(3)]
    out = MoeVieVideoProcessor(image_processor)([long_video, short_video], num_frames=8, return_tensors="pt")

    assert out["pixel_values_videos"].shape == (2, 8, 16, 48)
    assert out["pixel_values_videos"].dtype == torch.float32
    assert out["video_pixel_attention_mask"].shape == (2, 8, 16)
    assert out["video_spatial_shapes"].tolist() == [[4, 4], [4, 4]]
    assert out["padding_mask_videos"].dtype == torch.bool
    assert out["padding_mask_videos"].tolist() == [[True] * 8, [True] * 3 + [False] * 5]
    sampled_values = out["pixel_values_videos"][0, :, 0, 0]
    expected = [(20 * k / 255 - 0.5) / 0.5 for k in (0, 1, 2, 3, 5, 6, 7, 9)]
    torch.testing.assert_close(sampled_values, torch.tensor(expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        out["pixel_values_videos"][1, :3], image_processor(short_video, return_tensors="pt")["pixel_values"]
    )
    assert not out["pixel_values_videos"][1, 3:].any() and not out["video_pixel_attention_mask"][1, 3:].any()
    assert out["video_pixel_attention_mask"][1, :3].all()


def test_naflex_videos_have_one_patch_grid_per_video_and_the_batch_length_is_the_longest_video(image_processor):
    videos = [np.zeros((2, 20, 28, 3), np.uint8), np.zeros((3, 32, 16, 3), np.uint8)]
    out = MoeVieVideoProcessor(image_processor)(videos, num_frames=8, resize_mode="naflex", max_num_patches=16)

    assert out["pixel_values_videos"].shape == (2, 3, 16, 48)
    assert out["video_spatial_shapes"].tolist() == [[3, 5], [5, 3]]
    assert out["video_pixel_attention_mask"].sum(-1).tolist() == [[15, 15, 0], [15, 15, 15]]


def test_frame_settings_are_image_processor_defaults_overridden_per_call(tokenizer):
    video = np.stack([np.full((16, 16, 3), 20 * k, np.uint8) for k in range(7)])
    processor = MoeVieProcessor(MoeVieImageProcessor(size=16, patch_size=PATCH, num_frames=3), tokenizer)

    assert processor(videos=[video])["pixel_values_videos"].shape == (1, 3, 16, 48)
    assert processor(videos=[video], num_frames=5)["pixel_values_videos"].shape == (1, 5, 16, 48)
    every_frame = processor(videos=[video], do_sample_frames=False)["pixel_values_videos"]
    np.testing.assert_allclose(every_frame[0, :, 0, 0], [(20 * k / 255 - 0.5) / 0.5 for k in range(7)], atol=1e-6)


def test_a_folder_saved_with_num_frames_in_the_processor_config_keeps_it(processor, tmp_path):
    # Before the frame settings moved to the image processor, `num_frames` was saved in processor_config.json.
    processor.save_pretrained(tmp_path)
    config_path = tmp_path / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["num_frames"] = 3
    config_path.write_text(json.dumps(config))

    loaded = MoeVieProcessor.from_pretrained(tmp_path)
    assert loaded.image_processor.num_frames == 3
    assert loaded(videos=[np.zeros((7, 16, 16, 3), np.uint8)])["pixel_values_videos"].shape == (1, 3, 16, 48)


# -------------------------------------------------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_matches_the_tiny_config_and_is_deterministic(tokenizer):
    assert len(tokenizer) == 99
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 1)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (97, 98)
    assert tokenizer.model_max_length == 16
    # Literal ids: a build that depended on hash order (as the tokenizers BPE trainer does) would not reproduce them.
    assert tokenizer("a photo of a cat.").input_ids == [97, 30, 61, 62, 30, 66, 56, 98]
    assert tokenizer.convert_ids_to_tokens([61, 66]) == ["photo</w>", "cat</w>"]


def test_tokenizer_lower_cases_and_maps_unknown_characters_away_from_end_of_text(tokenizer):
    assert tokenizer("A PHOTO of a Cat.").input_ids == tokenizer("a photo of a cat.").input_ids
    # Digits are outside the tiny alphabet; they must not become EOT, where the text tower pools.
    assert tokenizer("cat 42").input_ids == [97, 66, 1, 1, 98]


def test_truncation_keeps_end_of_text_last_and_padding_fills_with_pad(tokenizer):
    long_text = "this is a photo of a red car and a blue car near a green tree and a house " * 2
    ids = tokenizer(long_text, truncation=True).input_ids
    assert len(ids) == 16 and ids[0] == 97 and ids[-1] == 98
    assert ids[1:4] == tokenizer("this is a").input_ids[1:4]

    batch = tokenizer(["a photo of a cat", "dog"], padding="max_length")
    assert batch.input_ids[1] == [97, 68, 98] + [0] * 13
    assert batch.attention_mask[1] == [1, 1, 1] + [0] * 13
    assert [len(ids) for ids in tokenizer(["a photo of a cat", "dog"], padding="longest").input_ids] == [7, 7]


# -------------------------------------------------------------------------------------------------------- processor


def test_processor_handles_text_image_video_and_mixed_calls(processor):
    image, video = random_image(20, 28), np.zeros((12, 20, 28, 3), np.uint8)
    text_keys = {"input_ids", "attention_mask"}
    image_keys = {"pixel_values", "pixel_attention_mask", "spatial_shapes"}
    video_keys = {"pixel_values_videos", "video_pixel_attention_mask", "video_spatial_shapes", "padding_mask_videos"}

    text_only = processor(text=["a photo of a cat", "dog"], return_tensors="pt")
    assert set(text_only) == text_keys
    assert text_only["input_ids"].shape == (2, 16)  # padded to the context length by default, like the official code
    assert set(processor(images=image, return_tensors="pt")) == image_keys
    assert set(processor(videos=[video], return_tensors="pt")) == video_keys
    mixed = processor(
        text="a cat",
        images=[image, image],
        videos=[video],
        padding="longest",
        size=8,
        num_frames=4,
        return_tensors="pt",
    )
    assert set(mixed) == text_keys | image_keys | video_keys
    assert mixed["input_ids"].shape == (1, 4)  # padding="longest" went to the tokenizer
    assert mixed["pixel_values"].shape == (2, 4, 48)  # size=8 went to images ...
    assert mixed["pixel_values_videos"].shape == (1, 4, 4, 48)  # ... and videos, with num_frames=4
    assert set(processor.model_input_names) == text_keys | image_keys | video_keys


def test_processor_output_satisfies_the_zero_shot_image_classification_pipeline(tokenizer, image_processor):
    # The pipeline calls the image processor and the tokenizer itself; run its real `preprocess` on our classes.
    pipe = object.__new__(ZeroShotImageClassificationPipeline)
    pipe.image_processor, pipe.tokenizer = image_processor, tokenizer
    pipe.model = types.SimpleNamespace(dtype=torch.float16, config=types.SimpleNamespace(model_type="moe_vie"))
    inputs = pipe.preprocess(random_image(20, 28), candidate_labels=["cat", "dog"])

    assert inputs["pixel_values"].dtype == torch.float16  # cast to the model's dtype ...
    assert inputs["pixel_attention_mask"].dtype == torch.int32  # ... while masks and shapes keep theirs
    assert inputs["spatial_shapes"].tolist() == [[4, 4]]
    text_inputs = inputs["text_inputs"][0]
    assert text_inputs["input_ids"][:, -1].tolist() == [98, 98]  # "this is a photo of {}." for both labels


SUBPROCESS_LOAD = """
import json, sys
import numpy as np
sys.modules["moezoo"] = None  # as on a machine without moezoo: the folder's own code must be enough
from transformers import AutoProcessor
processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
inputs = json.loads(sys.argv[2])
out = processor(text=inputs["text"], images=[np.array(inputs["image"], dtype=np.uint8)],
                videos=[np.array(inputs["video"], dtype=np.uint8)], return_tensors="np")
np.savez(sys.argv[3], class_name=type(processor).__name__, **out)
"""


def test_save_pretrained_round_trip_including_remote_code_without_moezoo(tokenizer, tmp_path, monkeypatch):
    processor = MoeVieProcessor(
        MoeVieImageProcessor(size=12, patch_size=PATCH, resize_mode="center_crop", num_frames=3), tokenizer
    )
    # What the Hub exporter does: register the classes so that save_pretrained writes auto_map and copies the code.
    monkeypatch.setattr(MoeVieProcessor, "_auto_class", "AutoProcessor")
    monkeypatch.setattr(MoeVieImageProcessor, "_auto_class", "AutoImageProcessor")
    folder = tmp_path / "processor"
    processor.save_pretrained(folder)

    config = json.loads((folder / "processor_config.json").read_text())
    assert config["auto_map"]["AutoProcessor"] == "moe_vie.MoeVieProcessor"
    assert (folder / "moe_vie.py").is_file()
    loaded_image_processor = MoeVieImageProcessor.from_pretrained(folder)
    assert loaded_image_processor.to_dict() == processor.image_processor.to_dict()
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert loaded_tokenizer("a photo of a cat.").input_ids == tokenizer("a photo of a cat.").input_ids
    assert loaded_tokenizer.model_max_length == 16 and loaded_tokenizer.pad_token_id == 0

    rng = np.random.default_rng(0)
    inputs = {
        "text": ["a photo of a cat", "a dog"],
        "image": rng.integers(0, 256, (20, 27, 3)).tolist(),
        "video": rng.integers(0, 256, (7, 18, 14, 3)).tolist(),
    }
    result = tmp_path / "remote.npz"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_LOAD, str(folder), json.dumps(inputs), str(result)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    remote = np.load(result)
    expected = processor(
        text=inputs["text"],
        images=[np.array(inputs["image"], dtype=np.uint8)],
        videos=[np.array(inputs["video"], dtype=np.uint8)],
        return_tensors="np",
    )
    assert str(remote["class_name"]) == "MoeVieProcessor"
    assert expected["pixel_values_videos"].shape == (1, 3, 9, 48)  # center_crop at 12 px, 3 of 7 frames
    for key, value in expected.items():
        np.testing.assert_array_equal(remote[key], value, err_msg=key)


# ----------------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("image", "kwargs", "message"),
    [
        (np.zeros((20, 20, 2), np.uint8), {}, "no channel axis of size"),
        (np.zeros((5, 20, 20), np.uint8), {}, "no channel axis of size"),
        (np.zeros((3, 20, 4), np.uint8), {}, "ambiguous"),
        (np.zeros((20, 20, 3), np.uint8), {"input_data_format": "channels_first"}, "has 20 channels"),
        ([np.zeros((20, 20, 3), np.uint8), np.zeros((20, 20), np.uint8)], {}, "Add a channel axis"),
        (np.zeros((20, 20), np.uint8), {}, "Add a channel axis"),
        ([torch.zeros(20, 20), np.zeros((20, 20, 3), np.uint8)], {}, "Add a channel axis"),
        (np.zeros((20, 20, 3), np.uint8), {"size": 2}, "smaller than one 4x4 patch"),
        (np.zeros((2, 9, 3), np.uint8), {"do_resize": False}, "smaller than one 4x4 patch"),
        (np.zeros((40, 40, 3), np.uint8), {"do_resize": False, "resize_mode": "naflex", "max_num_patches": 16}, "100 patches"),
        (np.zeros((20, 20, 3), np.uint8), {"resize_mode": "squash"}, "Unknown resize_mode 'squash'"),
        (np.zeros((20, 20, 3), np.uint8), {"size": {"shortest_edge": 16}}, "needs `size` as an int"),
        ([], {}, "`images` is empty"),
        ([[], []], {}, "`images` holds only empty lists"),
    ],
)  # fmt: skip
def test_bad_images_raise_value_errors_that_say_what_to_do(image_processor, image, kwargs, message):
    with pytest.raises(ValueError, match=message):
        image_processor(image, **kwargs)


def test_ambiguous_layout_is_accepted_once_the_layout_is_given(image_processor):
    out = image_processor(np.zeros((3, 20, 4), np.uint8), input_data_format="channels_first", do_resize=False)
    assert out["spatial_shapes"].tolist() == [[5, 1]]


def test_unknown_resize_mode_is_rejected_at_construction():
    with pytest.raises(ValueError, match="use one of 'square', 'center_crop', 'naflex'"):
        MoeVieImageProcessor(resize_mode="stretch")


@pytest.mark.parametrize(
    ("videos", "kwargs", "message"),
    [
        ([], {}, "`videos` is an empty list"),
        ([[]], {}, "Video 0 has no frames"),
        ([np.zeros((0, 16, 16, 3), np.uint8)], {}, "Video 0 has no frames"),
        (np.zeros((16, 16, 3), np.uint8), {}, r"pass a one-frame video as \[frame\]"),
        ([[np.zeros((20, 28, 3), np.uint8), np.zeros((32, 16, 3), np.uint8)]], {"resize_mode": "naflex"}, "same size"),
        ([np.zeros((2, 16, 16, 3), np.uint8)], {"num_frames": 0}, "num_frames must be a positive integer"),
        ([np.zeros((2, 16, 16, 3), np.uint8), [np.zeros((2, 16, 16, 3), np.uint8)]], {}, "mixes videos with lists"),
    ],
)  # fmt: skip
def test_bad_videos_raise_value_errors(image_processor, videos, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeVieVideoProcessor(image_processor)(videos, **kwargs)


def test_lists_per_text_may_leave_a_text_without_images_or_videos(processor):
    # transformers' nested layout, one list per text: an empty list is a text with no image or video beside it.
    image, video = np.zeros((16, 16, 3), np.uint8), np.zeros((2, 16, 16, 3), np.uint8)
    out = processor(
        text=["a", "b", "c"], images=[[], [image], [image]], videos=[[video], [], [video, video]], return_tensors="np"
    )
    assert out["input_ids"].shape[0] == 3
    assert out["pixel_values"].shape[0] == 2 and out["pixel_values_videos"].shape[0] == 3


def test_empty_text_list_raises(processor):
    with pytest.raises(ValueError, match="`text` is an empty list"):
        processor(text=[])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"words": ("cat", "dog2")}, "Word 'dog2'"), ({"words": ("cat",)}, "add words to reach vocab_size=99")],
)
def test_tiny_tokenizer_builder_rejects_bad_word_lists(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_clip_tokenizer(**kwargs)
