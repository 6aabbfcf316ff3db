"""A synthetic retrieval task with redundant tokens, for GRPO over MoEMB's efficiency gates (spec moemb.md §3.13):
token ids only (no processor, no pixels), so a tiny model trains on it in seconds.

Each item of class c is `[marker, class_c, filler × n, <emb>]`: the class token carries all the information, the `n`
filler tokens (one id repeated, typed as image tokens like the padding-like visual tokens of a blank image region)
carry none. A query and its target share the class and differ by their marker. A policy that drops or skips the
fillers saves most of the compute at no cost to retrieval; one that drops the class token loses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RedundantTokenRetrieval:
    """Query/target pairs of `num_classes` classes; ids below `vocab_size` other than `emb_token_id`."""

    emb_token_id: int
    num_classes: int = 16
    num_fillers: int = 12
    filler_token_id: int = 3
    query_marker_id: int = 4
    target_marker_id: int = 5
    first_class_id: int = 10

    def item(self, label: int, marker: int) -> dict:
        ids = [marker, self.first_class_id + label] + [self.filler_token_id] * self.num_fillers + [self.emb_token_id]
        types = [0, 0] + [1] * self.num_fillers + [0]
        return {"input_ids": torch.tensor(ids), "mm_token_type_ids": torch.tensor(types)}

    def pairs(self, count: int, generator: torch.Generator) -> list[dict]:
        """`count` examples `{"query", "target", "label"}` of random classes."""
        labels = torch.randint(0, self.num_classes, (count,), generator=generator).tolist()
        return [{"query": self.item(label, self.query_marker_id), "target": self.item(label, self.target_marker_id),
                 "label": label} for label in labels]  # fmt: skip


def pad_items(items: list[dict]) -> dict:
    """Right-padded `(B, S)` `input_ids`, `mm_token_type_ids` and `attention_mask` of token-id items."""
    length = max(len(item["input_ids"]) for item in items)
    batch = {key: torch.zeros(len(items), length, dtype=torch.long)
             for key in ("input_ids", "mm_token_type_ids", "attention_mask")}  # fmt: skip
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        batch["input_ids"][row, :n] = item["input_ids"]
        batch["mm_token_type_ids"][row, :n] = item["mm_token_type_ids"]
        batch["attention_mask"][row, :n] = 1
    return batch


def collate_pairs(examples: list[dict]) -> dict:
    """Examples of `RedundantTokenRetrieval.pairs` as `GrpoCollator` lays a batch out: the queries then their targets
    in one batch, and the class of each pair as its target key."""
    items = [example["query"] for example in examples] + [example["target"] for example in examples]
    return {"inputs": pad_items(items), "target_keys": torch.tensor([example["label"] for example in examples])}
