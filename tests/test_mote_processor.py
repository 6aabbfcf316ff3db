"""Tests for the MoTE processors: GLM-OCR-MoTE images, VideoLLM-MoTE frame sampling and prompts, task ids, save/load
and remote code (spec mote.md §6, §9 item 13)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers.processing_utils
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.glm46v.processing_glm46v import Glm46VProcessor
from transformers.video_processing_utils import VideoProcessorMixin

from moezoo.configuration.mote import TINY_GLM_OCR_MOTE, TINY_VIDEOLLM_MOTE, GlmOcrMoteConfig, VideoLlmMoteConfig
from moezoo.processors.build_mote import (
    build_word_level_tokenizer,
    make_glm_ocr_mote_processor,
    make_videollm_mote_processor,
)
from moezoo.processors.mote import (
    VIDEOLLM_SYSTEM_PROMPT,
    VideoLlmMoteFrameProcessor,
    format_answer,
    kie_prompt,
    sample_frame_indices,
    task_prompt,
)


@pytest.fixture(scope="module")
def glm():
    return make_glm_ocr_mote_processor(GlmOcrMoteConfig(**TINY_GLM_OCR_MOTE))


@pytest.fixture(scope="module")
def videollm():
    return make_videollm_mote_processor(VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE), words=("stir", "boil", "tea"))


def random_image(height, width, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def random_video(num_frames, height, width, seed=0):
    return list(np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8))


class StubSelector:
    """A route selector that picks the route whose name appears in the prompt, and records what it was asked."""

    def __init__(self, names):
        self.names, self.prompts = names, []

    def select(self, prompts):
        self.prompts.extend(prompts)
        return torch.tensor([next(i for i, name in enumerate(self.names) if name in p) for p in prompts])


# ----------------------------------------------------------------------------------------------------- GLM-OCR-MoTE


def test_glm_processor_matches_transformers_glm46v_processor_and_adds_task_ids(glm, monkeypatch):
    # transformers' Glm46VProcessor needs a video processor; its base class needs no torchvision. ProcessorMixin
    # looks that base class up by name on the transformers module, which does not export it.
    monkeypatch.setattr(transformers.processing_utils.transformers_module, "VideoProcessorMixin",
                        VideoProcessorMixin, raising=False)
    reference = Glm46VProcessor(glm.image_processor, glm.tokenizer, VideoProcessorMixin(),
                                chat_template=glm.chat_template)
    images = [random_image(24, 32, seed=1), random_image(40, 20, seed=2)]
    texts = [glm.render_prompt("Text Recognition:"), glm.render_prompt(kie_prompt())]

    expected = reference(images=images, text=texts, padding=True, return_tensors="np")
    out = glm(images=images, text=texts, padding=True, task=["ocr", "kie"], return_tensors="np")

    assert set(out) == set(expected) | {"task_ids"}
    for key in expected:
        np.testing.assert_array_equal(out[key], expected[key], err_msg=key)
    assert out["task_ids"].tolist() == [0, 1] and out["task_ids"].dtype == np.int64


def test_glm_image_grid_placeholders_and_token_types(glm):
    # 32 x 24 at 4-px patches, merged 2 x 2: grid (1, 6, 8), 48 patch rows of 3 * 2 * 4 * 4 values, 12 tokens.
    out = glm(images=[random_image(24, 32)], text=[glm.render_prompt("Text Recognition:")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert out["pixel_values"].shape == (48, 96)
    ids = out["input_ids"][0]
    image_positions = (ids == 100).nonzero().squeeze(1)
    assert len(image_positions) == 12 and int(image_positions[-1] - image_positions[0]) == 11  # contiguous
    assert int(ids[image_positions[0] - 1]) == 102 and int(ids[image_positions[-1] + 1]) == 103
    assert out["mm_token_type_ids"][0].tolist() == (ids == 100).int().tolist()
    assert "task_ids" not in out  # no task and no selector: the model's default route (ocr)


def test_glm_patches_are_in_merge_block_order(glm):
    image = random_image(16, 16, seed=3)
    out = glm(images=[image], text=[glm.render_prompt("Text Recognition:")], return_tensors="np", do_resize=False)
    pixels = (np.asarray(image, np.float32) / 255 - glm.image_processor.image_mean) / glm.image_processor.image_std

    def patch(row, col):  # (channels, temporal copies, 4, 4), as the Conv3d patch embedding reads a row
        block = pixels[4 * row : 4 * row + 4, 4 * col : 4 * col + 4].transpose(2, 0, 1)
        return np.stack([block, block], axis=1).reshape(-1)

    # A 4 x 4 patch grid in 2 x 2 merge blocks: (0,0) (0,1) (1,0) (1,1), then (0,2) (0,3) ...
    for index, (row, col) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2)]):
        np.testing.assert_allclose(out["pixel_values"][index], patch(row, col), atol=1e-5)


def test_glm_processor_rejects_videos_and_unknown_tasks(glm):
    text = [glm.render_prompt("Text Recognition:")]
    with pytest.raises(ValueError, match="images only"):
        glm(images=[random_image(16, 16)], text=text, videos=[random_video(2, 16, 16)])
    with pytest.raises(ValueError, match=r"Unknown task 'table'.*\['ocr', 'kie'\]"):
        glm(images=[random_image(16, 16)], text=text, task="table")


def test_glm_route_selector_reads_the_user_prompt_without_images(glm):
    selector = StubSelector(["kie", "ocr"])  # its own order: the processor maps names to the model's ids
    texts = [glm.render_prompt("please do ocr"), glm.render_prompt("now kie")]
    out = glm(images=[random_image(16, 16), random_image(16, 16)], text=texts, route_selector=selector, padding=True)
    assert selector.prompts == ["please do ocr", "now kie"]
    assert out["task_ids"] == [0, 1]


# ----------------------------------------------------------------------------------------------- frame sampling


def test_frames_are_resampled_to_2_fps_by_nearest_timestamp():
    # 61 frames at 30 fps = 2 s: the 2 fps stream is t = 0, 0.5, ..., 2.0 s.
    assert sample_frame_indices(61, fps=2, source_fps=30) == [0, 15, 30, 45, 60]
    # 0.5 s is exactly between 0.25 and 0.75 s: the earlier frame wins the tie.
    assert sample_frame_indices(4, fps=2, timestamps=[0.0, 0.25, 0.75, 1.0]) == [0, 1, 3]
    # Irregular timestamps: the nearest frame to 0, 0.5, 1.0 and 1.5 s.
    assert sample_frame_indices(5, fps=2, timestamps=[0.0, 0.2, 0.6, 0.9, 1.6]) == [0, 2, 3, 4]
    # Without timing information the frames already are the stream.
    assert sample_frame_indices(4, fps=2) == [0, 1, 2, 3]


def test_segments_cover_ceil_start_to_ceil_end_and_the_cap_keeps_the_most_recent_frames():
    # COIN segment [0.6, 1.6] s at 2 fps: stream frames ceil(1.2) = 2 to ceil(3.2) = 4.
    assert sample_frame_indices(61, fps=2, source_fps=30, segment=(0.6, 1.6)) == [30, 45, 60]
    assert sample_frame_indices(61, fps=2, source_fps=30, max_num_frames=2) == [45, 60]
    with pytest.raises(ValueError, match="No 2 fps frame"):
        sample_frame_indices(10, fps=2, source_fps=30, segment=(5.0, 6.0))
    with pytest.raises(ValueError, match="non-decreasing timestamps"):
        sample_frame_indices(3, fps=2, timestamps=[0.0, 1.0, 0.5])


def test_frames_are_letterboxed_bicubic_and_normalised_to_minus_one_one():
    processor = VideoLlmMoteFrameProcessor(size=32, fps=2)
    frame = random_image(20, 40, seed=4)  # landscape: scaled to 16 x 32, 8 black rows above and below
    out = processor([[frame]], return_tensors="np")
    assert out["pixel_values_videos"].shape == (1, 3, 32, 32) and out["pixel_values_videos"].dtype == np.float32
    assert out["video_num_frames"].tolist() == [1]
    pixels = out["pixel_values_videos"][0]
    np.testing.assert_array_equal(pixels[:, :8], -1.0)
    np.testing.assert_array_equal(pixels[:, 24:], -1.0)
    expected = np.asarray(frame.resize((32, 16), Image.Resampling.BICUBIC), np.float32) / 255 * 2 - 1
    np.testing.assert_allclose(pixels[:, 8:24].transpose(1, 2, 0), expected, atol=1e-5)
    bilinear = np.asarray(frame.resize((32, 16), Image.Resampling.BILINEAR), np.float32) / 255 * 2 - 1
    assert np.abs(expected - bilinear).max() > 0.05  # the comparison above tells the filters apart


def test_frame_processor_samples_every_video_of_a_batch_on_its_own_clock():
    processor = VideoLlmMoteFrameProcessor(size=16, fps=2, max_num_frames=3)
    out = processor(
        [random_video(61, 12, 12), random_video(9, 20, 10)], video_fps=[30, 4], segments=[None, (0.0, 1.0)],
        return_tensors="pt",
    )  # fmt: skip
    # Video 0: 5 frames at 2 fps, capped to the last 3; video 1 (4 fps, 2 s): segment [0, 1] s -> frames 0..2.
    assert out["video_num_frames"].tolist() == [3, 3]
    assert out["pixel_values_videos"].shape == (6, 3, 16, 16)
    assert -1.0 <= float(out["pixel_values_videos"].min()) and float(out["pixel_values_videos"].max()) <= 1.0


# ------------------------------------------------------------------------------------------------ VideoLLM-MoTE


def test_task_prompts_are_the_paper_strings_with_the_single_step_fallback():
    assert task_prompt("step") == (
        "What is the action in the video? Format your answer concisely. No extra text output."
    )
    assert task_prompt("proc", num_steps=3) == (
        "What is the next 3 actions for the video? Format your answer concisely, listing each action on a new "
        "line with a number prefix. No extra text output."
    )
    assert task_prompt("proc", num_steps=1) == task_prompt("next")
    assert task_prompt("proc_plus", num_steps=1, goal="Make french fries") == (
        "To Make french fries, what is the next action for the video? Format your answer concisely. No extra text "
        "output."
    )
    assert format_answer("step", ["cut potato into strips"]) == "Cut potato into strips."
    assert format_answer("proc", ["soak them in water", "dry strips"]) == "1. Soak them in water.\n2. Dry strips."
    with pytest.raises(ValueError, match="num_steps"):
        task_prompt("proc")
    with pytest.raises(ValueError, match="goal"):
        task_prompt("proc_plus", num_steps=2)
    with pytest.raises(ValueError, match="No A.5 prompt"):
        task_prompt("ocr")


def test_rendered_prompt_is_the_a5_layout(videollm):
    text = videollm.render_prompt(task_prompt("step"))
    assert text == (
        f"<|begin_of_text|>{VIDEOLLM_SYSTEM_PROMPT}\n\nUser: {task_prompt('step')}\n[<v>]\nAssistant:"
    )
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "stream"},
        {"role": "assistant", "content": "A."},
    ]
    assert videollm.apply_chat_template(conversation) == "<|begin_of_text|>S\n\nUser: Q\n[<v>]\nAssistant: A.<|eot_id|>"


def test_every_frame_becomes_ten_placeholders_separated_by_the_interval_token(videollm):
    text = videollm.render_prompt(task_prompt("next"))
    out = videollm(text=text, videos=[random_video(7, 24, 40)], video_fps=3, task="next", return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert out["video_num_frames"].tolist() == [5]  # 7 frames at 3 fps = 2 s -> 5 frames at 2 fps
    assert out["pixel_values_videos"].shape == (5, 3, 32, 32)
    tokens = videollm.tokenizer
    stream = ids[ids.index(tokens.convert_tokens_to_ids("[")) + 1 : ids.index(tokens.convert_tokens_to_ids("]"))]
    assert len(stream) == 10 * 5 + 4  # 10F + (F - 1)
    assert stream == ([120] * 10 + [11]) * 4 + [120] * 10
    assert out["task_ids"].tolist() == [videollm.expert_names.index("next")]
    assert ids[0] == 1 and ids.count(1) == 1  # the rendered <|begin_of_text|>, and no second one


def test_batches_pair_placeholders_with_videos_in_order(videollm):
    texts = [videollm.render_prompt(task_prompt("step")), videollm.render_prompt(task_prompt("task"))]
    out = videollm(
        text=texts, videos=[random_video(2, 16, 16), random_video(4, 16, 16)], task=["step", "task"], padding=True,
        return_tensors="pt",
    )  # fmt: skip
    assert out["video_num_frames"].tolist() == [2, 4]
    assert (out["input_ids"] == 120).sum(1).tolist() == [20, 40]
    assert out["task_ids"].tolist() == [videollm.expert_names.index("step"), videollm.expert_names.index("task")]


def test_still_images_are_one_frame_streams_in_the_order_of_their_placeholders(videollm):
    image, video = random_image(20, 12, seed=3), random_video(3, 16, 16, seed=4)
    text = "<|begin_of_text|>\nUser: compare\n[<v>]\n[<image>]\nAssistant:"
    out = videollm(text=text, images=[image], videos=[video], return_mm_token_type_ids=True, return_tensors="np")
    assert out["video_num_frames"].tolist() == [3, 1]  # the video first, as in the text
    alone = videollm.image_processor([[image]], return_tensors="np")["pixel_values_videos"]
    np.testing.assert_array_equal(out["pixel_values_videos"][3:], alone)
    ids, token_types = out["input_ids"][0], out["mm_token_type_ids"][0]
    assert (ids == 120).sum() == 40 and (token_types == 2).sum() == 30 and (token_types == 1).sum() == 10
    assert set(token_types[ids != 120].tolist()) == {0}  # the frame separators are text
    assert videollm._get_num_multimodal_tokens(image_sizes=[(20, 12)])["num_image_tokens"] == [10]
    # What the model receives for a still image is what it receives for a one-frame video.
    as_video = videollm(text=text.replace("<image>", "<v>"), videos=[video, [image]], return_tensors="np")
    for key in as_video:
        np.testing.assert_array_equal(out[key], as_video[key], err_msg=key)


def test_replacement_offsets_and_tokenizer_options_pass_through(videollm):
    text = videollm.render_prompt(task_prompt("step"))
    out = videollm(
        text=text, videos=[random_video(2, 8, 8)], return_text_replacement_offsets=True, return_offsets_mapping=True,
        padding="max_length", max_length=200,
    )  # fmt: skip
    [[replacement]] = out["text_replacement_offsets"]
    assert replacement["type"] == "video" and replacement["text"] == "<v>"
    assert replacement["replacement"] == ",".join(["<v>" * 10] * 2)
    expanded = text.replace("<v>", replacement["replacement"])
    start, end = replacement["new_span"]
    assert expanded[start:end] == replacement["replacement"]
    assert len(out["input_ids"][0]) == len(out["offset_mapping"][0]) == 200


def test_frames_are_kept_as_given_or_evenly_spaced_on_request(videollm):
    video = random_video(7, 8, 8)
    assert videollm.image_processor([video], do_sample_frames=False)["video_num_frames"].tolist() == [7]
    evenly = videollm.image_processor([video], num_frames=3, return_tensors="np")["pixel_values_videos"]
    chosen = videollm.image_processor([[video[i] for i in (0, 3, 6)]])["pixel_values_videos"]
    np.testing.assert_array_equal(evenly, chosen)
    with pytest.raises(ValueError, match="with do_sample_frames=False .* leave them out"):
        videollm.image_processor([video], do_sample_frames=False, video_fps=30)


def test_chat_template_takes_content_parts_and_marks_the_answer(videollm):
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "image"}, {"type": "video"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A."}]},
    ]
    assert videollm.apply_chat_template(conversation) == "\nUser: Q\n[<image>]\n[<v>]\nAssistant: A.<|eot_id|>"
    out = videollm.tokenizer.apply_chat_template(
        conversation, chat_template=videollm.chat_template, return_dict=True, return_assistant_tokens_mask=True
    )
    answer = [token for token, mask in zip(out["input_ids"], out["assistant_masks"]) if mask]
    assert answer == videollm.answer_ids(["A."])[0]


def test_answers_are_tokenised_after_a_space_and_end_with_end_of_turn(videollm):
    [ids] = videollm.answer_ids(["Stir."])
    tokens = videollm.tokenizer
    assert ids == [tokens.convert_tokens_to_ids("stir"), tokens.convert_tokens_to_ids("."), tokens.eos_token_id]
    assert tokens.decode(ids) == "stir. <|eot_id|>"


def test_route_selector_reads_the_last_user_turn(videollm):
    selector = StubSelector(["task", "step"])
    texts = [videollm.render_prompt("the step please"), videollm.render_prompt("which task is it")]
    out = videollm(text=texts, videos=[random_video(2, 8, 8), random_video(2, 8, 8)], route_selector=selector,
                   padding=True)
    assert selector.prompts == ["the step please", "which task is it"]
    assert out["task_ids"] == [videollm.expert_names.index("step"), videollm.expert_names.index("task")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"videos": None}, r"1 '<v>' placeholders for 0 videos"),
        ({"videos": [random_video(2, 8, 8), random_video(2, 8, 8)]}, r"1 '<v>' placeholders for 2 videos"),
        ({"videos": [random_video(2, 8, 8)], "task": "cook"}, "Unknown task 'cook'"),
        ({"videos": [random_video(2, 8, 8)], "task": ["step", "next"]}, "2 task names for 1 texts"),
        ({"videos": [random_video(2, 8, 8)], "segments": [(0, 1), (0, 1)]}, "`segments` has 2 entries for 1 videos"),
        ({"videos": [random_video(2, 8, 8)], "fps": 0}, "fps must be positive"),
        ({"videos": [random_video(3, 8, 8)], "timestamps": [0.0, 0.5, 1.0]}, "`timestamps` has 3 entries for 1"),
    ],
)
def test_bad_videollm_inputs_raise_errors_that_say_what_to_fix(videollm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        videollm(text=videollm.render_prompt(task_prompt("step")), **kwargs)


def test_tiny_tokenizer_keeps_the_config_ids_and_rejects_a_mismatched_video_token():
    config = VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE)
    processor = make_videollm_mote_processor(config)
    tokens = processor.tokenizer
    assert len(tokens) == config.text_config.vocab_size
    assert (tokens.bos_token_id, tokens.eos_token_id, tokens.pad_token_id) == (1, 2, 0)
    assert tokens.convert_tokens_to_ids(["<v>", ","]) == [config.video_token_id, config.frame_token_interval_id]
    assert make_videollm_mote_processor(config).tokenizer.get_vocab() == tokens.get_vocab()  # deterministic
    other = VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE | {"video_token_id": 119})
    with pytest.raises(ValueError, match="maps the video token '<v>' to 120"):
        make_videollm_mote_processor(other, tokenizer=tokens)


def test_word_level_tokenizer_builder_rejects_what_cannot_fit():
    with pytest.raises(ValueError, match="must be distinct"):
        build_word_level_tokenizer(8, {0: "<a>", 1: "<a>"}, [], [], 16)
    with pytest.raises(ValueError, match="ids below vocab_size=8"):
        build_word_level_tokenizer(8, {9: "<a>"}, [], [], 16)
    with pytest.raises(ValueError, match="no id for the special token"):
        build_word_level_tokenizer(3, {0: "<a>"}, ["<b>", "<c>"], [], 16)
    tokens = build_word_level_tokenizer(6, {0: "<pad>"}, [], ["one", "two", "three", "four", "five"], 16,
                                        pad_token="<pad>")
    assert tokens("one four").input_ids == [2, 5] and tokens("five").input_ids == [1]  # no room: unknown


# --------------------------------------------------------------------------------------------------- save / load

REMOTE_LOAD = """
import json, sys
import numpy as np
sys.modules["moezoo"] = None  # as on a machine without moezoo: the folder's own code must be enough
from transformers import AutoProcessor
processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
inputs = json.loads(sys.argv[2])
media = {inputs["media"]: [np.array(item, dtype=np.uint8) for item in inputs["items"]]}
out = processor(text=inputs["text"], task=inputs["task"], padding=True, return_tensors="np", **media)
np.savez(sys.argv[3], class_name=type(processor).__name__,
         image_processor_class=type(processor.image_processor).__name__,
         expert_names=json.dumps(processor.expert_names), **out)
"""


@pytest.fixture(scope="module")
def frame_processor_registered():
    """What `import moezoo` does once VideoLLM-MoTE's catalogue entry lists its frame processor as a processor part:
    `AutoImageProcessor` (which loads a processor's image processor) then knows the class by name."""
    AutoImageProcessor.register(VideoLlmMoteConfig, image_processor_classes={"pil": VideoLlmMoteFrameProcessor},
                                exist_ok=True)


@pytest.mark.parametrize("architecture", ["videollm", "glm"])
def test_save_pretrained_round_trip(architecture, videollm, glm, tmp_path, frame_processor_registered):
    processor = videollm if architecture == "videollm" else glm
    processor.save_pretrained(tmp_path)
    reloaded = type(processor).from_pretrained(tmp_path)
    assert type(reloaded.image_processor) is type(processor.image_processor)
    assert reloaded.image_processor.to_dict() == processor.image_processor.to_dict()
    assert reloaded.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert reloaded.chat_template == processor.chat_template
    for name in ("expert_names", "video_token", "image_token", "frame_interval_token", "frame_num_tokens",
                 "system_prompt"):
        assert getattr(reloaded, name, None) == getattr(processor, name, None), name


@pytest.mark.parametrize("architecture", ["videollm", "glm"])
def test_remote_code_loads_with_auto_processor_without_moezoo(architecture, videollm, glm, tmp_path, monkeypatch):
    processor = videollm if architecture == "videollm" else glm
    # What the Hub exporter does: register the classes so that save_pretrained writes auto_map and copies the code.
    monkeypatch.setattr(type(processor), "_auto_class", "AutoProcessor")
    if architecture == "videollm":
        monkeypatch.setattr(VideoLlmMoteFrameProcessor, "_auto_class", "AutoImageProcessor")
    folder = tmp_path / "processor"
    processor.save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    assert config["auto_map"]["AutoProcessor"] == f"mote.{type(processor).__name__}"
    assert config["expert_names"] == processor.expert_names
    assert (folder / "mote.py").is_file() and (folder / "inputs.py").is_file()

    rng = np.random.default_rng(0)
    if architecture == "videollm":
        inputs = {"media": "videos", "items": [rng.integers(0, 256, (5, 20, 30, 3)).tolist()],
                  "text": [videollm.render_prompt(task_prompt("task"))], "task": "task"}
    else:
        inputs = {"media": "images", "items": [rng.integers(0, 256, (24, 16, 3)).tolist()],
                  "text": [glm.render_prompt(kie_prompt())], "task": "kie"}
    result = tmp_path / "remote.npz"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, str(folder), json.dumps(inputs), str(result)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    remote = np.load(result)
    media = {inputs["media"]: [np.array(item, dtype=np.uint8) for item in inputs["items"]]}
    expected = processor(text=inputs["text"], task=inputs["task"], padding=True, return_tensors="np", **media)
    assert str(remote["class_name"]) == type(processor).__name__
    assert str(remote["image_processor_class"]) == type(processor.image_processor).__name__
    assert json.loads(str(remote["expert_names"])) == processor.expert_names
    assert set(remote.files) >= set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(remote[key], value, err_msg=key)
