"""MoE-ViE as transformers / OpenCLIP users drive it: regressions from a user-journey bug bash (PEFT LoRA, upcycled
SigLIP2 text preprocessing)."""

import pytest
import torch
from transformers import Siglip2Config, Siglip2Model

from moezoo.conversion import moe_vie_upcycle
from moezoo.processors.build import SYNTHETIC_WORDS
from moezoo.processors.moe_vie import MoeVieProcessor
from moezoo.processors.tiny_tokenizers import DEFAULT_WORDS, build_tiny_clip_tokenizer
from moezoo.training.moe_vie import with_lora
from test_moe_vie_conversion import TINY_SIGLIP_TEXT, TINY_SIGLIP_VISION, perturbed
from test_moe_vie_model import batch, tiny_model


def test_every_lora_adapter_is_used_by_the_forward():
    """`out_proj` alone also matched the pooling head's `nn.MultiheadAttention`, which reads `out_proj.weight`
    directly: that adapter was counted as trainable, never received a gradient and never changed the model."""
    model = with_lora(tiny_model(), rank=2).train()
    model(**batch(), return_loss=True).loss.backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert unused == []
    assert any(".mlp.experts." in name for name, p in model.named_parameters() if p.requires_grad)


def test_upcycled_siglip2_pads_texts_to_the_text_tower_length(tmp_path):
    """SigLIP pools the last position of texts padded to 64 tokens. SigLIP2's Gemma tokenizer has no model length
    (Siglip2Processor passes max_length=64 itself), so the upcycled processor left a single text unpadded (a wrong
    embedding) and could not batch texts of different lengths."""
    torch.manual_seed(0)
    siglip2 = perturbed(Siglip2Model(Siglip2Config(text_config=TINY_SIGLIP_TEXT,
                                                   vision_config=TINY_SIGLIP_VISION | {"num_patches": 16})))
    siglip2.save_pretrained(tmp_path / "siglip2")
    # A tokenizer that, like Gemma's, does not know the length its texts must be padded to.
    words = tuple(dict.fromkeys(SYNTHETIC_WORDS + DEFAULT_WORDS))
    build_tiny_clip_tokenizer(words, vocab_size=128, model_max_length=int(1e30)).save_pretrained(tmp_path / "tokenizer")
    result = moe_vie_upcycle.convert(tmp_path / "siglip2", tokenizer=str(tmp_path / "tokenizer"), num_experts=8,
                                     top_k=3)
    result.processor.save_pretrained(tmp_path / "upcycled")
    processor = MoeVieProcessor.from_pretrained(tmp_path / "upcycled")

    texts = ["a red circle", "a photo of a blue square"]
    inputs = processor(text=texts, return_tensors="pt")
    assert inputs["input_ids"].shape == (2, TINY_SIGLIP_TEXT["max_position_embeddings"])
    model = result.model.load()  # the converter streams the model into a folder
    with torch.no_grad():
        together = model.get_text_features(**inputs).pooler_output
        alone = model.get_text_features(**processor(text=texts[:1], return_tensors="pt")).pooler_output
        expected = siglip2.get_text_features(**inputs).pooler_output
    assert torch.allclose(alone[0], together[0], atol=1e-6)
    assert torch.allclose(together, expected, atol=1e-5)


def router_aux_loss_gradients(checkpointing: dict | None):
    model = tiny_model(vision_config={"router_aux_loss_type": "load_balancing", "router_aux_loss_coef": 1.0}).train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    model(**batch(), return_loss=True).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if ".gate." in name}


def test_router_aux_loss_refuses_reentrant_checkpointing_and_trains_alike_under_the_default():
    """Reentrant checkpointing records the router logits in a pass without gradients: the auxiliary loss silently
    trained nothing (router gradients off by 2e-2)."""
    expected = router_aux_loss_gradients(None)
    assert expected
    for name, grad in router_aux_loss_gradients({"use_reentrant": False}).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="reentrant activation checkpointing.*use_reentrant': False"):
        router_aux_loss_gradients({"use_reentrant": True})
