"""Working with presets: parameter counts (on the meta device) and randomly initialised models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .hub.folders import atomic_output_dir, write_provenance
from .modeling.moe.accounting import ParameterCounts, count_parameters
from .registry import PRESETS, Preset, get_architecture, get_preset, resolve


@dataclass(frozen=True)
class PartCount:
    part: str  # a label of ParameterClaim.parts
    total: int
    active: int


@dataclass(frozen=True)
class PresetSummary:
    name: str
    architecture: str
    total_parameters: int
    active_parameters: int
    base_checkpoints: tuple[str, ...]
    converter: str | None
    description: str
    # The counts of the part the paper counts (e.g. MoE-ViE's vision tower), when that is not the whole model.
    paper_counted_modules: tuple[str, ...] = ()
    paper_total_parameters: int | None = None
    paper_active_parameters: int | None = None
    # The paper's own counts where the counted ones differ (registry.ParameterClaim), and the counts of its parts.
    claimed_total_parameters: int | None = None
    claimed_active_parameters: int | None = None
    claim_source: str | None = None
    claim_parts: tuple[PartCount, ...] = ()
    # With `memory`: the bytes the model takes on disk (and to load) by dtype name.
    size_bytes: dict[str, int] | None = None

    def as_dict(self) -> dict:
        return self.__dict__ | {"base_checkpoints": list(self.base_checkpoints),
                                "paper_counted_modules": list(self.paper_counted_modules),
                                "claim_parts": [part.__dict__ for part in self.claim_parts]}

    def claim_reconciliation(self) -> str | None:
        """The paper's claim beside the counted totals and the counts of its parts, in one line (None without one)."""
        if self.claimed_total_parameters is None:
            return None
        parts = "; ".join(f"{part.part} {human_count(part.total)} / {human_count(part.active)}"
                          for part in self.claim_parts)  # fmt: skip
        return (
            f"{self.name}: the paper states {human_count(self.claimed_total_parameters)} total / "
            f"{human_count(self.claimed_active_parameters)} active ({self.claim_source}); counted here "
            f"{human_count(self.total_parameters)} / {human_count(self.active_parameters)}. By part (total / active): "
            f"{parts}"
        )


def human_count(count: int) -> str:
    """A parameter count as people write it: 31.3B, 512M, 70.7K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def build_config(preset: Preset):
    return get_architecture(preset.architecture).config_class()(**preset.config)


def preset_parameters(preset: Preset) -> tuple[ParameterCounts, ParameterCounts | None, dict[str, ParameterCounts]]:
    """Counted from the model built on the meta device (no memory, no weights, exact shapes): the whole model, the
    part the paper counts if the architecture names one, and the parts of the preset's `paper_claim`, by label."""
    architecture = get_architecture(preset.architecture)
    with torch.device("meta"):
        model = architecture.model_class()(build_config(preset))
    paper_counts = _count_modules(model, architecture.paper_counted_modules)
    claim_parts = preset.paper_claim.parts if preset.paper_claim else {}
    part_counts = {label: _count_modules(model, names) for label, names in claim_parts.items()}
    return count_parameters(model), paper_counts, part_counts


def _count_modules(model, names: tuple[str, ...]) -> ParameterCounts | None:
    """The counts of the submodules `names` together, None for none."""
    parts = [count_parameters(model.get_submodule(name)) for name in names]
    return ParameterCounts(sum(p.total for p in parts), sum(p.active for p in parts)) if parts else None


def preset_sizes(preset: Preset) -> dict[str, int]:
    """The bytes the preset's model takes on disk (and to load) in each dtype a conversion writes, by dtype name:
    counted on the model built on the meta device."""
    from .conversion.cost import stored_bytes
    from .conversion.dtypes import DTYPES

    with torch.device("meta"):
        model = get_architecture(preset.architecture).model_class()(build_config(preset))
    sizes = stored_bytes(model, list(DTYPES.values()))
    return {name: sizes[dtype] for name, dtype in DTYPES.items()}


def list_presets(memory: bool = False) -> list[PresetSummary]:
    """Every preset with its parameter counts (and, with `memory`, its size in each dtype)."""
    summaries = []
    for preset in PRESETS.values():
        counts, paper_counts, part_counts = preset_parameters(preset)
        claim = preset.paper_claim
        summaries.append(
            PresetSummary(
                preset.name, preset.architecture, counts.total, counts.active, preset.base_checkpoints,
                preset.converter, preset.description,
                get_architecture(preset.architecture).paper_counted_modules,
                paper_counts.total if paper_counts else None, paper_counts.active if paper_counts else None,
                claim.total if claim else None, claim.active if claim else None, claim.source if claim else None,
                tuple(PartCount(label, part.total, part.active) for label, part in part_counts.items()),
                preset_sizes(preset) if memory else None,
            )
        )
    return summaries


def create_from_preset(name: str, out: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a randomly initialised model of `name` and its processor: the start of from-scratch training."""
    preset = get_preset(name)
    architecture = get_architecture(preset.architecture)
    # The model is built once `out` is claimed and the processor made (a paper-scale preset's tokenizer comes from the
    # Hub): a taken `out` or an unreachable tokenizer fails at once, not after building billions of weights.
    with atomic_output_dir(out, overwrite=overwrite) as staging:
        config = build_config(preset)
        processor = resolve(architecture.make_processor)(config) if architecture.make_processor else None
        torch.manual_seed(seed)
        model = architecture.model_class()(config)
        model.save_pretrained(staging)
        if processor is not None:
            processor.save_pretrained(staging)
        write_provenance(
            staging,
            {"preset": preset.name, "seed": seed, "license": preset.license, "moezoo_version": __version__,
             "initialisation": "random"},
        )
    return Path(out)
