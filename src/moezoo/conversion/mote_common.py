"""What the MoTE conversions share (spec mote.md §5): reading a checkpoint tensor by tensor, building the experts of
one dense FFN (§5.3), filling a model built without initialisation, and the command-line options.

A conversion never holds the source model: it builds the MoTE model uninitialised in the target dtype, then reads
the source's safetensors one tensor at a time, copying each into place or, for a decoder FFN, turning it into the
layer's experts as soon as the layer's projections are all read. Peak memory is the MoTE model plus one layer.
Every source tensor is copied, turned into experts or dropped for a stated reason, and every tensor of the MoTE
model must be written exactly once; anything else is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.initialization import no_init_weights

from ..configuration.mote import DEFAULT_EXPERT_DESCRIPTIONS, check_expert_name
from ..hub.sources import open_safetensors
from .common import option_name, source_license
from .dtypes import add_dtype_argument, cast_checked


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


# --- reading the source ----------------------------------------------------------------------------------------------


class SafetensorsCheckpoint:
    """The tensors of a folder's safetensors files (one file or an indexed set of shards), read one at a time."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{folder} has no .safetensors weights; the MoTE conversions read safetensors only (save the base "
                "model with save_pretrained(..., safe_serialization=True) first)"
            )
        self.folder = folder
        self.files = files

    @contextmanager
    def tensors(self) -> Iterator[Iterator[tuple[str, Callable[[], torch.Tensor]]]]:
        """Yields `(key, load)` for every tensor, file by file; `load()` reads that tensor only."""
        with ExitStack() as stack:
            handles = [stack.enter_context(open_safetensors(path)) for path in self.files]
            yield ((key, _loader(handle, key)) for handle in handles for key in handle.keys())


def _loader(handle, key: str) -> Callable[[], torch.Tensor]:
    return lambda: handle.get_tensor(key)


def adopt_generation_config(model, folder: Path) -> None:
    """Give the converted model the source's generation config (its sampling defaults and end tokens), if any."""
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))


# --- writing the MoTE model ----------------------------------------------------------------------------------------


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def uninitialised(model_class, config, dtype: torch.dtype):
    """`model_class(config)` with its parameters allocated once, in `dtype`, not initialised, and its tied weights
    tied (which initialisation would otherwise do)."""
    with no_init_weights(), default_dtype(dtype):
        model = model_class(config)
    model.tie_weights()
    return model


@dataclass
class StateWriter:
    """Fills an uninitialised model tensor by tensor and accounts for every source tensor.

    Tied weights are one tensor, written through their first name (the embedding for a tied LM head).
    """

    model: torch.nn.Module
    layout: FeedForwardLayout
    names: list[str]
    construction: str
    num_shared_experts: int
    generator: torch.Generator
    targets: dict[str, torch.Tensor] = field(init=False)
    written: set[str] = field(init=False, default_factory=set)
    accounting: dict = field(init=False)
    _pending: dict[str, dict[str, torch.Tensor]] = field(init=False, default_factory=dict)
    _ffn_seen: dict[str, set[str]] = field(init=False, default_factory=dict)

    @classmethod
    def for_new_model(cls, model_class, config, dtype: torch.dtype, layout: FeedForwardLayout, construction: str,
                      num_shared_experts: int, seed: int) -> tuple[torch.nn.Module, StateWriter]:
        """`model_class(config)`, uninitialised in `dtype`, and the writer that fills it; `seed` seeds the neuron
        partition of the `split` construction."""
        model = uninitialised(model_class, config, dtype)
        names = config.get_text_config().mote_expert_names
        return model, cls(model, layout, names, construction, num_shared_experts, torch.Generator().manual_seed(seed))

    def __post_init__(self):
        self.targets, storages = {}, set()
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            if tensor.data_ptr() not in storages:
                storages.add(tensor.data_ptr())
                self.targets[key] = tensor
        self.accounting = {"source_tensors": 0, "copied": 0, "turned_into_experts": 0, "dropped": {},
                           "initialised": {}}

    def copy(self, source_key: str, target_key: str, tensor: torch.Tensor) -> None:
        self.accounting["source_tensors"] += 1
        self.accounting["copied"] += 1
        self._write(target_key, tensor, source_key)

    def drop(self, source_key: str, reason: str) -> None:
        self.accounting["source_tensors"] += 1
        self.accounting["dropped"][source_key] = reason

    def initialise(self, target_key: str, tensor: torch.Tensor, reason: str) -> None:
        self.accounting["initialised"][target_key] = reason
        self._write(target_key, tensor, "(initialised)")

    def add_ffn(self, source_key: str, target_prefix: str, projection: str, tensor: torch.Tensor) -> None:
        """One tensor of a dense FFN that becomes experts; the layer's experts are written once it is complete."""
        self.accounting["source_tensors"] += 1
        self.accounting["turned_into_experts"] += 1
        self._ffn_seen.setdefault(target_prefix, set()).add(projection)
        pending = self._pending.setdefault(target_prefix, {})
        pending[projection] = tensor
        if set(pending) == set(self.layout.projections):
            dense = self._pending.pop(target_prefix)
            experts = build_experts(dense, self.layout, self.names, self.construction, self.num_shared_experts,
                                    self.generator)
            for key, expert_tensor in experts.items():
                self._write(f"{target_prefix}.{key}", expert_tensor, source_key)

    def finish(self, expected_ffns: dict[str, dict[str, str]]) -> dict:
        """Check that every converted layer got its whole dense FFN (`expected_ffns`: target prefix -> {projection:
        source key}) and that every tensor of the model was written; return the accounting."""
        missing = [
            source_key
            for prefix, keys in expected_ffns.items()
            for projection, source_key in keys.items()
            if projection not in self._ffn_seen.get(prefix, ())
        ]
        if missing:
            raise ValueError(
                f"the source lacks the FFN tensors {_listing(missing)} of decoder layers to convert: it is not a "
                f"complete checkpoint of the expected architecture (or pass {option_name('mote_layers')} to convert "
                "fewer layers)"
            )
        unwritten = sorted(set(self.targets) - self.written)
        if unwritten:
            raise ValueError(
                f"the source has no tensors for {_listing(unwritten)}: the checkpoint is incomplete or of another "
                "architecture"
            )
        return self.accounting

    def _write(self, target_key: str, tensor: torch.Tensor, source_key: str) -> None:
        target = self.targets.get(target_key)
        if target is None:
            raise ValueError(
                f"source tensor {source_key} maps to {target_key}, which the MoTE model does not have: an unexpected "
                "tensor (another architecture, or a config that does not match the weights)"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"source tensor {source_key} has shape {tuple(tensor.shape)} but {target_key} is "
                f"{tuple(target.shape)}: the weights do not match config.json"
            )
        if target_key in self.written:
            raise ValueError(f"{target_key} is written twice (from {source_key})")
        with torch.no_grad():
            target.copy_(cast_checked(target_key, tensor, target.dtype))
        self.written.add(target_key)


def _listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# --- measuring the conversion ----------------------------------------------------------------------------------------


@torch.no_grad()
def route_differences(model, reference_logits: torch.Tensor, inputs: dict) -> dict[str, float]:
    """max |logits(route) - reference| for every route of `model` on `inputs` (route-homogeneous batches); for the
    dense baseline, of its one path."""
    names = model.mote_config.mote_expert_names
    if not names:
        return {"dense": float((model(**inputs).logits.float() - reference_logits.float()).abs().max())}
    batch_size = reference_logits.shape[0]
    differences = {}
    for route, name in enumerate(names):
        task_ids = torch.full((batch_size,), route, dtype=torch.long)
        logits = model(**inputs, task_ids=task_ids).logits
        differences[name] = float((logits.float() - reference_logits.float()).abs().max())
    return differences


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
    parser.add_argument("--seed", type=int, default=0, help="seeds the split partition and any new weights")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip measuring every route against the source model")
