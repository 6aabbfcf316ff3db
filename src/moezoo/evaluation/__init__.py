"""Evaluation of the zoo's models, one module per architecture (`moe_vie`: zero-shot classification and
image/video-text retrieval, the protocol of the MoE-ViE paper; `moemb`: MMEB-V2 and MRMR retrieval; `omnimoe_vl`: VQA
scores, expert and depth utilisation, question-conditioned route distances and interventions)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An `argparse` type for the eval commands' counts (`--limit`, `--batch-size`, ...)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value
