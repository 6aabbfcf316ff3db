"""OmniMoE-VL's processor (spec omnimoe_vl.md §6): the ChatML template, the placeholder expansion, `prompt_mask`,
`labels`, left padding, the bad-input errors, a save/load round trip, and the processor feeding the tiny model
(forward with a loss, batched `generate`, the image-text-to-text pipeline, also on an exported folder without
moezoo), and the converter's processor."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoProcessor,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    pipeline,
)
from transformers.image_utils import PILImageResampling
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

import moezoo  # noqa: F401  (registers the Auto classes)
from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.conversion.omnimoe_vl_upcycle import convert
from moezoo.hub.export import export_folder
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from moezoo.processors.build_omnimoe_vl import make_omnimoe_vl_processor, tiny_tokenizer_for
from moezoo.processors.omnimoe_vl import IGNORE_INDEX, OmniMoeVlProcessor
from moezoo.zoo import create_from_preset

from conftest import run_python

QUESTION = "what color is the car?"


@pytest.fixture(scope="module")
def config():
    return OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL))


@pytest.fixture(scope="module")
def processor(config):
    return make_omnimoe_vl_processor(config)


def image(height=40, width=50, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def conversation(question=QUESTION, answer=None, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


def tokens(processor, ids, mask):
    return processor.tokenizer.decode([token for token, keep in zip(ids.tolist(), mask.tolist()) if keep])


def test_chat_template_is_plain_chatml_with_the_image_first(processor):
    text = processor.apply_chat_template(conversation(answer="red", system="Be brief."))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nwhat color is the car?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
    )
    prompt = processor.apply_chat_template(conversation(), add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_outputs_expand_one_placeholder_per_patch(processor, config):
    prompt = processor.apply_chat_template(conversation(), add_generation_prompt=True)
    inputs = processor(images=[image()], text=[prompt], return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "prompt_mask"}
    ids = inputs["input_ids"][0]
    placeholders = (ids == config.image_token_id).nonzero().flatten()
    assert len(placeholders) == config.num_image_tokens == 16
    assert placeholders.diff().eq(1).all()  # one contiguous run, wrapped once by the start and end tokens
    assert ids[placeholders[0] - 1] == config.vision_start_token_id
    assert ids[placeholders[-1] + 1] == config.vision_end_token_id
    assert (ids == config.vision_start_token_id).sum() == 1 == (ids == config.vision_end_token_id).sum()
    # Squashed to the tower's size (no crop), rescaled and normalised with mean = std = 0.5.
    assert inputs["pixel_values"].shape == (1, 3, 64, 64)
    assert inputs["pixel_values"].min() >= -1 and inputs["pixel_values"].max() <= 1
    assert inputs["prompt_mask"].dtype == torch.int64


def test_prompt_mask_is_the_question_and_labels_the_answer(processor):
    text = processor.apply_chat_template(conversation(answer="red", system="Be brief."))
    inputs = processor(images=[image()], text=[text], return_labels=True, return_tensors="pt")
    ids, prompt_mask, labels = inputs["input_ids"][0], inputs["prompt_mask"][0], inputs["labels"][0]
    # The whitespace-only token inside the question is left out; every other question token is in.
    assert tokens(processor, ids, prompt_mask).replace(" ", "") == QUESTION.replace(" ", "")
    answer = labels != IGNORE_INDEX
    assert tokens(processor, ids, answer) == "red<|im_end|>"
    assert torch.equal(labels[answer], ids[answer])
    assert not (prompt_mask.bool() & answer).any()
    assert "labels" not in processor(images=[image()], text=[text])


def test_prompt_mask_matches_the_offsets_rule_on_a_word_level_tokenizer(config):
    """Spec Appendix S.5: on an offline WordLevel tokenizer the token rule marks the tokens whose character span
    overlaps the question's."""
    words = ["user", "assistant", "system", "what", "color", "is", "the", "car", "?", "red", "blue"]
    word_level = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate([*words, "[UNK]"])}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="[UNK]", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"],
    )  # fmt: skip
    processor = OmniMoeVlProcessor(make_omnimoe_vl_processor(config).image_processor, tokenizer, num_image_tokens=1)
    text = processor.apply_chat_template(conversation(answer="red"))
    inputs = processor(images=[image()], text=[text], return_offsets_mapping=True)
    start = text.index(QUESTION)
    expected = [int(begin < start + len(QUESTION) and end > start) for begin, end in inputs["offset_mapping"][0]]
    assert inputs["prompt_mask"][0] == expected
    assert tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])[:12] == [
        "<|im_start|>", "user", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "what", "color", "is", "the",
        "car", "?", "<|im_end|>",
    ]  # fmt: skip
    assert inputs["prompt_mask"][0][:12] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]


def test_batches_are_left_padded(processor):
    prompts = [processor.apply_chat_template(conversation(question), add_generation_prompt=True)
               for question in ("what color is the car?", "red?")]  # fmt: skip
    batch = processor(images=[image(seed=0), image(seed=1)], text=prompts, padding=True, return_tensors="pt")
    short = processor(images=[image(seed=1)], text=prompts[1:], return_tensors="pt")
    length = short["input_ids"].shape[1]
    assert torch.equal(batch["input_ids"][1, -length:], short["input_ids"][0])
    assert torch.equal(batch["prompt_mask"][1, -length:], short["prompt_mask"][0])
    padding = batch["input_ids"].shape[1] - length
    assert padding > 0 and batch["attention_mask"][1, :padding].eq(0).all()
    assert batch["prompt_mask"][1, :padding].eq(0).all()
    assert torch.equal(batch["pixel_values"][1], short["pixel_values"][0])


@pytest.mark.parametrize(
    ("images", "text", "message"),
    [
        ([image(), image()], "one", "should be the same as the number of images"),
        (None, "one", "no images were passed"),
        ([image()], "<|im_start|>user\n<|image_pad|>what<|im_end|>\n", None),
        # Several images in one prompt are formatted; the model is what refuses them (one image per sample).
        ([image(), image()], "two", None),
        # A prompt without ChatML turns is one user question, as transformers' plain image-text prompts.
        ([image()], "<|vision_start|><|image_pad|><|vision_end|>\nwhat color is the car?", None),
        ([image()], "<|im_start|>system\n<|image_pad|><|im_end|>\n", "outside a user turn"),
    ],
)
def test_bad_inputs_are_clear_errors(processor, images, text, message):
    prompts = {
        "one": processor.apply_chat_template(conversation(), add_generation_prompt=True),
        "two": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>"
               "<|vision_end|>\nwhat<|im_end|>\n",
    }  # fmt: skip
    text = prompts.get(text, text)
    if message is None:  # a well-formed prompt written by hand
        assert processor(images=images, text=text)["prompt_mask"][0].count(1) > 0
        return
    with pytest.raises(ValueError, match=message):
        processor(images=images, text=text)


def test_save_and_load_round_trip(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded) is OmniMoeVlProcessor
    assert loaded.num_image_tokens == processor.num_image_tokens
    assert loaded.chat_template == processor.chat_template
    assert loaded.tokenizer.padding_side == processor.tokenizer.padding_side
    text = processor.apply_chat_template(conversation(answer="red"))
    expected = processor(images=[image()], text=[text], return_labels=True, return_tensors="pt")
    got = loaded(images=[image()], text=[text], return_labels=True, return_tensors="pt")
    assert set(got) == set(expected) and all(torch.equal(got[key], expected[key]) for key in expected)


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return OmniMoeVlForConditionalGeneration(config).eval()


def test_processor_output_trains_and_generates_with_the_model(processor, model):
    texts = [processor.apply_chat_template(conversation(question, answer="red"))
             for question in ("what color is the car?", "is the car blue?")]  # fmt: skip
    batch = processor(images=[image(seed=0), image(seed=1)], text=texts, padding=True, return_labels=True,
                      return_tensors="pt")  # fmt: skip
    loss = model(**batch).loss
    assert torch.isfinite(loss)

    prompts = [processor.apply_chat_template(conversation(question), add_generation_prompt=True)
               for question in ("what color is the car?", "blue?")]  # fmt: skip
    images = [image(seed=0), image(seed=1)]
    batch = processor(images=images, text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        together = model.generate(**batch, max_new_tokens=5, do_sample=False)[:, batch["input_ids"].shape[1]:]
        for row, (picture, prompt) in enumerate(zip(images, prompts)):
            alone = processor(images=[picture], text=[prompt], return_tensors="pt")
            tokens = model.generate(**alone, max_new_tokens=5, do_sample=False)[:, alone["input_ids"].shape[1]:]
            assert torch.equal(together[row], tokens[0])


def test_image_text_to_text_pipeline(processor, model, tmp_path):
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    generator = pipeline("image-text-to-text", model=str(tmp_path))
    messages = [{"role": "user", "content": [{"type": "image", "image": image()}, {"type": "text", "text": QUESTION}]}]
    output = generator(text=messages, max_new_tokens=4, generate_kwargs={"do_sample": False})
    assert output[0]["generated_text"][-1]["role"] == "assistant"


def test_conversion_writes_the_sources_tokenizer_and_preprocessing(config, tmp_path):
    text, vision = config.text_config, config.vision_config
    qwen3 = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim, tie_word_embeddings=False,
    ))  # fmt: skip
    qwen3.save_pretrained(tmp_path / "qwen3")
    source_tokenizer = tiny_tokenizer_for(config)
    source_tokenizer.save_pretrained(tmp_path / "qwen3")
    SiglipVisionModel(SiglipVisionConfig(
        hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size, num_attention_heads=4,
        num_hidden_layers=vision.num_hidden_layers, patch_size=vision.patch_size, image_size=vision.image_size,
    )).save_pretrained(tmp_path / "siglip")  # fmt: skip
    SiglipImageProcessorPil(resample=PILImageResampling.BILINEAR).save_pretrained(tmp_path / "siglip")

    tokens = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
    projector = {key: value for key, value in TINY_OMNIMOE_VL.items()
                 if key not in {"vision_config", "text_config", "vision_feature_layers", "injection_layers", *tokens}}
    token_ids = {name: getattr(config, name) for name in tokens}
    result = convert(tmp_path / "qwen3", vision=tmp_path / "siglip", verify=False, projector=projector,
                     vision_feature_layers=config.vision_feature_layers, **token_ids)  # fmt: skip
    result.model.save_pretrained(tmp_path / "converted")
    result.processor.save_pretrained(tmp_path / "converted")
    processor = AutoProcessor.from_pretrained(tmp_path / "converted")
    assert processor.tokenizer.get_vocab() == source_tokenizer.get_vocab()
    assert processor.image_processor.resample == PILImageResampling.BILINEAR
    assert processor.image_processor.size == {"height": vision.image_size, "width": vision.image_size}
    assert processor.num_image_tokens == config.num_image_tokens


def test_image_text_to_text_pipeline_on_an_exported_folder_without_moezoo(tmp_path):
    create_from_preset("tiny-omnimoe_vl", tmp_path / "created")
    export_folder(tmp_path / "created", tmp_path / "exported")
    run_python(f"""
        import numpy as np
        from PIL import Image
        from transformers import pipeline

        generator = pipeline("image-text-to-text", model={str(tmp_path / "exported")!r}, trust_remote_code=True)
        image = Image.fromarray(np.zeros((40, 50, 3), dtype=np.uint8))
        messages = [{{"role": "user", "content": [{{"type": "image", "image": image}},
                                                 {{"type": "text", "text": "what color is the car?"}}]}}]
        output = generator(text=messages, max_new_tokens=4, generate_kwargs={{"do_sample": False}})
        assert output[0]["generated_text"][-1]["role"] == "assistant", output
    """, without_moezoo=True)
