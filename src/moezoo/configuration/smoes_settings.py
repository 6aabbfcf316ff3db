"""SMoES settings for the zoo's own models (MoEMB, OmniMoE-VL): the `smoes_*` fields of `SmoesConfigMixin` as one
object, which such a model's config keeps as a dict in its `smoes` field (None: no SMoES), the way MoEMB keeps its
adaptive-computation settings. A saved folder's config then rebuilds the SMoES buffers its weights file holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

from .smoes import SmoesConfigMixin


@dataclass(kw_only=True, repr=False)
class SmoesSettings(SmoesConfigMixin):
    r"""The `smoes_*` fields (see `SmoesConfigMixin` for each, with the paper's values as defaults). Validated against a
    model by `check_host`, which the model's config calls when it is built."""

    def __repr__(self) -> str:
        return f"SmoesSettings({self.to_dict()})"

    def to_dict(self) -> dict:
        return {field.name: _plain(getattr(self, field.name)) for field in fields(self)}

    @classmethod
    def from_dict(cls, values: dict | SmoesSettings | None, owner: str = "smoes") -> SmoesSettings | None:
        """The settings of a config's `smoes` dict (None: no SMoES); `owner` names that field in errors."""
        if values is None or isinstance(values, SmoesSettings):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"{owner} must be a dict of SmoesSettings fields (smoes_num_bins, ...), got {values!r}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{owner} has unknown fields {unknown}; SmoesSettings has {', '.join(sorted(known))}")
        return cls(**values)

    def check_host(
        self,
        num_experts: int,
        softmax_attention_layers: int,
        routers_trainable: bool | None = None,
        expert_groups: int = 1,
    ) -> None:
        """`validate_smoes_fields` with what the host model knows: its routed experts per layer, its softmax-attention
        layers, whether its config freezes the routers, its router's expert groups."""
        host = copy.copy(self)
        host.num_experts = num_experts  # what the bin count must divide, named `num_experts` in the error
        host.validate_smoes_fields(
            num_experts_field="num_experts",
            softmax_attention_layers=softmax_attention_layers,
            expert_groups=expert_groups,
            routers_trainable=routers_trainable,
        )


def _plain(value):
    """JSON-ready: tuples (the default `smoes_vision_token_types`) become lists."""
    return list(value) if isinstance(value, tuple) else value
