"""MoTE used the way transformers users use a model (spec mote.md §2.5, §3): batched generation with per-example
routes, activation checkpointing, PEFT adapters. Random tiny models: their experts differ, so a route that does not
follow its example changes the outputs."""

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from moezoo.configuration.mote import TINY_LLAMA_MOTE, LlamaMoteConfig
from moezoo.modeling.mote.llama import LlamaMoteForCausalLM
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from moezoo.processors.mote import VideoLlmMoteProcessor
from moezoo.zoo import create_from_preset
from test_mote_model import routes, token_batch


def distinct_experts(model):
    """The model with experts far enough apart that every route generates its own tokens."""
    with torch.no_grad():
        for _, ffn in model.mote_layers():
            for parameter in ffn.experts.parameters():
                parameter.normal_(0, 0.2)
    return model.eval()


@pytest.fixture
def llama():
    torch.manual_seed(0)
    return distinct_experts(LlamaMoteForCausalLM(LlamaMoteConfig(**TINY_LLAMA_MOTE)))


def gradients(model, batch) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["sample_top1", "token_top1"])
def test_learned_routers_refuse_reentrant_checkpointing_and_train_alike_under_the_default(llama, mode):
    # Reentrant checkpointing back-propagated the sample router's weights once per layer (a RuntimeError in the
    # backward) and dropped the token routers' load-balancing gradient without a word.
    llama.set_routing_mode(mode)
    batch = token_batch()
    expected = gradients(llama, batch)
    assert any("router" in name for name in expected)
    reentrant = copy.deepcopy(llama)
    reentrant.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        gradients(reentrant, batch)
    with torch.no_grad():  # inference is unaffected
        reentrant(**batch)
    llama.activation_checkpointing_enable()
    checkpointed = gradients(llama, batch)
    assert checkpointed.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(checkpointed[name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_reentrant_checkpointing_still_trains_task_routes(llama):
    batch = token_batch() | {"task_ids": routes(0, 3)}
    expected = gradients(llama, batch)
    llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    checkpointed = gradients(llama, batch)
    assert checkpointed.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(checkpointed[name], gradient, msg=name)


@pytest.fixture(scope="module")
def videollm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mote") / "model"
    torch.manual_seed(0)
    create_from_preset("tiny-mote", folder)
    model = distinct_experts(VideoLlmMoteForConditionalGeneration.from_pretrained(folder))
    return model, VideoLlmMoteProcessor.from_pretrained(folder)


@pytest.mark.parametrize("options", [{}, {"use_cache": False}, {"num_beams": 2, "num_return_sequences": 2}])
def test_each_example_of_a_left_padded_video_batch_generates_as_it_does_alone(videollm, options):
    model, processor = videollm
    frames = np.random.default_rng(0).integers(0, 255, (4, 48, 64, 3), dtype=np.uint8)
    videos, tasks = [frames[:2], frames, frames[3:]], ["step", "next", "proc"]
    texts = [processor.render_prompt(prompt) for prompt in ("Narrate.", "What comes next in this video?", "Task?")]
    batch = processor(text=texts, videos=videos, task=tasks, padding=True, padding_side="left", return_tensors="pt")
    options = options | {"max_new_tokens": 4, "do_sample": False}
    together = model.generate(**batch, **options)[:, -4:]
    copies = options.get("num_return_sequences", 1)
    for index in range(len(texts)):
        alone = processor(text=texts[index : index + 1], videos=videos[index : index + 1], task=tasks[index],
                          return_tensors="pt")  # fmt: skip
        expected = model.generate(**alone, **options)[:, -4:]
        assert torch.equal(together[index * copies : (index + 1) * copies], expected), index


def test_lora_adapters_reload_and_merge_to_the_same_routed_outputs(llama, tmp_path):
    batch = token_batch() | {"task_ids": routes(0, 3)}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    adapted = get_peft_model(copy.deepcopy(llama), config)
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    adapted(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    adapted.eval()
    adapted.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(copy.deepcopy(llama), tmp_path).eval()
    with torch.no_grad():
        expected = adapted(**batch).logits
        assert not torch.allclose(expected, llama(**batch).logits)
        assert torch.equal(reloaded(**batch).logits, expected)
        torch.testing.assert_close(reloaded.merge_and_unload()(**batch).logits, expected, atol=1e-5, rtol=1e-4)
