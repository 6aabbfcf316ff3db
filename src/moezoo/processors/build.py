"""Assembling processors for presets and conversions (not exported: exported folders carry the processor files).

A preset with a tiny text vocabulary gets a CLIP-format tokenizer built offline (`tiny_tokenizers.py`); a
paper-scale preset gets the real vocabulary from the Hub.
"""

from __future__ import annotations

from pathlib import Path

from ..hub.sources import TOKENIZER_FILES, locate
from .moe_vie import MoeVieImageProcessor, MoeVieProcessor
from .tiny_tokenizers import DEFAULT_WORDS, build_tiny_clip_tokenizer


# OpenAI's CLIP BPE vocabulary (49408 tokens), the one MoE-ViE's official text tower was trained with.
CLIP_TOKENIZER_REPO = "openai/clip-vit-base-patch32"
# The words of moezoo's synthetic data sets (coloured shapes, moving shapes) come first, so they are whole tokens.
SYNTHETIC_WORDS = (
    "a", "photo", "of", "red", "green", "blue", "yellow", "circle", "square", "triangle", "cross", "moving", "left",
    "right", "up", "down",
)  # fmt: skip
LARGEST_TINY_VOCABULARY = 1000


def load_clip_tokenizer(name_or_path: str | Path, model_max_length: int):
    """CLIP's tokenizer from a folder or the Hub (see `moezoo.hub.sources.locate`)."""
    from transformers import CLIPTokenizer

    folder = locate(name_or_path, "CLIP's tokenizer", allow_patterns=TOKENIZER_FILES)
    return CLIPTokenizer.from_pretrained(folder, model_max_length=model_max_length)


def check_tokenizer_matches(tokenizer, text_config) -> None:
    """Raise unless `tokenizer` can be the text tower's: a vocabulary of one token per token embedding and, for EOS
    pooling, the end-of-text id the tower pools at.

    transformers returns an empty tokenizer (its special tokens only) instead of raising when it cannot find the
    files, offline or from a mistyped path; without this check it would be saved next to the model unnoticed.
    The vocabulary is compared without added tokens, which some tokenizer classes add (Siglip2's `<mask>`).
    """
    if tokenizer.vocab_size != text_config.vocab_size:
        mismatch = (
            f"has a vocabulary of {tokenizer.vocab_size} tokens but the text tower has {text_config.vocab_size} "
            "token embeddings"
        )
    elif text_config.pooling_type == "eos" and tokenizer.eos_token_id != text_config.eos_token_id:
        mismatch = (
            f"ends texts with token {tokenizer.eos_token_id} but the text tower pools at eos_token_id="
            f"{text_config.eos_token_id}"
        )
    else:
        return
    raise FileNotFoundError(
        f"the tokenizer {tokenizer.name_or_path!r} {mismatch}, so it is not this model's tokenizer (transformers "
        "loads an empty one when it cannot find the files); pass --tokenizer with the model's tokenizer, a local "
        "tokenizer folder when offline"
    )


def make_moe_vie_processor(config, tokenizer=None, **image_options) -> MoeVieProcessor:
    """The official preprocessing (square bicubic resize to the config's image size, mean = std = 0.5) with
    `tokenizer`, or a tokenizer matching the config's text vocabulary. Raises `FileNotFoundError` when the
    tokenizer does not match the text tower (see `check_tokenizer_matches`)."""
    text_config, vision_config = config.text_config, config.vision_config
    if tokenizer is None:
        if text_config.vocab_size <= LARGEST_TINY_VOCABULARY:
            words = tuple(dict.fromkeys(SYNTHETIC_WORDS + DEFAULT_WORDS))
            tokenizer = build_tiny_clip_tokenizer(
                words=words, vocab_size=text_config.vocab_size, model_max_length=text_config.max_position_embeddings
            )
        else:
            tokenizer = load_clip_tokenizer(CLIP_TOKENIZER_REPO, text_config.max_position_embeddings)
    check_tokenizer_matches(tokenizer, text_config)
    image_processor = MoeVieImageProcessor(
        **({"resize_mode": "square", "size": vision_config.image_size, "patch_size": vision_config.patch_size}
           | image_options)
    )
    return MoeVieProcessor(image_processor=image_processor, tokenizer=tokenizer)
