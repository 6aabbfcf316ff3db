"""Assembling MoEMB processors for presets and conversions (not exported: exported folders carry the processor files).

A converted checkpoint brings Qwen3.5's tokenizer, to which the conversion adds `<emb>` (`add_emb_token`). A preset
with a tiny text vocabulary gets a byte-level BPE tokenizer in Qwen3.5's format built offline here, whose special
tokens sit at the ids the config names; a paper-scale preset gets Qwen3.5's tokenizer from the Hub.
"""

from __future__ import annotations

from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from ..hub.sources import TOKENIZER_FILES, locate
from .moemb import EMB_TOKEN, MoEmbImageProcessor, MoEmbProcessor, add_emb_token
from .qwen_tokens import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    QWEN3_5_TOKENIZER_REPO,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
)
from .tiny_tokenizers import LARGEST_TINY_QWEN_VOCABULARY, build_tiny_qwen_tokenizer


def load_qwen_tokenizer(name_or_path: str, emb_token: str = EMB_TOKEN):
    """Qwen3.5's tokenizer from a folder or the Hub (see `moezoo.hub.sources.locate`), with `emb_token` added."""
    from transformers import AutoTokenizer

    folder = locate(name_or_path, "Qwen3.5's tokenizer", allow_patterns=TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    add_emb_token(tokenizer, emb_token)
    return tokenizer


def tiny_tokenizer_for(config) -> Qwen3_5Tokenizer:
    """A tiny tokenizer (see `build_tiny_qwen_tokenizer`) whose special tokens sit at the ids `config` names, for
    any vocabulary size: what tests, demos and benchmarks tokenize with offline."""
    ids = {
        IMAGE_TOKEN: config.image_token_id, VIDEO_TOKEN: config.video_token_id,
        VISION_START: config.vision_start_token_id, VISION_END: config.vision_end_token_id,
        END_OF_TEXT: config.text_config.pad_token_id, config.emb_token: config.emb_token_id, IM_START: None,
        IM_END: None,
    }  # fmt: skip
    return build_tiny_qwen_tokenizer(config.text_config.vocab_size, ids)


def make_moemb_processor(config, tokenizer=None, **processor_options) -> MoEmbProcessor:
    """
    The processor of a MoEMB config: its vision tower's patching, its `<emb>` token (none with last-token
    pooling), and `tokenizer`, or one matching the config's vocabulary (`tiny_tokenizer_for` for tiny vocabularies,
    Qwen3.5's from the Hub otherwise).

    Tiny vocabularies also get tiny inputs, so that tests and demos run in seconds on a CPU: at most 16 tokens per
    image and 4 per video frame pair, and 4 frames per video (the image processor's frame settings).
    `processor_options` override any [`MoEmbProcessor`] argument.
    """
    vision_config = config.vision_config
    tiny = config.text_config.vocab_size <= LARGEST_TINY_QWEN_VOCABULARY
    if tokenizer is None:
        tokenizer = (
            tiny_tokenizer_for(config) if tiny else load_qwen_tokenizer(QWEN3_5_TOKENIZER_REPO, config.emb_token)
        )
    factor = vision_config.patch_size * vision_config.spatial_merge_size
    max_image_tokens = 16 if tiny else 1024
    frame_settings = (
        {"num_frames": 4, "video_size": {"shortest_edge": 2 * factor**2, "longest_edge": 4 * 4 * factor**2}}
        if tiny
        else {}
    )
    image_processor = MoEmbImageProcessor(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
        size={"shortest_edge": 4 * factor**2, "longest_edge": max_image_tokens * factor**2},
        **frame_settings,
    )
    options = {"emb_token": config.emb_token if config.pooling == "emb_token" else None}
    return MoEmbProcessor(image_processor, tokenizer, **(options | processor_options))
