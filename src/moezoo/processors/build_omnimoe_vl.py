"""Assembling OmniMoE-VL processors for presets and conversions (not exported: exported folders carry the processor
files).

A converted checkpoint brings Qwen3's tokenizer and the vision source's preprocessing; a preset with a tiny text
vocabulary gets a byte-level BPE tokenizer in Qwen's format built offline (`tiny_tokenizers.build_tiny_qwen_tokenizer`),
whose special tokens sit at the ids the config names.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from ..hub.sources import TOKENIZER_FILES, locate
from .omnimoe_vl import OmniMoeVlProcessor
from .qwen_tokens import END_OF_TEXT, IM_END, IM_START, IMAGE_TOKEN, VISION_END, VISION_START
from .tiny_tokenizers import LARGEST_TINY_QWEN_VOCABULARY, build_tiny_qwen_tokenizer

QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-8B"
# What a converted model keeps of its vision source's preprocessing (spec §6: the resample filter comes from the
# checkpoint); the size is the converted tower's.
SOURCE_IMAGE_OPTIONS = ("resample", "image_mean", "image_std", "rescale_factor", "do_convert_rgb")


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


def make_omnimoe_vl_processor(config, tokenizer=None, **image_options) -> OmniMoeVlProcessor:
    """
    The processor of an OmniMoE-VL config: SigLIP's preprocessing at the vision tower's size (squash, bicubic,
    mean = std = 0.5; `image_options` override any of these), `tokenizer` or one matching the config's vocabulary
    (`tiny_tokenizer_for` for tiny vocabularies, Qwen3's from the Hub otherwise), and one placeholder per patch.
    """
    if tokenizer is None:
        if config.text_config.vocab_size <= LARGEST_TINY_QWEN_VOCABULARY:
            tokenizer = tiny_tokenizer_for(config)
        else:
            tokenizer = AutoTokenizer.from_pretrained(
                locate(QWEN3_TOKENIZER_REPO, "Qwen3's tokenizer", allow_patterns=TOKENIZER_FILES)
            )
    for token, expected in ((IMAGE_TOKEN, config.image_token_id), (VISION_START, config.vision_start_token_id),
                            (VISION_END, config.vision_end_token_id)):  # fmt: skip
        if tokenizer.convert_tokens_to_ids(token) != expected:
            raise ValueError(
                f"the tokenizer has {token} at id {tokenizer.convert_tokens_to_ids(token)}, the config at {expected}: "
                "pass the model's own tokenizer"
            )
    size = config.vision_config.image_size
    image_processor = SiglipImageProcessorPil(**({"size": {"height": size, "width": size}} | image_options))
    return OmniMoeVlProcessor(image_processor, tokenizer, num_image_tokens=config.num_image_tokens)


def conversion_processor(config, text_source: Path, vision_source: Path) -> OmniMoeVlProcessor:
    """
    The processor of a converted model: the language source's tokenizer (Qwen3's from the Hub when the folder has
    none), and the vision source's normalisation and resample filter from its `preprocessor_config.json`, at the
    converted tower's fixed size (a NaFlex source's own sizing, by patch budget, does not apply to the fixed grid).
    """
    has_tokenizer = (text_source / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(text_source) if has_tokenizer else None
    preprocessing = vision_source / "preprocessor_config.json"
    source_options = json.loads(preprocessing.read_text()) if preprocessing.is_file() else {}
    image_options = {key: source_options[key] for key in SOURCE_IMAGE_OPTIONS if key in source_options}
    return make_omnimoe_vl_processor(config, tokenizer, **image_options)
