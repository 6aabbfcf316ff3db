"""Static expert pruning of MoEMB: keep the E' most salient experts of every MoE layer (spec moemb.md §3.11, §5.6).

A calibration pass over a few balanced inputs (16 by default, half text, half image) records, for every layer, the
router inputs `x_t` of the real tokens. From them each expert j gets a saliency φ_j:

    freq   routing frequency         #{t : j ∈ TopK(t)} / |T|
    prob   router probability mass   mean_t softmax(z_t)_j
    man    mean activation norm      mean_{t→j} ‖o_tj‖₂
    msan   mean squared norm         mean_{t→j} ‖o_tj‖₂²
    reap   router-weighted norm      mean_{t→j} α_tj ‖o_tj‖₂        (REAP)

where `t→j` are the tokens that select j in their top-k, `α_tj` the gate weight the model multiplies expert j's output
by, and `o_tj = FFN_j(x_t)` is computed by the layer's own experts module (whatever `experts_implementation` is
set). An expert no calibration token selects scores 0. The E' highest of each layer are kept (ties go to the lower
id), the same E' everywhere, so the expert tensors stay rectangular: every tensor of the router and of the experts
is indexed by expert on its first dimension and is sliced (`gate.weight`, `gate.bias`, `experts.gate_up_proj`,
`experts.down_proj`, ...). The config records `num_experts = E'`, the kept ids of every layer (in the unpruned
model's numbering, so pruning a pruned model composes) and `pruned_from_num_experts`.

Top-k routing over the survivors is unchanged: a token whose top-k experts all survive selects the same experts with
the same renormalised weights, and its routed output is the same up to the last bits of the router (the softmax
normaliser is summed over E' columns instead of E, in a different order; spec §3.11 calls it bit-identical, which it
is for E' = E). Pruning saves memory, not FLOPs (k experts still run per token).

`moezoo convert --to moemb --prune-experts METHOD --keep E' --calibration FILE` prunes a Qwen3.5-MoE conversion, or
an existing MoEMB folder given as `--from` (converter `moemb-prune-experts`).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.moemb import MoEmbConfig
from ..hub.folders import read_provenance
from ..modeling.moe.block import SparseMoeBlock
from ..modeling.moemb import MoEmbForEmbedding
from ..processors.moemb import MoEmbProcessor
from ..training.moemb_data import load_mmeb_dataset
from .common import ConversionResult, option_name
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, output_dtype, saved_tensors
from .streaming import (
    Build,
    ShardWriter,
    SourceCheckpoint,
    StreamedModel,
    TensorGroup,
    check_plan,
    copy_as,
    load_layer_by_layer,
    stream_groups,
)


SALIENCY_METHODS = {
    "reap": "router-weighted expert activation norm (REAP)",
    "man": "mean activation norm",
    "msan": "mean squared activation norm",
    "freq": "routing frequency",
    "prob": "router probability mass",
}
CALIBRATION_MODALITIES = ("text", "image")
DEFAULT_CALIBRATION_SAMPLES = 16  # the paper's (App. E.2)
CALIBRATION_BATCH_SIZE = 4


# --- saliency -------------------------------------------------------------------------------------------------------


@dataclass
class ExpertSaliency:
    """Running sums over the calibration tokens of one MoE layer, from which every saliency score is read."""

    num_tokens: int
    selections: torch.Tensor  # (E,) float64: tokens that select expert j
    probability_sum: torch.Tensor  # (E,) Σ_t softmax(z_t)_j
    norm_sum: torch.Tensor  # (E,) Σ_{t→j} ‖o_tj‖
    squared_norm_sum: torch.Tensor  # (E,) Σ_{t→j} ‖o_tj‖²
    weighted_norm_sum: torch.Tensor  # (E,) Σ_{t→j} α_tj ‖o_tj‖

    @classmethod
    def zeros(cls, num_experts: int) -> ExpertSaliency:
        sums = [torch.zeros(num_experts, dtype=torch.float64) for _ in range(5)]
        return cls(0, *sums)

    @torch.no_grad()
    def add(self, block: SparseMoeBlock, tokens: torch.Tensor) -> None:
        """Count the tokens `(T, H)` that reach `block` (its router inputs, padding excluded)."""
        router_logits, top_k_weights, top_k_index = block.gate(tokens)
        self.num_tokens += tokens.shape[0]
        self.probability_sum += torch.softmax(router_logits, dim=-1).sum(dim=0).double().cpu()
        for expert in top_k_index.unique().tolist():
            token_index, slot = torch.where(top_k_index == expert)
            # The experts module with one route of weight 1 per token is FFN_j itself, in the model's implementation.
            route = torch.full((token_index.numel(), 1), expert, dtype=top_k_index.dtype, device=tokens.device)
            unit_weight = torch.ones(route.shape, dtype=tokens.dtype, device=tokens.device)
            norms = block.experts(tokens[token_index], route, unit_weight).double().norm(dim=-1)
            gate_weights = top_k_weights[token_index, slot].double()
            self.selections[expert] += token_index.numel()
            self.norm_sum[expert] += norms.sum().cpu()
            self.squared_norm_sum[expert] += norms.square().sum().cpu()
            self.weighted_norm_sum[expert] += (gate_weights * norms).sum().cpu()

    def scores(self, method: str) -> torch.Tensor:
        """φ `(E,)` of `method` (one of `SALIENCY_METHODS`); experts no token selected score 0."""
        if method not in SALIENCY_METHODS:
            raise ValueError(f"{option_name('prune_experts', method)} is not one of {', '.join(SALIENCY_METHODS)}")
        if self.num_tokens == 0:
            raise ValueError("expert saliency needs calibration tokens; none reached this layer")
        if method == "freq":
            return self.selections / self.num_tokens
        if method == "prob":
            return self.probability_sum / self.num_tokens
        total = {"man": self.norm_sum, "msan": self.squared_norm_sum, "reap": self.weighted_norm_sum}[method]
        return total / self.selections.clamp(min=1)


def moe_blocks(model: MoEmbForEmbedding) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.language_model.layers]


@torch.no_grad()
def calibrate(model: MoEmbForEmbedding, processor: MoEmbProcessor, inputs: list,
              batch_size: int = CALIBRATION_BATCH_SIZE) -> list[ExpertSaliency]:  # fmt: skip
    """Run `inputs` (MoEMB processor inputs) through the model and return the saliency sums of every layer."""
    if model.config.moe_variant == "modality":
        raise ValueError("moe_variant='modality' routes by token modality: each modality needs its expert, none can go")
    blocks = moe_blocks(model)
    saliency = [ExpertSaliency.zeros(block.num_experts) for block in blocks]

    def record(layer: int):
        def hook(block, args, kwargs):
            hidden_states, token_mask = args[0], kwargs.get("attention_mask")
            tokens = hidden_states.reshape(-1, block.hidden_size)
            if token_mask is not None:
                tokens = tokens[token_mask.reshape(-1).bool()]
            saliency[layer].add(block, tokens)

        return hook

    handles = [block.register_forward_pre_hook(record(i), with_kwargs=True) for i, block in enumerate(blocks)]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(inputs), batch_size):
            model(**processor(inputs[start : start + batch_size]).to(model.device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return saliency


# --- calibration data -------------------------------------------------------------------------------------------------


def input_modality(item: dict) -> str:
    return "video" if item.get("video") is not None else "image" if item.get("images") else "text"


def calibration_inputs(source: str | Path, num_samples: int = DEFAULT_CALIBRATION_SAMPLES,
                       modalities: tuple[str, ...] = CALIBRATION_MODALITIES,
                       image_root: str | Path | None = None) -> list[dict]:  # fmt: skip
    """`num_samples` inputs balanced over `modalities` (split as evenly as possible, in file order) from data in
    MMEB's training format (`qry`, `qry_image_path`, `pos_text`, `pos_image_path`; queries and targets both count).
    An input with an image counts as an image input whatever its text."""
    if not isinstance(num_samples, int) or num_samples < len(modalities):
        raise ValueError(
            f"{option_name('calibration_samples', num_samples)} must be an integer of at least one input per "
            f"calibration modality ({', '.join(modalities)})"
        )
    unknown = sorted(set(modalities) - set(CALIBRATION_MODALITIES))
    if unknown or not modalities or len(set(modalities)) != len(modalities):
        raise ValueError(
            f"{option_name('calibration_modalities', ','.join(modalities))} must name distinct modalities among "
            f"{', '.join(CALIBRATION_MODALITIES)}"
        )
    quota = {m: num_samples // len(modalities) + (i < num_samples % len(modalities)) for i, m in enumerate(modalities)}
    chosen = {modality: [] for modality in modalities}
    for example in load_mmeb_dataset(source, image_root):
        for item in (example["query"], example["target"]):
            modality = input_modality(item)
            if modality in chosen and len(chosen[modality]) < quota[modality]:
                chosen[modality].append(item)
        if all(len(chosen[m]) == quota[m] for m in modalities):
            break
    short = {modality: len(items) for modality, items in chosen.items() if len(items) < quota[modality]}
    if short:
        found = ", ".join(f"{count} {modality}" for modality, count in short.items())
        raise ValueError(
            f"the calibration data {option_name('calibration', source)} holds only {found} input(s), but "
            f"{option_name('calibration_samples', num_samples)} balanced over "
            f"{option_name('calibration_modalities', ','.join(modalities))} needs "
            + ", ".join(f"{quota[m]} {m}" for m in short)
            + ": add such rows, or calibrate on fewer inputs or on the modalities the data has"
        )
    return [item for modality in modalities for item in chosen[modality]]


# --- pruning --------------------------------------------------------------------------------------------------------


def kept_experts(saliency: list[ExpertSaliency], method: str, keep: int) -> list[list[int]]:
    """The `keep` highest-scoring experts of every layer, ascending (ties go to the lower id)."""
    kept = []
    for layer in saliency:
        order = torch.sort(layer.scores(method), descending=True, stable=True).indices
        kept.append(sorted(order[:keep].tolist()))
    return kept


def check_keep(config, keep) -> None:
    text = config.text_config
    if not isinstance(keep, int) or isinstance(keep, bool) or not text.num_experts_per_tok <= keep <= text.num_experts:
        raise ValueError(
            f"{option_name('keep', keep)} must be an integer from the experts each token selects "
            f"(num_experts_per_tok={text.num_experts_per_tok}) to the experts per layer (num_experts="
            f"{text.num_experts}): top-k routing needs at least k experts, and pruning cannot add any"
        )


def check_kept_ids(config: MoEmbConfig, kept: list[list[int]]) -> None:
    """Fail unless `kept` holds one ascending list of distinct expert ids per layer, all of one length."""
    text = config.text_config
    keep = len(kept[0])
    for layer, ids in enumerate(kept):
        if len(ids) != keep or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= text.num_experts:
            raise ValueError(
                f"kept experts of layer {layer}: {ids} must be {keep} distinct ascending ids below {text.num_experts}, "
                "as many in every layer"
            )


def record_pruning(config: MoEmbConfig, kept: list[list[int]]) -> None:
    """Record in `config`, in place, that each layer keeps the experts of `kept` (in its own numbering)."""
    text = config.text_config
    # Ids in the unpruned model's numbering: a pruned model pruned again keeps pointing at the original experts.
    previous = config.kept_expert_ids or [list(range(text.num_experts))] * text.num_hidden_layers
    config.kept_expert_ids = [[before[expert] for expert in ids] for before, ids in zip(previous, kept)]
    config.pruned_from_num_experts = config.pruned_from_num_experts or text.num_experts
    text.num_experts = len(kept[0])
    config.validate_fields()


def expert_indexed_tensors(model: MoEmbForEmbedding) -> dict[str, int]:
    """The state-dict names of every tensor expert pruning slices (the routers' and experts' own parameters and
    buffers, indexed by expert on their first dimension), with their layer; fails on one it would not know how to
    slice. `model` may be on the `meta` device."""
    names = {id(module): name for name, module in model.named_modules()}
    sliced = {}
    for layer, block in enumerate(moe_blocks(model)):
        for module in (block.gate, block.experts):
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.shape[0] != block.num_experts:
                    raise ValueError(
                        f"{block.layer_name}: {name} of shape {tuple(tensor.shape)} is not indexed by expert on its "
                        f"first dimension ({block.num_experts} experts); expert pruning does not know how to slice it"
                    )
                sliced[f"{names[id(module)]}.{name}"] = layer
    return sliced


@torch.no_grad()
def keep_experts(model: MoEmbForEmbedding, kept: list[list[int]]) -> None:
    """Slice every layer's router and experts to the ids of `kept` (one ascending list per layer, all of one length),
    in place, and record the pruning in the config."""
    config = model.config
    check_kept_ids(config, kept)
    expert_indexed_tensors(model)  # every tensor can be sliced, before one is
    keep = len(kept[0])
    for block, ids in zip(moe_blocks(model), kept, strict=True):
        index = torch.tensor(ids, device=block.gate.weight.device)
        for module in (block.gate, block.experts):
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                sliced = tensor[index].clone()
                if isinstance(tensor, nn.Parameter):
                    setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
                else:
                    setattr(module, name, sliced)
            module.num_experts = keep
        block.gate.reset_counts()
        block.num_experts = keep
        block.spec = replace(block.spec, num_experts=keep)
    record_pruning(config, kept)
    with torch.device("meta"):
        expected = {key: value.shape for key, value in MoEmbForEmbedding(config).state_dict().items()}
    got = {key: value.shape for key, value in model.state_dict().items()}
    if got != expected:
        differing = sorted(key for key in expected.keys() | got.keys() if expected.get(key) != got.get(key))
        raise RuntimeError(f"expert pruning left tensors that do not fit the pruned config: {differing[:4]}")


@dataclass(frozen=True)
class ExpertPruning:
    """What `--prune-experts` asks for."""

    method: str
    keep: int
    calibration: str | Path
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    calibration_modalities: tuple[str, ...] = CALIBRATION_MODALITIES
    image_root: str | Path | None = None

    @classmethod
    def pop_from(cls, options: dict) -> ExpertPruning | None:
        """The pruning options of a converter's parsed options (removed from them); None without `prune_experts`."""
        method = options.pop("prune_experts", None)
        values = {name: options.pop(name, None) for name in ("keep", "calibration", "calibration_samples",
                                                               "calibration_modalities", "calibration_image_root")}
        if method is None:
            given = [option_name(name) for name in ("keep", "calibration") if values[name] is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} only apply with {option_name('prune_experts')}")
            return None
        for name in ("keep", "calibration"):
            if values[name] is None:
                raise ValueError(f"{option_name('prune_experts', method)} needs {option_name(name)}")
        modalities = values["calibration_modalities"] or CALIBRATION_MODALITIES
        if isinstance(modalities, str):
            modalities = tuple(modality.strip() for modality in modalities.split(","))
        return cls(method, values["keep"], values["calibration"],
                   values["calibration_samples"] or DEFAULT_CALIBRATION_SAMPLES, tuple(modalities),
                   values["calibration_image_root"])  # fmt: skip

    def apply(self, model: MoEmbForEmbedding, processor: MoEmbProcessor | None) -> dict:
        """Calibrate, prune `model` in place, and report the method, the kept ids, and how far the embeddings of the
        calibration inputs moved against the unpruned model (`max_abs_diff`, `min_cosine_to_unpruned`)."""
        inputs = self._calibration_inputs(model.config, processor)
        saliency = calibrate(model, processor, inputs)
        kept = kept_experts(saliency, self.method, self.keep)
        before = _embeddings(model, processor, inputs)
        keep_experts(model, kept)
        return self._report(model.config, inputs, saliency, before, _embeddings(model, processor, inputs))

    def write(self, source: Path, output: Path, processor: MoEmbProcessor | None, dtype: torch.dtype,
              max_shard_size: int | str = "5GB") -> dict:  # fmt: skip
        """`apply` from the MoEMB folder `source` into the folder `output` (config.json and safetensors, in `dtype`),
        the model never loaded whole: the calibration and both measurements of the embeddings run the model layer by
        layer (`streaming.load_layer_by_layer`), and the pruned tensors are written as the source is read, one tensor
        and one output shard at a time."""
        config = MoEmbConfig.from_pretrained(source)
        inputs = self._calibration_inputs(config, processor)
        checkpoint = SourceCheckpoint(source, "the MoEMB source")
        with tempfile.TemporaryDirectory(prefix="moemb-expert-pruning-") as offload:
            model = load_layer_by_layer(MoEmbForEmbedding, source, Path(offload) / "source", dtype=dtype)
            saliency = calibrate(model, processor, inputs)
            kept = kept_experts(saliency, self.method, self.keep)
            before = _embeddings(model, processor, inputs)
            with torch.device("meta"):
                sliced = expert_indexed_tensors(MoEmbForEmbedding(config))
            del model
            check_kept_ids(config, kept)
            record_pruning(config, kept)
            with torch.device("meta"):
                pruned = MoEmbForEmbedding(config)
            groups = [TensorGroup((key,), _expert_slice(key, kept[sliced[key]])) if key in sliced else copy_as(key, key)
                      for key in checkpoint.shapes]  # fmt: skip
            expected = {key: tuple(tensor.shape) for key, tensor in pruned.state_dict().items()}
            check_plan([checkpoint], groups, (), expected, "the pruned MoEMB model")
            kept_in_float32 = {name for name, _, float32_kept in saved_tensors(pruned) if float32_kept}
            writer = ShardWriter(output, convert_file_size_to_int(max_shard_size), dtype)
            for key, tensor in stream_groups([checkpoint], groups):
                writer.add(key, tensor, cast=key not in kept_in_float32)
            writer.finish()
            config.architectures = [MoEmbForEmbedding.__name__]
            config.dtype = dtype
            config.save_pretrained(output)
            model = load_layer_by_layer(MoEmbForEmbedding, output, Path(offload) / "pruned", dtype=dtype)
            after = _embeddings(model, processor, inputs)
        return self._report(config, inputs, saliency, before, after)

    def _calibration_inputs(self, config: MoEmbConfig, processor: MoEmbProcessor | None) -> list[dict]:
        """The options checked against the model's config, then the calibration inputs."""
        if self.method not in SALIENCY_METHODS:
            raise ValueError(f"{option_name('prune_experts', self.method)} is not one of {', '.join(SALIENCY_METHODS)}")
        check_keep(config, self.keep)
        if processor is None:
            raise ValueError(f"{option_name('prune_experts', self.method)} needs a tokenizer to calibrate with; the "
                             "source has none")  # fmt: skip
        return calibration_inputs(self.calibration, self.calibration_samples, self.calibration_modalities,
                                  self.image_root)  # fmt: skip

    def _report(self, pruned_config: MoEmbConfig, inputs: list, saliency: list[ExpertSaliency], before: torch.Tensor,
                after: torch.Tensor) -> dict:  # fmt: skip
        return {
            "method": self.method,
            "score": SALIENCY_METHODS[self.method],
            "keep": self.keep,
            "pruned_from_num_experts": pruned_config.pruned_from_num_experts,
            "kept_expert_ids": pruned_config.kept_expert_ids,
            "calibration": {"source": str(self.calibration), "inputs": len(inputs),
                            "modalities": list(self.calibration_modalities),
                            "tokens_per_layer": saliency[0].num_tokens},  # fmt: skip
            "max_abs_diff": float((after - before).abs().max()),
            "min_cosine_to_unpruned": float(F.cosine_similarity(after, before, dim=-1).min()),
        }


def _expert_slice(key: str, ids: list[int]) -> Build:
    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        return {key: tensors[key][torch.tensor(ids, device=device)]}

    return build


@torch.no_grad()
def _embeddings(model: MoEmbForEmbedding, processor: MoEmbProcessor, inputs: list) -> torch.Tensor:
    chunks = [model(**processor(inputs[start : start + CALIBRATION_BATCH_SIZE]).to(model.device)).embeddings
              for start in range(0, len(inputs), CALIBRATION_BATCH_SIZE)]  # fmt: skip
    return torch.cat(chunks).float().cpu()


# --- `moezoo convert --to moemb --from <MoEMB folder> --prune-experts METHOD --keep E' --calibration FILE` ----------


def add_pruning_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The `--prune-experts` options: optional after a Qwen3.5-MoE conversion, required for a MoEMB source."""
    group = parser.add_argument_group("expert pruning (spec §3.11)" + ("" if required else ": after the conversion"))
    group.add_argument("--prune-experts", choices=list(SALIENCY_METHODS), required=required, metavar="METHOD",
                       help="the saliency that ranks the experts of each layer: "
                            + "; ".join(f"{name}: {what}" for name, what in SALIENCY_METHODS.items()))
    group.add_argument("--keep", type=int, required=required, help="experts kept in every layer (E')")
    group.add_argument("--calibration", required=required, metavar="FILE",
                       help="calibration inputs in MMEB's training format (a table, or a folder of them)")
    group.add_argument("--calibration-samples", type=int, default=None,
                       help=f"inputs to calibrate on, balanced over the modalities (default "
                            f"{DEFAULT_CALIBRATION_SAMPLES})")
    group.add_argument("--calibration-modalities", default=None,
                       help=f"comma-separated, default {','.join(CALIBRATION_MODALITIES)}")
    group.add_argument("--calibration-image-root", default=None,
                       help="what image paths are relative to (default: the calibration data's folder)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pruning_arguments(parser, required=True)
    add_dtype_argument(parser)
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest output shard, which the pruning holds in memory before writing it")


def pruned_config(config: MoEmbConfig, keep: int) -> MoEmbConfig:
    """The config of the model pruned to `keep` experts per layer, known before calibrating (its kept ids are not)."""
    check_keep(config, keep)
    pruned = copy.deepcopy(config)
    pruned.text_config.num_experts = keep
    return pruned


def _requested_pruning(options: dict) -> ExpertPruning:
    pruning = ExpertPruning.pop_from(options)
    if pruning is None:
        raise ValueError(f"a MoEMB source is converted by pruning its experts: pass {option_name('prune_experts')}")
    return pruning


def plan_output(source: Path, **options) -> PlannedOutput:
    """What `convert` writes, from the source's config alone (`moezoo convert --dry-run`, the disk-space check)."""
    keep = _requested_pruning(options).keep
    return PlannedOutput(pruned_config(MoEmbConfig.from_pretrained(source), keep), (Path(source),))


def convert(source: Path, dtype: str | None = None, max_shard_size: str = "5GB", **options) -> ConversionResult:
    """The converter behind the command for a MoEMB source: prune its experts into a temporary folder (the result's
    `StreamedModel`, which `moezoo convert` moves into its output), in `dtype` (default: the source's), the model
    run layer by layer and never loaded whole (`ExpertPruning.write`)."""
    pruning = _requested_pruning(options)
    processor = MoEmbProcessor.from_pretrained(source)
    model = StreamedModel(MoEmbForEmbedding, "moemb-expert-pruning-")
    report = pruning.write(Path(source), model.folder, processor, output_dtype(dtype, Path(source)), max_shard_size)
    source_provenance = read_provenance(source)
    provenance = {
        "source": str(source),
        "base_model": source_provenance.get("base_model", str(source)),
        "license": source_provenance.get("license"),
        "expert_pruning": report,
        "max_abs_diff": report["max_abs_diff"],
        "notes": [
            f"max_abs_diff compares the embeddings of the {report['calibration']['inputs']} calibration inputs "
            "with those of the unpruned source model, in fp32.",
        ],
    }
    return ConversionResult(model=model, processor=processor, provenance=provenance)
