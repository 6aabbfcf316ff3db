"""Assembling processors for presets and conversions (not exported: exported folders carry the processor files).

A preset with a tiny text vocabulary gets a CLIP-format tokenizer built offline (`tiny_tokenizers.py`); a
paper-scale preset gets the real vocabulary from the Hub.
"""

from __future__ import annotations

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


def load_clip_tokenizer(name_or_path: str, model_max_length: int):
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from transformers import CLIPTokenizer

    try:
        return CLIPTokenizer.from_pretrained(name_or_path, model_max_length=model_max_length)
    except (OSError, HfHubHTTPError, LocalEntryNotFoundError) as error:
        raise FileNotFoundError(
            f"cannot load the CLIP tokenizer {name_or_path!r} ({error}); pass --tokenizer with a local tokenizer "
            "folder when offline"
        ) from error


def make_moe_vie_processor(config, tokenizer=None, **image_options) -> MoeVieProcessor:
    """The official preprocessing (square bicubic resize to the config's image size, mean = std = 0.5) with
    `tokenizer`, or a tokenizer matching the config's text vocabulary."""
    text_config, vision_config = config.text_config, config.vision_config
    if tokenizer is None:
        if text_config.vocab_size <= LARGEST_TINY_VOCABULARY:
            words = tuple(dict.fromkeys(SYNTHETIC_WORDS + DEFAULT_WORDS))
            tokenizer = build_tiny_clip_tokenizer(
                words=words, vocab_size=text_config.vocab_size, model_max_length=text_config.max_position_embeddings
            )
        else:
            tokenizer = load_clip_tokenizer(CLIP_TOKENIZER_REPO, text_config.max_position_embeddings)
    image_processor = MoeVieImageProcessor(
        **({"resize_mode": "square", "size": vision_config.image_size, "patch_size": vision_config.patch_size}
           | image_options)
    )
    return MoeVieProcessor(image_processor=image_processor, tokenizer=tokenizer)
