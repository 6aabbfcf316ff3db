"""MoEMB's trained efficiency modules (spec moemb.md §3.0, §3.1, §3.4, §3.7, §3.10, §3.13): which ones a model has,
and how they start. Stored as the `gates` dict of `MoEmbConfig`, so a checkpoint trained with them (and its exported
folder) builds them again; a config without it (every converted checkpoint) has none, and its state dict is unchanged.

    efficiency_head  "skip_gate" | "grpo"  per MoE layer `mlp.efficiency_head = Linear(d, 3)` on the router input,
                                           logits (ROUTE, SKIP, DROP); the value is its initialisation:
                                           W = 0, bias (0, -4, -inf) (learned skip gate, §3.4) or (0, -2.5, -4) (GRPO)
    token_pruner     bool                  `language_model.token_pruner`: Linear(d, d/8), GELU, Linear(d/8, 2)
                                           (keep, drop) on the hidden state after block `pruner_layer` (§3.1)
    null_experts     int                   N_null null experts per MoE layer (`mlp.null_router`, W = 0, b = `null_bias`),
                                           selected jointly with the physical ones (AdaMoE, §3.7)
    layer_skip       bool                  per eligible block `layers[l].skip_gate = Linear(d, 1)` read from the pooled
                                           token's hidden state at the block's input (§3.10)

Which of them act at inference is chosen by `MoEmbConfig.adaptive` / `model(..., adaptive=...)`
(`AdaptiveSettings`: `token_pruning="learned"`, `expert_skip="learned"`, `top_k="null_experts"`,
`layer_skip="learned"`, `efficiency_policy="greedy"`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .validation import is_int, is_number


# Initial bias of the efficiency head (ROUTE, SKIP, DROP), its weight being 0.
EFFICIENCY_HEAD_INITS = {"skip_gate": (0.0, -4.0, float("-inf")), "grpo": (0.0, -2.5, -4.0)}


@dataclass
class GateModules:
    r"""
    efficiency_head: None, or the initialisation of the per-layer three-way head: "skip_gate" or "grpo".
    protect_text: the DROP logit of text tokens is -inf too (the pooled token's always is).
    token_pruner: the one-shot learned pruner.
    pruner_layer: n, the zero-based block after which the pruner decides (the paper's 2); not the last block.
    null_experts: N_null >= 0, null experts appended to every router (0: none).
    null_bias: b_null, the null experts' initial logit (-8: step 0 equals the base model).
    layer_skip: the per-block layer-skip gates.
    layer_skip_blocks: the zero-based blocks that may be skipped (default: 3 to L-2, never the last one).
    """

    efficiency_head: str | None = None
    protect_text: bool = False
    token_pruner: bool = False
    pruner_layer: int = 2
    null_experts: int = 0
    null_bias: float = -8.0
    layer_skip: bool = False
    layer_skip_blocks: list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, refused by `validate`

    @classmethod
    def from_dict(cls, gates: dict | GateModules | None) -> GateModules:
        if isinstance(gates, cls):
            return gates
        if gates is None:
            return cls()
        if not isinstance(gates, dict):
            raise ValueError(f"MoEmbConfig.gates must be a dict of GateModules fields, got {gates!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(
            **{key: value for key, value in gates.items() if key in known},
            extra={key: value for key, value in gates.items() if key not in known},
        )

    def to_dict(self) -> dict:
        """The non-default fields, what `MoEmbConfig.gates` stores."""
        defaults = GateModules()
        return {key: value for key, value in asdict(self).items() if key != "extra" and value != getattr(defaults, key)}

    @property
    def any(self) -> bool:
        return self.efficiency_head is not None or self.token_pruner or self.null_experts > 0 or self.layer_skip

    def skip_blocks(self, num_layers: int) -> list[int]:
        """The blocks with a layer-skip gate."""
        if self.layer_skip_blocks is not None:
            return sorted(self.layer_skip_blocks)
        return list(range(3, num_layers - 1))

    def validate(self, num_layers: int, moe_variant: str) -> None:
        """Raises a ValueError naming the field for modules a model of `num_layers` blocks cannot have."""
        if self.extra:
            known = sorted(f.name for f in fields(self) if f.name != "extra")
            raise ValueError(f"MoEmbConfig.gates: unknown fields {sorted(self.extra)}; the fields are {known}")
        if self.efficiency_head is not None and self.efficiency_head not in EFFICIENCY_HEAD_INITS:
            raise ValueError(
                f"MoEmbConfig.gates.efficiency_head={self.efficiency_head!r} must be None or one of "
                f"{tuple(EFFICIENCY_HEAD_INITS)} (its initialisation)"
            )
        for name in ("protect_text", "token_pruner", "layer_skip"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEmbConfig.gates.{name} must be True or False, got {getattr(self, name)!r}")
        if self.token_pruner and not (is_int(self.pruner_layer) and 0 <= self.pruner_layer < num_layers - 1):
            raise ValueError(
                f"MoEmbConfig.gates.pruner_layer={self.pruner_layer!r} must be a block from 0 to {num_layers - 2}: "
                "pruned tokens leave every later block, so the last one cannot prune"
            )
        if not (is_int(self.null_experts) and self.null_experts >= 0):
            raise ValueError(f"MoEmbConfig.gates.null_experts={self.null_experts!r} must be an integer >= 0")
        if not is_number(self.null_bias):
            raise ValueError(f"MoEmbConfig.gates.null_bias={self.null_bias!r} must be a finite number")
        if moe_variant == "modality" and (self.efficiency_head is not None or self.null_experts):
            raise ValueError(
                "MoEmbConfig.gates: moe_variant='modality' routes every token to one fixed expert without a router, "
                "so it has no efficiency_head or null_experts; use token_pruner or layer_skip"
            )
        blocks = self.layer_skip_blocks
        if blocks is not None and not (
            isinstance(blocks, list) and blocks and len(set(blocks)) == len(blocks)
            and all(is_int(block) and 0 <= block < num_layers - 1 for block in blocks)
        ):  # fmt: skip
            raise ValueError(
                f"MoEmbConfig.gates.layer_skip_blocks={blocks!r} must list distinct blocks from 0 to {num_layers - 2} "
                "(the last block is never skipped)"
            )
        if self.layer_skip and not self.skip_blocks(num_layers):
            raise ValueError(
                f"MoEmbConfig.gates.layer_skip: a model of {num_layers} blocks has no block from 3 to L-2 to skip; "
                "list the blocks in gates.layer_skip_blocks"
            )
