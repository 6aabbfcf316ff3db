"""Assembling MoEMB processors for presets and conversions (not exported: exported folders carry the processor files).

A converted checkpoint brings Qwen3.5's tokenizer, to which the conversion adds `<emb>` (`add_emb_token`). A preset
with a tiny text vocabulary gets a byte-level BPE tokenizer in Qwen3.5's format built offline here, whose special
tokens sit at the ids the config names; a paper-scale preset gets Qwen3.5's tokenizer from the Hub.
"""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from ..hub.sources import TOKENIZER_FILES, locate
from .moemb import (
    EMB_TOKEN,
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    MoEmbImageProcessor,
    MoEmbProcessor,
    add_emb_token,
)

QWEN3_5_TOKENIZER_REPO = "Qwen/Qwen3.5-35B-A3B"
END_OF_TEXT = "<|endoftext|>"
LARGEST_TINY_VOCABULARY = 4096
# Printable ASCII that tiny tokenizers spell out; other characters are dropped (byte-level BPE without fallback).
TINY_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;?!'\"-()<>/"
)
# Whole tokens first for the words of the prompt template, the instructions and moezoo's synthetic data sets.
TINY_WORDS = (
    "user", "assistant", " a", " the", " of", " red", " green", " blue", " yellow", " circle", " square", " triangle",
    " cross", " moving", " left", " right", " up", " down", " photo", " image", " caption", " seconds", " Find",
    " Represent", " given", " with", " and", " text", " video", " query",
)  # fmt: skip


def build_tiny_qwen_tokenizer(
    vocab_size: int, special_tokens: dict[str, int | None], words=TINY_WORDS, alphabet: str = TINY_ALPHABET
) -> Qwen3_5Tokenizer:
    """
    A `Qwen3_5Tokenizer` (byte-level BPE, Qwen's pre-tokenizer) of at most `vocab_size` tokens, built without
    downloads, with each special token of `special_tokens` at its given id, or at the highest free ids for those
    given `None`.

    The other ids, from 0 up, hold the byte-level symbols of `alphabet`, then the tokens made by merging each word of
    `words` left to right (a leading space is part of a word, as Qwen's pre-tokenizer keeps it), until the ids run
    out. `<|endoftext|>`, Qwen's pad token, must be among the special tokens.
    """
    if END_OF_TEXT not in special_tokens:
        raise ValueError(f"special_tokens must include {END_OF_TEXT}, the pad token")
    given = [i for i in special_tokens.values() if i is not None]
    if len(set(given)) != len(given) or not all(0 <= i < vocab_size for i in given):
        raise ValueError(f"special token ids must be distinct and below vocab_size={vocab_size}: {special_tokens}")
    free = [i for i in range(vocab_size) if i not in given]
    special_tokens = {token: free.pop() if i is None else i for token, i in special_tokens.items()}

    byte_symbol = bytes_to_unicode()
    symbols = list(dict.fromkeys(byte_symbol[byte] for character in alphabet for byte in character.encode()))
    if len(symbols) > len(free):
        raise ValueError(f"vocab_size={vocab_size} leaves {len(free)} ids, fewer than the {len(symbols)} characters")
    vocab = dict(zip(symbols, free))
    free = free[len(symbols) :]
    merges = []
    for word in words:
        pieces = [byte_symbol[byte] for byte in word.encode()]
        while len(pieces) > 1 and free:
            merged = pieces[0] + pieces[1]
            if merged not in vocab:
                merges.append((pieces[0], pieces[1]))
                vocab[merged] = free.pop(0)
            pieces = [merged, *pieces[2:]]
    vocab |= special_tokens
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [token for token in special_tokens if token != END_OF_TEXT]},
        replace_extra_special_tokens=False,
    )
    return tokenizer


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
    tiny = config.text_config.vocab_size <= LARGEST_TINY_VOCABULARY
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
