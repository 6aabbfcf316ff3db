"""Assembling OmniMoE-VL processors for presets and conversions (not exported: exported folders carry the processor
files).

A converted checkpoint brings Qwen3's tokenizer and the vision source's preprocessing; a preset with a tiny text
vocabulary gets a byte-level BPE tokenizer in Qwen's format built offline (`build_moemb.build_tiny_qwen_tokenizer`),
whose special tokens sit at the ids the config names.
"""

from __future__ import annotations

from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from .build_moemb import END_OF_TEXT, LARGEST_TINY_VOCABULARY, build_tiny_qwen_tokenizer
from .omnimoe_vl import IM_END, IM_START, IMAGE_TOKEN, VISION_END, VISION_START, OmniMoeVlProcessor

QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-8B"


def tiny_tokenizer_for(config):
    """A tiny Qwen-format tokenizer with the config's image, vision and pad ids, ending turns (and generation) at
    `<|im_end|>` as Qwen3's chat models do."""
    ids = {
        IMAGE_TOKEN: config.image_token_id, VISION_START: config.vision_start_token_id,
        VISION_END: config.vision_end_token_id, END_OF_TEXT: config.text_config.pad_token_id, IM_START: None,
        IM_END: None,
    }  # fmt: skip
    tokenizer = build_tiny_qwen_tokenizer(config.text_config.vocab_size, ids)
    tokenizer.eos_token = IM_END
    return tokenizer


def make_omnimoe_vl_processor(config, tokenizer=None, image_processor=None) -> OmniMoeVlProcessor:
    """
    The processor of an OmniMoE-VL config: `image_processor`, or SigLIP's preprocessing at the vision tower's size
    (squash, bicubic, mean = std = 0.5); `tokenizer`, or one matching the config's vocabulary (`tiny_tokenizer_for`
    for tiny vocabularies, Qwen3's from the Hub otherwise); one placeholder per patch.
    """
    if tokenizer is None:
        if config.text_config.vocab_size <= LARGEST_TINY_VOCABULARY:
            tokenizer = tiny_tokenizer_for(config)
        else:
            from transformers import AutoTokenizer

            from ..hub.sources import TOKENIZER_FILES, locate

            tokenizer = AutoTokenizer.from_pretrained(
                locate(QWEN3_TOKENIZER_REPO, "Qwen3's tokenizer", allow_patterns=TOKENIZER_FILES)
            )
    if image_processor is None:
        size = config.vision_config.image_size
        image_processor = SiglipImageProcessorPil(size={"height": size, "width": size})
    for token, expected in ((IMAGE_TOKEN, config.image_token_id), (VISION_START, config.vision_start_token_id),
                            (VISION_END, config.vision_end_token_id)):
        if tokenizer.convert_tokens_to_ids(token) != expected:
            raise ValueError(
                f"the tokenizer has {token} at id {tokenizer.convert_tokens_to_ids(token)}, the config at {expected}: "
                "pass the model's own tokenizer"
            )
    return OmniMoeVlProcessor(image_processor, tokenizer, num_image_tokens=config.num_image_tokens)
