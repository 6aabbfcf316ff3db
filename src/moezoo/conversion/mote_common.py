"""What the MoTE conversions share (spec mote.md §5): building the experts of one dense FFN (§5.3), the streamed
conversion, and the command-line options.

A conversion never holds the source model nor the MoTE one: it plans the conversion as `streaming.TensorGroup`s (each
source tensor copied under its MoTE name, or dropped for a stated reason; each converted layer's dense FFN turned
into the layer's experts; new tensors, such as a projector, initialised), checks the plan on the meta device against
the MoTE class (every tensor of the MoTE model produced exactly once, with its shape; every source tensor accounted
for), then reads the source's safetensors shard by shard and writes the MoTE model shard by shard. Peak memory is one
layer's experts and one output shard, whatever the depth.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.mote import DEFAULT_EXPERT_DESCRIPTIONS, check_expert_name
from ..terminal import quiet_libraries
from .common import option_name, source_license
from .dtypes import add_dtype_argument, saved_tensors
from .streaming import (
    Build,
    ShardWriter,
    SourceCheckpoint,
    TensorGroup,
    check_plan,
    copy_as,
    listing,
    load_layer_by_layer,
    stream_groups,
)


# --construction -> (how routed experts are built, how the shared expert is built, lambda_sh = lambda_task)
CONSTRUCTIONS = {
    "copy": ("copy", "zero_down", 1.0),  # D1, the default: every route equals the dense model, bit for bit
    "copy_half": ("copy", "copy_half", 0.5),  # also exact: 0.5 F(x) + 0.5 F(x) = F(x)
    "paper_literal": ("copy", "copy", 1.0),  # Sec. 3.2 read literally: each route computes 2 F(x) at first
    "split": ("split", "split", 1.0),  # Table 9's control: disjoint neuron groups, their sum is the dense FFN
}


# --- experts of one dense FFN (spec §5.3) --------------------------------------------------------------------------


@dataclass(frozen=True)
class FeedForwardLayout:
    """The projections of a backbone's dense FFN: `gate` and `up` rows are its neurons (fused into one tensor, gate
    rows first, in GLM), `down` columns are."""

    projections: tuple[str, ...]  # tensor names below `mlp.`
    fused_gate_up: bool

    @property
    def down(self) -> str:
        return "down_proj.weight"

    def intermediate_size(self, dense: dict[str, torch.Tensor]) -> int:
        return dense[self.down].shape[1]

    def neurons(self, dense: dict[str, torch.Tensor], index: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """The FFN made of neurons `index` only, padded with zero neurons to `width` (a zero neuron adds exactly
        nothing: its `down` column is zero)."""
        pad = width - index.numel()
        if self.fused_gate_up:
            gate, up = dense["gate_up_proj.weight"].chunk(2, dim=0)
            rows = {"gate_up_proj.weight": torch.cat([_pad_rows(gate[index], pad), _pad_rows(up[index], pad)])}
        else:
            rows = {name: _pad_rows(dense[name][index], pad) for name in ("gate_proj.weight", "up_proj.weight")}
        down = dense[self.down][:, index]
        return rows | {self.down: torch.cat([down, down.new_zeros(down.shape[0], pad)], dim=1)}


LLAMA_FFN = FeedForwardLayout(("gate_proj.weight", "up_proj.weight", "down_proj.weight"), fused_gate_up=False)
GLM_FFN = FeedForwardLayout(("gate_up_proj.weight", "down_proj.weight"), fused_gate_up=True)


def _pad_rows(tensor: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros(pad, tensor.shape[1])]) if pad else tensor


def split_groups(intermediate_size: int, num_groups: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random partition of the neurons into `num_groups` disjoint groups whose sizes differ by at most one
    (`randperm` then `tensor_split`, spec §5.3)."""
    if intermediate_size < num_groups:
        raise ValueError(
            f"the split construction needs at least one neuron per expert: {intermediate_size} neurons for "
            f"{num_groups} experts (routed + shared)"
        )
    return list(torch.tensor_split(torch.randperm(intermediate_size, generator=generator), num_groups))


def split_width(intermediate_size: int, num_groups: int) -> int:
    """The width of every expert of the split construction: the largest group (smaller ones are zero-padded)."""
    return -(-intermediate_size // num_groups)


def build_experts(
    dense: dict[str, torch.Tensor],
    layout: FeedForwardLayout,
    names: list[str],
    construction: str,
    num_shared_experts: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """One dense FFN (its tensors by name below `mlp.`) -> the `MoteFeedForward` tensors, by name below `mlp.`."""
    experts, shared, _ = CONSTRUCTIONS[construction]
    if experts == "split":
        size = layout.intermediate_size(dense)
        groups = split_groups(size, num_shared_experts + len(names), generator)
        pieces = [layout.neurons(dense, group, split_width(size, len(groups))) for group in groups]
        shared_piece, routed = (pieces[0] if num_shared_experts else None), pieces[num_shared_experts:]
    else:
        routed = [dense] * len(names)
        shared_piece = dense
        if shared == "zero_down":
            shared_piece = dense | {layout.down: torch.zeros_like(dense[layout.down])}
    tensors = {f"experts.{name}.{key}": tensor for name, piece in zip(names, routed) for key, tensor in piece.items()}
    if num_shared_experts:
        tensors |= {f"shared_expert.{key}": tensor for key, tensor in shared_piece.items()}
    return tensors


def dense_fields(base_model: str | None = None) -> dict:
    """The `mote_*` config fields of the dense baseline: no task experts, so every layer keeps its FFN (spec §5.2)."""
    return dict(
        mote_expert_names=[], mote_expert_descriptions={}, mote_num_shared_experts=0, mote_base_model=base_model
    )


def mote_fields(
    experts: dict[str, str | None],
    construction: str,
    intermediate_size: int,
    num_shared_experts: int = 1,
    default_route: str | None = None,
    mote_layers: list[int] | None = None,
    base_model: str | None = None,
) -> dict:
    """The `mote_*` config fields of a conversion."""
    if construction not in CONSTRUCTIONS:
        raise ValueError(
            f"{option_name('construction', construction)} is not one of {', '.join(map(repr, CONSTRUCTIONS))}"
        )
    if construction == "copy_half" and not num_shared_experts:
        raise ValueError(
            f"{option_name('construction', 'copy_half')} halves every routed expert and leaves the other half to the "
            "shared expert, so it needs one: keep the shared expert (no --no-shared-expert, num_shared_experts=1), or "
            f"use {option_name('construction', 'copy')}, which is exact without a shared expert"
        )
    expert_init, shared_init, scale = CONSTRUCTIONS[construction]
    names = list(experts)
    if not names:
        raise ValueError("a MoTE conversion needs at least one expert name (e.g. --experts ocr,kie or "
                         "experts=['ocr', 'kie'])")
    return dict(
        mote_expert_names=names,
        mote_expert_descriptions={
            name: text
            for name, text in ((name, experts[name] or DEFAULT_EXPERT_DESCRIPTIONS.get(name)) for name in names)
            if text is not None
        },
        mote_num_shared_experts=num_shared_experts,
        mote_routed_expert_scale=scale,
        mote_shared_expert_scale=scale,
        mote_layers=mote_layers,
        mote_routing_mode="task",
        mote_default_route=default_route,
        mote_expert_intermediate_size=(
            split_width(intermediate_size, num_shared_experts + len(names)) if expert_init == "split" else None
        ),
        mote_init={"experts": expert_init, "shared": shared_init},
        mote_base_model=base_model,
    )


# --- the streamed conversion ------------------------------------------------------------------------------------------


class MotePlan:
    """A MoTE conversion as `streaming.TensorGroup`s, with the accounting of every source tensor (copied, turned into
    experts, dropped for a stated reason) and of every new one (initialised for a stated reason)."""

    def __init__(self, layout: FeedForwardLayout, text_config, construction: str, seed: int):
        self.layout, self.construction = layout, construction
        self.names, self.num_shared_experts = text_config.mote_expert_names, text_config.mote_num_shared_experts
        self.generator = torch.Generator().manual_seed(seed)  # the neuron partitions of `split`, layer after layer
        self.groups: list[TensorGroup] = []
        self.accounting = {"source_tensors": 0, "copied": 0, "turned_into_experts": 0, "dropped": {},
                           "initialised": {}}

    def copy(self, source_key: str, target_key: str) -> None:
        self.accounting["source_tensors"] += 1
        self.accounting["copied"] += 1
        self.groups.append(copy_as(source_key, target_key))

    def copy_tensor(self, source_key: str, target_key: str, tensor: torch.Tensor) -> None:
        """A tensor read from a file outside the source checkpoints (VideoLLM-online's connector), already in hand."""
        self.accounting["source_tensors"] += 1
        self.accounting["copied"] += 1
        self.groups.append(TensorGroup((), lambda tensors, device: {target_key: tensor}))

    def drop(self, source_key: str, reason: str) -> None:
        self.accounting["source_tensors"] += 1
        self.accounting["dropped"][source_key] = reason

    def initialise(self, tensors: dict[str, torch.Tensor], reason: str) -> None:
        """New tensors without a source (a new projector), by target key."""
        self.accounting["initialised"] |= dict.fromkeys(tensors, reason)
        self.groups.append(TensorGroup((), lambda inputs, device: tensors))

    def add_ffns(self, ffns: dict[str, dict[str, str]], source_keys: Iterable[str]) -> set[str]:
        """Turn the dense FFN of every converted layer (target prefix -> {projection: source key}) into the layer's
        experts, once all its projections are read; fail naming the projections the source lacks. Returns the source
        keys taken."""
        available = set(source_keys)
        missing = [key for projections in ffns.values() for key in projections.values() if key not in available]
        if missing:
            raise ValueError(
                f"the source lacks the FFN tensors {listing(missing)} of decoder layers to convert: it is not a "
                f"complete checkpoint of the expected architecture (or pass {option_name('mote_layers')} to convert "
                "fewer layers)"
            )
        for prefix, projections in ffns.items():
            self.accounting["source_tensors"] += len(projections)
            self.accounting["turned_into_experts"] += len(projections)
            self.groups.append(TensorGroup(tuple(projections.values()), self._experts(prefix, projections)))
        return {key for projections in ffns.values() for key in projections.values()}

    def _experts(self, prefix: str, projections: dict[str, str]) -> Build:
        def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
            dense = {projection: tensors[key] for projection, key in projections.items()}
            # Checking the plan on meta tensors must not draw the split partitions from the seeded generator.
            generator = torch.Generator() if device == "meta" else self.generator
            experts = build_experts(dense, self.layout, self.names, self.construction, self.num_shared_experts,
                                    generator)  # fmt: skip
            return {f"{prefix}.{key}": tensor for key, tensor in experts.items()}

        return build


def write_mote_checkpoint(
    plan: MotePlan,
    checkpoints: list[SourceCheckpoint],
    model: PreTrainedModel,
    dtype: torch.dtype,
    output: Path,
    max_shard_size: int | str,
) -> None:
    """Check `plan` against `model` (the MoTE model on the meta device), then stream it from `checkpoints` into
    `output`: safetensors shards in `dtype`, config.json and the first checkpoint's generation config."""
    saved = {key: (tuple(tensor.shape), float32_kept) for key, tensor, float32_kept in saved_tensors(model)}
    check_plan(checkpoints, plan.groups, plan.accounting["dropped"], {key: shape for key, (shape, _) in saved.items()},
               "the MoTE model")  # fmt: skip
    writer = ShardWriter(output, convert_file_size_to_int(max_shard_size), dtype)
    for key, tensor in stream_groups(checkpoints, plan.groups):
        writer.add(key, tensor, cast=not saved[key][1])
    writer.finish()
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(output)
    generation_config = checkpoints[0].folder / "generation_config.json"
    if generation_config.is_file():
        shutil.copy2(generation_config, output / "generation_config.json")


# --- measuring the conversion ----------------------------------------------------------------------------------------


@torch.no_grad()
def measure_routes(
    source_class: type[PreTrainedModel],
    source: Path,
    model_class: type[PreTrainedModel],
    converted: Path,
    dtype: torch.dtype,
    inputs: dict[str, torch.Tensor],
) -> dict[str, float]:
    """max |logits(route) - logits(source)| on `inputs` for every route of the converted folder, in `dtype`. The source
    model runs first, then the converted one, each layer by layer (`load_layer_by_layer`), so the memory this takes
    does not grow with the depth."""
    with tempfile.TemporaryDirectory(prefix="mote-verification-") as offload:
        with quiet_libraries():  # GLM-OCR's MTP layer is not part of its class
            reference = load_layer_by_layer(source_class, source, Path(offload) / "source", dtype=dtype)
        expected = reference(**inputs).logits
        del reference
        model = load_layer_by_layer(model_class, converted, Path(offload) / "converted", dtype=dtype)
        return largest_differences(route_logits(model, inputs), expected)


@torch.no_grad()
def route_logits(model: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logits of every route of `model` on `inputs` (route-homogeneous batches); for the dense baseline, of its one
    path."""
    names = model.mote_config.mote_expert_names
    if not names:
        return {"dense": model(**inputs).logits}
    batch_size = inputs["input_ids"].shape[0]
    return {
        name: model(**inputs, task_ids=torch.full((batch_size,), route, dtype=torch.long)).logits
        for route, name in enumerate(names)
    }


def largest_differences(logits: dict[str, torch.Tensor], reference: torch.Tensor) -> dict[str, float]:
    return {name: float((value.float() - reference.float()).abs().max()) for name, value in logits.items()}


def conversion_report(model, folder: Path, source_model_type: str, construction: str | None, accounting: dict,
                      differences: dict[str, float] | None, compared_on: str) -> dict:  # fmt: skip
    """The provenance of a MoTE conversion: the source, the construction, the key accounting, the parameter counts and
    the largest logits difference of every route to the source model (measured `compared_on`; None unverified)."""
    text_config = model.config.get_text_config()
    return {
        "source": str(folder),  # save_conversion names a Hub source by its repo id
        "source_model_type": source_model_type,
        "base_model": str(folder),
        "license": source_license(folder),
        "construction": construction,
        "mote_init": text_config.mote_init,
        "experts": text_config.mote_expert_names,
        "default_route": text_config.mote_default_route,
        "key_accounting": accounting,
        "parameters": {
            "total": sum(p.numel() for p in model.parameters()),
            "active": model.active_parameter_count(),
            "language_model_total": model.num_parameters_mote(active=False),
            "language_model_active": model.num_parameters_mote(active=True),
        },
        "max_abs_diff": None if differences is None else max(differences.values()),
        "max_abs_diff_by_route": differences,
        "notes": [
            f"max_abs_diff: every route's logits against {compared_on} (0 for the function-preserving constructions "
            "copy and copy_half)."
        ],
    }


# --- command-line options ---------------------------------------------------------------------------------------------


def parse_experts(text: str) -> dict[str, str | None]:
    """`"step,next:predict the next step"` -> `{"step": None, "next": "predict the next step"}` (a missing
    description is the default of a known route name, spec §6.4)."""
    experts = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, description = item.partition(":")
        name = name.strip()
        check_expert_name(name, experts)
        experts[name] = description.strip() or None
    if not experts:
        raise ValueError(f"--experts {text!r} names no expert; write name[:description],name[:description],...")
    return experts


def as_experts(experts) -> dict[str, str | None]:
    """Expert names with optional descriptions, from a dict, a list of names or the `--experts` text."""
    if isinstance(experts, str):
        return parse_experts(experts)
    if isinstance(experts, dict):
        return dict(experts)
    return {name: None for name in experts}


def add_common_arguments(parser, default_experts: str) -> None:
    parser.add_argument(
        "--experts", type=parse_experts, default=parse_experts(default_experts),
        help=f"name[:description],... of the task experts, route ids in this order (default: {default_experts})",
    )
    parser.add_argument(
        "--construction", choices=list(CONSTRUCTIONS), default="copy",
        help="copy: routed copies + a zero-output shared expert, every route equals the base (default); copy_half: "
             "both copied at lambda 0.5; paper_literal: both copied at lambda 1 (2x the FFN at first); split: "
             "disjoint neuron groups",
    )
    parser.add_argument("--default-route", default=None, help="the expert used when no task_ids are given")
    parser.add_argument("--mote-layers", type=int, nargs="+", default=None, help="decoder layers to convert (all)")
    parser.add_argument("--no-shared-expert", dest="num_shared_experts", action="store_const", const=0, default=1)
    add_dtype_argument(parser)
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest output shard, which the conversion holds in memory before writing it")
    parser.add_argument("--seed", type=int, default=0, help="seeds the split partition and any new weights")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip measuring every route against the source model")
