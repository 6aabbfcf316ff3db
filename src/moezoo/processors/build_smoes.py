"""Assembling SMoES processors for presets and conversions (not exported: exported folders carry the processor files).

A converted checkpoint brings its own tokenizer and image processor settings. A preset with a tiny vocabulary gets a
tiny Qwen-format tokenizer built offline (`build_tiny_qwen_tokenizer`) whose vision tokens sit at the ids the config
names; a paper-scale preset gets its base model's tokenizer from the Hub (Qwen3.5's or Qwen3-VL's).
"""

from __future__ import annotations

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..hub.sources import TOKENIZER_FILES, locate
from .moemb import chat_template_for
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
from .smoes import SmoesQwen3_5MoeProcessor
from .tiny_tokenizers import LARGEST_TINY_QWEN_VOCABULARY, build_tiny_qwen_tokenizer


# The Hub repository of each host's own tokenizer, by the SMoES config's model_type.
TOKENIZER_REPOS = {"smoes_qwen3_5_moe": QWEN3_5_TOKENIZER_REPO, "smoes_qwen3_vl_moe": "Qwen/Qwen3-VL-30B-A3B-Instruct"}


def make_smoes_processor(config, tokenizer=None, image_processor=None) -> SmoesQwen3_5MoeProcessor:
    """The processor of an SMoES host's config: `tokenizer` and `image_processor` (a converted checkpoint's), or
    a tokenizer matching the config's vocabulary and an image processor with its vision tower's patching. Tiny
    vocabularies also get tiny images (at most 16 tokens each), so that tests and demos run in seconds on a CPU."""
    vision_config, text_config = config.vision_config, config.text_config
    tiny = text_config.vocab_size <= LARGEST_TINY_QWEN_VOCABULARY
    if tokenizer is None and tiny:
        special_tokens = {
            IMAGE_TOKEN: config.image_token_id, VIDEO_TOKEN: config.video_token_id,
            VISION_START: config.vision_start_token_id, VISION_END: config.vision_end_token_id,
            END_OF_TEXT: text_config.pad_token_id, IM_START: None, IM_END: None,
        }  # fmt: skip
        tokenizer = build_tiny_qwen_tokenizer(text_config.vocab_size, special_tokens)
    elif tokenizer is None:
        from transformers import AutoTokenizer

        repo = TOKENIZER_REPOS[config.model_type]
        tokenizer = AutoTokenizer.from_pretrained(locate(repo, f"{repo}'s tokenizer", allow_patterns=TOKENIZER_FILES))
    # A tiny tokenizer has no chat template: it gets ChatML with images and videos in place, as Qwen3.5's writes them.
    chat_template = getattr(tokenizer, "chat_template", None) or chat_template_for(None)
    if image_processor is not None:
        return SmoesQwen3_5MoeProcessor(image_processor, tokenizer, chat_template=chat_template)
    factor = vision_config.patch_size * vision_config.spatial_merge_size
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],  # Qwen3.5's and Qwen3-VL's normalisation
        image_std=[0.5, 0.5, 0.5],
        # Qwen3.5's and Qwen3-VL's bounds (64 to 16384 merged tokens per image); tiny presets: 4 to 16.
        size={"shortest_edge": (4 if tiny else 64) * factor**2, "longest_edge": (16 if tiny else 16384) * factor**2},
    )
    return SmoesQwen3_5MoeProcessor(image_processor, tokenizer, chat_template=chat_template)
