"""The input batches of `moezoo bench moemb` (`moemb.py`) and of its `--adaptive` run (`moemb_adaptive.py`): below
both, so that `moemb.py` imports `moemb_adaptive.py` and nothing imports back."""

from __future__ import annotations

import numpy as np

from ..configuration.moemb import MoEmbConfig
from ..processors.build_moemb import make_moemb_processor, tiny_tokenizer_for

INPUT_KINDS = ("text", "image+text")
MIXED_INPUTS = "mixed"  # image+text and text items alternating (bench moemb --adaptive)
WORDS = ("a", "photo", "of", "the", "red", "green", "blue", "circle", "square", "moving", "left", "image", "text")


def bench_inputs(config: MoEmbConfig, kind: str, batch_size: int, text_tokens: int, image_size: int, seed: int = 0):
    """A processor batch of `batch_size` inputs: random captions of about `text_tokens` words, with an instruction
    and a random `image_size` px image for "image+text" (every other input for `MIXED_INPUTS`, the first included)."""
    if kind not in (*INPUT_KINDS, MIXED_INPUTS):
        raise ValueError(f"inputs must be one of {', '.join(INPUT_KINDS)} or {MIXED_INPUTS}, got {kind!r}")
    # The vocabulary does not matter for speed: a tiny tokenizer works for every size, offline.
    processor = make_moemb_processor(config, tokenizer=tiny_tokenizer_for(config))
    # Exactly image_size x image_size pixels (a multiple of patch x merge): min = max = that area.
    factor = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    area = (image_size // factor * factor) ** 2
    processor.image_processor.size = {"shortest_edge": area, "longest_edge": area}
    rng = np.random.default_rng(seed + batch_size)
    items = []
    for index in range(batch_size):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(text_tokens // 2, text_tokens + 1))))
        if kind == "text" or (kind == MIXED_INPUTS and index % 2):
            items.append(text)
        else:
            image = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
            items.append({"instruction": "Represent the image with its caption.", "text": text, "images": [image]})
    return processor(items, max_length=config.text_config.max_position_embeddings)
