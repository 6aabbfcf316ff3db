"""Live streams with VideoLLM-MoTE: the streaming training example (labels with silence targets, spec §3.1, §6.1,
§9 item 7), the collator, and the frame-by-frame inference session against the model's full forward."""

import numpy as np
import pytest
import torch

from moezoo.configuration.mote import TINY_VIDEOLLM_MOTE, VideoLlmMoteConfig
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from moezoo.modeling.mote.streaming import VideoLlmMoteStream
from moezoo.processors.build_mote import make_videollm_mote_processor
from moezoo.training.mote import MoteCollator


CONFIG = VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE)
VIDEO, EOS, INTERVAL = 120, 2, 11  # the tiny tokenizer's <v>, <|eot_id|> and ","


@pytest.fixture(scope="module")
def processor():
    return make_videollm_mote_processor(CONFIG, words=("stir", "boil", "tea", "narrate"))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VideoLlmMoteForConditionalGeneration(CONFIG).eval()


def random_video(num_frames, seed=0):
    return list(np.random.default_rng(seed).integers(0, 256, (num_frames, 24, 24, 3), dtype=np.uint8))


def tokens(processor, ids):
    return processor.tokenizer.convert_ids_to_tokens(ids)


def test_stream_example_puts_responses_after_their_frames_and_silence_after_the_others(processor):
    out = processor.encode_stream(random_video(4), {1: "Stir tea"}, "narrate", task="next", return_tensors="pt")
    ids, labels = out["input_ids"][0].tolist(), out["labels"][0].tolist()
    assert out["video_num_frames"].tolist() == [4] and out["pixel_values_videos"].shape == (4, 3, 32, 32)
    assert out["task_ids"].tolist() == [processor.expert_names.index("next")]
    assert out["attention_mask"].tolist() == [[1] * len(ids)]
    frame = ["<v>"] * 10
    stream = tokens(processor, ids[ids.index(processor.tokenizer.convert_tokens_to_ids("[")):])
    assert stream == (
        ["["] + frame + [","] + frame + ["]", "assistant", ":", "stir", "tea", "<|eot_id|>"]
        + ["["] + frame + [","] + frame + ["]"]
    )  # fmt: skip
    supervised = [(token, label) for token, label in zip(tokens(processor, ids), labels) if label != -100]
    response = [(token, processor.tokenizer.convert_tokens_to_ids(token))
                for token in ["]", "assistant", ":", "stir", "tea", "<|eot_id|>"]]  # fmt: skip
    # Frames 0, 2 and 3 are silent: the token after their last <v> carries the silence target (EOS).
    assert supervised == [(",", EOS)] + response + [(",", EOS), ("]", EOS)]
    assert all(ids[j - 1] == VIDEO for j, label in enumerate(labels) if label == EOS and ids[j] != EOS)


def test_interval_silence_and_a_response_after_the_last_frame(processor):
    out = processor.encode_stream(random_video(3), {2: "boil"}, "narrate", silence_token="interval")
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert "task_ids" not in out
    assert [label for label in labels if label != -100] == [INTERVAL, INTERVAL] + ids[-5:]
    assert tokens(processor, ids[-5:]) == ["]", "assistant", ":", "boil", "<|eot_id|>"]


def test_bad_stream_inputs_say_what_to_fix(processor):
    with pytest.raises(ValueError, match=r"Responses follow frames \[3\], but the stream has 3 frames"):
        processor.encode_stream(random_video(3), {3: "late"}, "narrate")
    with pytest.raises(ValueError, match="silence_token='bos' is not one of"):
        processor.encode_stream(random_video(3), {}, "narrate", silence_token="bos")


def test_collator_batches_streams_with_offline_examples(processor):
    collator = MoteCollator(processor, silence_token="eos")
    stream = {"task": "step", "prompt": "narrate", "frames": random_video(3),
              "responses": [{"frame": 0, "text": "stir"}], "answer": None}  # fmt: skip
    offline = {"task": "next", "prompt": "what next?", "frames": random_video(2, seed=1), "answer": "boil tea",
               "responses": None}  # fmt: skip
    batch = collator([stream, offline])
    expected = processor.encode_stream(stream["frames"], {0: "stir"}, "narrate", task="step")
    length = len(expected["input_ids"][0])
    assert batch["input_ids"][0, :length].tolist() == expected["input_ids"][0]
    assert batch["labels"][0, :length].tolist() == expected["labels"][0]
    assert batch["video_num_frames"].tolist() == [3, 2] and batch["task_ids"].tolist() == [0, 1]
    assert batch["pixel_values_videos"].shape == (5, 3, 32, 32)
    assert set(batch["labels"][1][batch["labels"][1] != -100].tolist()) <= set(batch["input_ids"][1].tolist())


def test_training_on_streams_reaches_the_silence_targets(processor, model):
    """The loss of a stream example is the next-token loss on exactly its labelled positions."""
    inputs = processor.encode_stream(random_video(3), {1: "stir"}, "narrate", task="step", return_tensors="pt")
    output = model(**inputs)
    logits, labels = output.logits[0, :-1], inputs["labels"][0, 1:]
    expected = torch.nn.functional.cross_entropy(logits[labels != -100], labels[labels != -100])
    torch.testing.assert_close(output.loss, expected)


@pytest.mark.parametrize("silence_threshold", [None, 0.5, 1.0])
def test_stream_session_equals_the_full_forward_over_what_it_read(processor, model, silence_threshold, monkeypatch):
    """Every decision the session takes (silence after a frame, each greedy answer token) comes from logits equal to
    those of one forward pass over everything it read; a threshold of 1 makes it answer after every frame."""
    video = random_video(4, seed=2)
    stream = VideoLlmMoteStream(model, processor, "narrate", task="proc", silence_threshold=silence_threshold,
                                max_new_tokens=3)  # fmt: skip
    read = stream.read
    seen = []

    def recording_read(token_ids, pixel_values=None):
        logits = read(token_ids, pixel_values)
        seen.append((len(stream.token_ids), logits))
        return logits

    monkeypatch.setattr(stream, "read", recording_read)
    replies = [stream.step(frame) for frame in video]
    frames = processor.image_processor([video], return_tensors="pt")
    with torch.no_grad():
        full = model(input_ids=torch.tensor([stream.token_ids]), task_ids=torch.tensor([2]), **frames).logits[0]
    for length, logits in seen:
        torch.testing.assert_close(logits, full[length - 1], atol=1e-5, rtol=0)
    probabilities = full.softmax(-1)[:, EOS]
    last_placeholders = [j for j, token in enumerate(stream.token_ids)
                         if token == VIDEO and (j + 1 == len(stream.token_ids) or stream.token_ids[j + 1] != VIDEO)]
    torch.testing.assert_close(torch.tensor(stream.silence_probabilities), probabilities[last_placeholders],
                               atol=1e-6, rtol=0)  # fmt: skip
    assert len(stream.silence_probabilities) == 4
    if silence_threshold == 1.0:
        assert all(isinstance(reply, str) for reply in replies)
        closing = processor.tokenizer.convert_tokens_to_ids("]")
        assert [stream.token_ids[j + 1] for j in last_placeholders] == [closing] * 4


def test_stream_session_rejects_bad_settings(processor, model):
    with pytest.raises(ValueError, match="silence_threshold must be in"):
        VideoLlmMoteStream(model, processor, "narrate", silence_threshold=0)
    with pytest.raises(ValueError, match="Unknown task .narration.: this processor.s experts are"):
        VideoLlmMoteStream(model, processor, "narrate", task="narration")


# --- learning -------------------------------------------------------------------------------------------------------

COLOURS = {"stir": (220, 30, 30), "boil": (30, 30, 220)}  # a red frame is narrated "stir", a blue one "boil"


def narrated_stream(rng, num_frames):
    """Frames of flat colour: grey ones pass in silence, red and blue ones are narrated right after they show."""
    frames, responses = [], []
    for k in range(num_frames):
        word = rng.choice(["", "", "stir", "boil"])
        colour = np.array(COLOURS.get(word, (128, 128, 128))) + rng.integers(-20, 20, 3)
        frames.append(np.broadcast_to(np.clip(colour, 0, 255).astype(np.uint8), (16, 16, 3)).copy())
        if word:
            responses.append({"frame": k, "text": str(word)})
    return {"task": "step", "prompt": "narrate", "frames": frames, "responses": responses}


@pytest.mark.slow
def test_a_tiny_model_learns_when_to_speak_and_what_to_say(processor):
    """100 steps on 5-frame streams; then, live on longer held-out streams, the session stays silent after grey
    frames and says the right word right after each coloured one."""
    torch.manual_seed(0)
    model = VideoLlmMoteForConditionalGeneration(CONFIG)
    collator = MoteCollator(processor, silence_token=CONFIG.stream_silence_token)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(100):
        model(**collator([narrated_stream(rng, 5) for _ in range(8)])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    right = total = 0
    for seed in range(10):
        example = narrated_stream(np.random.default_rng(100 + seed), 6)
        expected = {response["frame"]: response["text"] for response in example["responses"]}
        session = VideoLlmMoteStream(model, processor, "narrate", task="step", max_new_tokens=4)
        replies = [session.step(frame) for frame in example["frames"]]
        right += sum(reply == expected.get(k) for k, reply in enumerate(replies))
        total += len(replies)
    assert right / total >= 0.9, f"{right}/{total} frames answered right"
