"""MoEMB processor: the spec's prompt formats, the stock Qwen3.5 image and video formats, pooling positions, truncation,
bad inputs, MMEB records, and saving."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.processors.build_moemb import make_moemb_processor
from moezoo.processors.tiny_tokenizers import build_tiny_qwen_tokenizer
from moezoo.processors.moemb import (
    MoEmbImageProcessor,
    MoEmbProcessor,
    mmeb_input,
    patchify_frames,
    sample_frame_indices,
    temporal_step_seconds,
)

CONFIG = MoEmbConfig(**TINY_MOEMB)
EMB, IMAGE, VIDEO, VISION_START, VISION_END = 124, 120, 121, 122, 123


@pytest.fixture(scope="module")
def processor():
    return make_moemb_processor(CONFIG)


def random_image(height=40, width=24, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def random_frames(count=6, size=20, seed=0):
    return list(np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8))


# --- prompts ---------------------------------------------------------------------------------------------------------


def test_chat_prompts_follow_the_spec(processor):
    """Spec §6.2: `<|im_start|>user\\n{instruction}\\n{visual}{text}<|im_end|>\\n<|im_start|>assistant\\n<emb>`."""
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<emb>"
    assert processor.format_prompt("a red circle") == chat.format("a red circle")
    assert processor.format_prompt({"instruction": "Find the caption.", "text": "a dog"}) == chat.format(
        "Find the caption.\na dog"
    )
    image = random_image()
    assert processor.format_prompt({"instruction": "Represent the image.", "images": image}) == chat.format(
        "Represent the image.\n<|image_pad|>"
    )
    # Images first, then the video, then the text.
    item = {"text": "what moves?", "images": [image, image], "video": random_frames()}
    assert processor.format_prompt(item) == chat.format("<|image_pad|><|image_pad|><|video_pad|>what moves?")
    # A text that places its image keeps it where it is.
    placed = {"instruction": "Compare.", "text": "left <|image_pad|> right", "images": [image]}
    assert processor.format_prompt(placed) == chat.format("Compare.\nleft <|image_pad|> right")


def test_raw_prompt_and_last_token_pooling():
    raw = make_moemb_processor(CONFIG, prompt_template="raw")
    assert raw.format_prompt({"instruction": "Find it.", "text": "a cat"}) == "Find it.\na cat<emb>"
    assert raw.format_prompt("a cat") == "a cat<emb>"
    last_token = make_moemb_processor(MoEmbConfig(**TINY_MOEMB, pooling="last_token"))
    assert last_token.emb_token is None
    batch = last_token(["a cat", "a long caption of a dog"])
    assert EMB not in batch["input_ids"]
    rows = torch.arange(2)
    assert (batch["attention_mask"][rows, batch["pooled_index"]] == 1).all()
    assert (batch["pooled_index"] == batch["attention_mask"].sum(-1) - 1).all()


# --- against the stock Qwen3.5 processor -----------------------------------------------------------------------------


@pytest.fixture
def stock(processor, monkeypatch):
    """The stock Qwen3.5 processor (`Qwen3VLProcessor`, what `AutoProcessor` gives Qwen3.5) with the same image
    processor and tokenizer; its video processor only lends its settings (it cannot run without torchvision)."""
    # moezoo registers PIL-only image processors, whose Auto-mapping entries are dicts that transformers' class check
    # for the video processor argument cannot read; the check is irrelevant here.
    monkeypatch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda self, name, argument: None)
    return Qwen3VLProcessor(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=4),
    )  # fmt: skip


def test_images_match_the_stock_qwen3_5_processor(processor, stock):
    """The stock processor on the prompt with the chat template's wrapped placeholders gives the same tokens, token
    types and pixels."""
    images = [random_image(40, 24, seed=1), random_image(17, 33, seed=2)]
    item = {"instruction": "Find the caption.", "text": "a red square", "images": images}
    wrapped = "<|vision_start|><|image_pad|><|vision_end|>"
    template_prompt = processor.format_prompt(item).replace("<|image_pad|>", wrapped)
    expected = stock(text=[template_prompt], images=images, return_tensors="pt")
    ours = processor([item])
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours[key], expected[key]), key
    # One token per 2 x 2 merged patch group.
    assert (ours["input_ids"] == IMAGE).sum() == ours["image_grid_thw"].prod(-1).sum() // 4


def test_video_tokens_match_the_stock_replacement(processor, stock):
    """Per temporal step: its time, then the frame tokens between vision start and end, exactly as
    `Qwen3VLProcessor.replace_video_token` writes them; no outer start/end pair (spec A-34)."""
    frames = random_frames(count=6)
    batch = processor([{"instruction": "Describe.", "video": frames}])
    grid = batch["video_grid_thw"][0].tolist()
    indices = sample_frame_indices(6, processor.image_processor.num_frames)
    metadata = VideoMetadata(total_num_frames=6, fps=processor.image_processor.video_fps, frames_indices=indices)
    video_inputs = {"video_grid_thw": batch["video_grid_thw"], "video_metadata": [metadata]}
    stock_block = stock.replace_video_token(video_inputs, 0)
    ids = batch["input_ids"][0].tolist()
    block = processor.tokenizer(stock_block, add_special_tokens=False)["input_ids"]
    start = ids.index(VISION_START) - len(processor.tokenizer("<0.5 seconds>")["input_ids"])
    assert ids[start : start + len(block)] == block
    assert ids.count(VISION_START) == ids.count(VISION_END) == grid[0]
    assert ids.count(VIDEO) == grid[0] * grid[1] * grid[2] // 4
    assert batch["pixel_values_videos"].shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 4 * 4)
    # The template's wrapped placeholder is replaced whole too.
    wrapped = processor([{"text": "<|vision_start|><|video_pad|><|vision_end|> what moves", "video": frames}])
    assert wrapped["input_ids"][0].tolist().count(VISION_START) == grid[0]


def test_frame_sampling_and_timestamps_follow_qwen3_vl():
    assert sample_frame_indices(6, 8) == [0, 1, 2, 3, 4, 5]
    assert sample_frame_indices(10, 4) == np.linspace(0, 9, 4).round().astype(int).tolist()
    # Steps average their two frames; an odd last step repeats its frame.
    assert temporal_step_seconds([0, 2, 4], fps=2.0, temporal_patch_size=2) == [0.5, 2.0]


def test_patch_layout_matches_qwen3_vl_video_processor():
    frames = np.random.default_rng(0).standard_normal((3, 3, 16, 24)).astype(np.float32)
    ours, grid = patchify_frames(frames, patch_size=4, merge_size=2, temporal_patch_size=2)
    expected, *expected_grid = Qwen3VLVideoProcessor().patchify(
        torch.from_numpy(frames)[None], patch_size=4, merge_size=2, temporal_patch_size=2
    )
    assert grid == tuple(expected_grid) == (2, 4, 6)
    np.testing.assert_array_equal(ours, expected[0].numpy())
    # A still image is one temporal patch of two copies of itself, as the image processor lays it out.
    image_processor = MoEmbImageProcessor(patch_size=4, do_resize=False, do_rescale=False, do_normalize=False)
    still = image_processor(frames[0].transpose(1, 2, 0), return_tensors="np", input_data_format="channels_last")
    patches, _ = patchify_frames(frames[:1], patch_size=4, merge_size=2, temporal_patch_size=2)
    np.testing.assert_array_equal(patches, still["pixel_values"])


# --- batches ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_mixed_batches_pool_at_emb(processor, padding_side):
    items = [
        "a red circle",
        {"instruction": "Find the caption.", "images": [random_image()]},
        {"text": "moving left", "video": random_frames()},
        {"instruction": "Compare.", "text": "<|image_pad|> or <|image_pad|>", "images": [random_image()] * 2},
    ]
    batch = processor(items, padding_side=padding_side)
    rows = torch.arange(len(items))
    assert (batch["input_ids"][rows, batch["pooled_index"]] == EMB).all()
    assert ((batch["input_ids"] == EMB).sum(-1) == 1).all()
    assert batch["image_grid_thw"].shape == (3, 3) and batch["video_grid_thw"].shape == (1, 3)
    assert ((batch["mm_token_type_ids"] == 1) == (batch["input_ids"] == IMAGE)).all()
    assert ((batch["mm_token_type_ids"] == 2) == (batch["input_ids"] == VIDEO)).all()
    padding = batch["attention_mask"] == 0
    assert (batch["input_ids"][padding] == processor.tokenizer.pad_token_id).all()
    if padding_side == "left":
        assert (batch["pooled_index"] == batch["input_ids"].shape[1] - 1).all()
    # The same rows alone give the same tokens: an input does not depend on its batch.
    alone = processor(items[1:2])
    assert alone["input_ids"][0].tolist() == batch["input_ids"][1][batch["attention_mask"][1].bool()].tolist()


def test_queries_and_targets(processor):
    out = processor(queries=["a cat", "a dog"], targets=[{"images": [random_image()]}, "a bird"])
    assert set(out) == {"query", "target"}
    assert out["query"]["input_ids"].shape[0] == out["target"]["input_ids"].shape[0] == 2
    assert "pixel_values" in out["target"] and "pixel_values" not in out["query"]


def test_truncation_cuts_the_end_of_the_text_only(processor):
    instruction = "Find it:"
    image = random_image()
    without_text = processor([{"instruction": instruction, "images": [image]}])["input_ids"].shape[1]
    item = {"instruction": instruction, "text": "a red circle " * 40, "images": [image]}
    full = processor([item])["input_ids"][0]
    max_length = without_text + 12
    ids = processor([item], max_length=max_length)["input_ids"][0]
    assert len(full) > max_length >= len(ids) > without_text
    assert ids[-1] == EMB
    assert (ids == IMAGE).sum() == (full == IMAGE).sum()
    prompt = processor.tokenizer.decode(ids)
    assert prompt.startswith(f"<|im_start|>user\n{instruction}\n<|vision_start|>")
    assert "<|vision_end|>a red circle" in prompt and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n<emb>")


def test_video_from_a_folder_of_frames(processor, tmp_path):
    frames = random_frames(count=5, seed=3)
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(tmp_path / f"{index:03d}.png")
    from_folder = processor([{"video": str(tmp_path)}])
    from_arrays = processor([{"video": frames}])
    assert torch.equal(from_folder["pixel_values_videos"], from_arrays["pixel_values_videos"])
    assert torch.equal(from_folder["input_ids"], from_arrays["input_ids"])


# --- bad inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"text": "<|image_pad|> then <|image_pad|>", "images": [random_image()]}, "2 image placeholder"),
        ({"text": "look: <|image_pad|>"}, "1 image placeholder"),
        ({"instruction": "Represent the query."}, "nothing to embed"),
        ({"text": ""}, "nothing to embed"),
        ({"caption": "a dog"}, "unknown key"),
        ({"text": "two videos <|video_pad|><|video_pad|>", "video": random_frames()}, "at most one video"),
        ({"video": "clip.mp4"}, "decode video files into frames"),
        (3, "give a text or a dict"),
    ],
)
def test_bad_inputs_say_what_to_fix(processor, item, message):
    with pytest.raises(ValueError, match=message):
        processor([item])


def test_visual_tokens_beyond_max_length(processor):
    with pytest.raises(ValueError, match="Raise max_length, or lower the image"):
        processor([{"text": "a cat", "images": [random_image(64, 64)]}], max_length=10)


def test_tokenizer_without_the_chat_tokens_is_rejected(processor):
    bare = build_tiny_qwen_tokenizer(128, {"<|endoftext|>": 0})
    with pytest.raises(ValueError, match="the tokenizer lacks"):
        MoEmbProcessor(processor.image_processor, bare)


# --- MMEB records and files ------------------------------------------------------------------------------------------


def test_mmeb_records(processor, tmp_path):
    random_image().save(tmp_path / "cat.png")
    record = {
        "qry": "<|image_1|>\nRepresent the given image with the following question: What is it?",
        "qry_image_path": "cat.png", "pos_text": "A cat.", "pos_image_path": "", "neg_text": "A dog.",
        "neg_image_path": "",
    }  # fmt: skip
    query = MoEmbProcessor.from_mmeb_record(record, "query", image_root=tmp_path)
    assert query == {
        "text": "<|image_pad|>\nRepresent the given image with the following question: What is it?",
        "images": [str(tmp_path / "cat.png")],
    }
    assert MoEmbProcessor.from_mmeb_record(record, "target") == {"text": "A cat."}
    assert MoEmbProcessor.from_mmeb_record(record, "negative") == {"text": "A dog."}
    assert mmeb_input("", None) == {"text": None}
    prompt = processor.tokenizer.decode(processor([query])["input_ids"][0])
    assert prompt.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert "<|vision_end|>\nRepresent the given image" in prompt


def test_save_and_load(processor, tmp_path):
    AutoImageProcessor.register(MoEmbConfig, image_processor_classes={"pil": MoEmbImageProcessor}, exist_ok=True)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["emb_token"] == "<emb>"
    assert saved["image_processor"]["num_frames"] == processor.image_processor.num_frames
    assert saved["image_processor"]["patch_size"] == 4
    loaded = MoEmbProcessor.from_pretrained(tmp_path)
    items = ["a cat", {"instruction": "Find it.", "images": [random_image()], "video": random_frames()}]
    expected, got = processor(items), loaded(items)
    assert set(expected) == set(got)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<emb>", "<|endoftext|>"]) == [IMAGE, EMB, 0]


def test_folders_saved_with_the_frame_settings_on_the_processor_load(processor, tmp_path):
    """Folders saved before the frame settings moved to the image processor hold them in processor_config.json: they
    still apply, and max_length there (now a call option) is dropped."""
    AutoImageProcessor.register(MoEmbConfig, image_processor_classes={"pil": MoEmbImageProcessor}, exist_ok=True)
    processor.save_pretrained(tmp_path)
    config_file = tmp_path / "processor_config.json"
    saved = json.loads(config_file.read_text())
    saved |= {"num_frames": 2, "video_fps": 4.0, "max_length": 8192}
    config_file.write_text(json.dumps(saved))
    loaded = MoEmbProcessor.from_pretrained(tmp_path)
    assert (loaded.image_processor.num_frames, loaded.image_processor.video_fps) == (2, 4.0)
    batch = loaded([{"video": random_frames(count=6)}])
    assert batch["video_grid_thw"][0, 0] == 1  # two frames: one temporal step
