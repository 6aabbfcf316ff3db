"""`moezoo bench smoes`: the bytes expert parallelism really sends, with and without SMoES (spec smoes.md §3.2, E4).

Two copies of the tiny SMoES Qwen3.5-MoE VLM (16 experts top-4 in 4 bins, so that a token's experts can share a
device) are trained from the same initialisation on a synthetic two-modality task, a plain AdamW loop:

- *top-k*: SMoES off, the base model's load-balancing loss; experts stay where transformers' contiguous sharding
  puts them;
- *SMoES*: the SMoES losses, then `smoes_export_bin_aligned`, so the same sharding places whole bins per device.

Each trained model routes one evaluation batch; every MoE layer's routed tokens (what transformers hands the
`ep_dispatch_experts` module) are then replayed on D gloo processes through transformers' `AllToAllEP` (one copy per
(token, expert) pair) and moezoo's `DedupAllToAllEP` (one copy per (token, rank)), each process holding its
contiguous expert range with the trained weights and the samples of its data-parallel rank (sample i on rank
i mod D). The bytes are those the forward all-to-alls send to other ranks (`AllToAllTraffic`: token rows, routing
metadata, split counts; the backward mirrors the forward). Wall-clock is not measured: on one CPU machine it says
nothing about a network.

The target (SMoES' paper: cross-device EP traffic down 68%) is stated as: SMoES with the dedup EP sends at least 56%
fewer bytes than stock EP without SMoES. Beside it stands the floor: the saving of perfect specialisation, where each
token's experts sit on one device and only tokens whose home is another device cross, (D - 1) / D of them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..configuration.smoes import SmoesQwen3_5MoeConfig
from ..modeling.moe import DedupAllToAllEP, MoeLayerSpec, SwiGLUExperts
from ..modeling.moe.expert_parallel import AllToAllTraffic
from ..modeling.moe.smoes.placement import (
    DispatchMetrics,
    check_placement,
    dispatch_metrics,
    smoes_export_bin_aligned,
)
from ..modeling.smoes.qwen3_5_moe import SmoesQwen3_5MoeForConditionalGeneration
from ..presets.smoes import TINY_SMOES
from ..terminal import console, print_table


DEFAULT_DEVICES = (2, 4)
TARGET_SAVING = 0.56
IMPLEMENTATIONS = ("all_to_all", "dedup")
# The tiny preset with more, smaller choices per token (16 experts top-4 in 4 bins) and alpha_MI 1 (spec §8.10).
BENCH_TEXT_CONFIG = {
    **TINY_SMOES["text_config"], "num_experts": 16, "num_experts_per_tok": 4, "smoes_num_bins": 4,
    "smoes_ep_devices": 2, "smoes_mi_coef": 1.0, "smoes_bal_coef": 0.01, "smoes_score_type": "attention",
}  # fmt: skip
IMAGE_SIZE = 32  # one 32x32 image: (1, 8, 8) patches of 4x4, merged 2x2 into 16 image tokens
CAPTION_TOKENS = 6
NUM_CLASSES = 4


def bench_config(**text_fields) -> SmoesQwen3_5MoeConfig:
    """The benchmark's model: the tiny preset with `BENCH_TEXT_CONFIG`, and `text_fields` on top."""
    return SmoesQwen3_5MoeConfig(**{**TINY_SMOES, "text_config": {**BENCH_TEXT_CONFIG, **text_fields}})


def synthetic_batch(config: SmoesQwen3_5MoeConfig, batch_size: int, generator: torch.Generator) -> dict:
    """Captioned images of `NUM_CLASSES` classes: each image is its class's pixel pattern plus noise, each caption its
    class's fixed token sequence. Sequences: vision_start, 16 image tokens, vision_end, the caption (2/3 vision)."""
    vision = config.vision_config
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = (1, IMAGE_SIZE // vision.patch_size, IMAGE_SIZE // vision.patch_size)
    patches, image_tokens = grid[1] * grid[2], grid[1] * grid[2] // vision.spatial_merge_size**2
    class_generator = torch.Generator().manual_seed(1234)  # the classes are the same in every batch
    patterns = torch.randn(NUM_CLASSES, patches, patch_values, generator=class_generator)
    captions = torch.randint(4, config.image_token_id, (NUM_CLASSES, CAPTION_TOKENS), generator=class_generator)

    classes = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    noise = 0.5 * torch.randn(batch_size, patches, patch_values, generator=generator)
    image = torch.full((batch_size, image_tokens), config.image_token_id)
    input_ids = torch.cat([
        torch.full((batch_size, 1), config.vision_start_token_id), image,
        torch.full((batch_size, 1), config.vision_end_token_id), captions[classes],
    ], dim=1)  # fmt: skip
    labels = torch.where(input_ids < config.image_token_id, input_ids, -100)
    return dict(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels,
        mm_token_type_ids=(input_ids == config.image_token_id).int(),
        pixel_values=(patterns[classes] + noise).reshape(-1, patch_values),
        image_grid_thw=torch.tensor([grid] * batch_size),
    )  # fmt: skip


def train(config: SmoesQwen3_5MoeConfig, steps: int, batch_size: int, seed: int = 0):
    """A plain AdamW loop (lr 3e-3, spec §8.10) on fresh synthetic batches."""
    torch.manual_seed(seed)
    model = SmoesQwen3_5MoeForConditionalGeneration(config)
    model.set_experts_implementation("eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        # without SMoES the base model adds its own load-balancing loss when it returns the router logits
        loss = model(**synthetic_batch(config, batch_size, generator), output_router_logits=True).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@dataclass
class RoutedLayer:
    """What one MoE layer hands its experts: the routed tokens (N, H), their top-k (N, k) and weights (N, k), and
    the experts' fused weights."""

    hidden_states: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


@torch.no_grad()
def route(model, batch: dict) -> list[RoutedLayer]:
    """Every MoE layer's expert inputs on `batch` (eval forward)."""
    layers = []

    def keep(experts, args):
        layers.append(RoutedLayer(*(tensor.detach().clone() for tensor in args), experts.gate_up_proj.detach().clone(),
                                  experts.down_proj.detach().clone()))  # fmt: skip

    hooks = [layer.mlp.experts.register_forward_pre_hook(keep) for layer in model.model.language_model.layers]
    try:
        model(**{name: value for name, value in batch.items() if name != "labels"})
    finally:
        for hook in hooks:
            hook.remove()
    return layers


def _replay_on_rank(rank: int, world: int, init_file: str, routed_path: str, result_path: str) -> None:
    """One gloo process: its samples' tokens of every layer through each EP implementation, counting the bytes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import PreTrainedConfig
    from transformers.distributed.expert_parallel import AllToAllEP

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    experts_config = PreTrainedConfig()
    experts_config._experts_implementation = "eager"
    saved = torch.load(routed_path)
    sequence_length, bytes_sent = saved["sequence_length"], {}
    for routing, layers in saved["routings"].items():
        for implementation in IMPLEMENTATIONS:
            traffic = AllToAllTraffic()
            for layer in map(lambda fields: RoutedLayer(**fields), layers):
                num_experts, _, hidden_size = layer.gate_up_proj.shape
                rows = torch.arange(layer.hidden_states.size(0)).view(-1, sequence_length)[rank::world].reshape(-1)
                experts = SwiGLUExperts(experts_config, MoeLayerSpec(
                    hidden_size=hidden_size, num_experts=num_experts // world,
                    num_experts_per_tok=layer.top_k_index.size(1), expert_intermediate_size=layer.down_proj.size(2),
                ))  # fmt: skip
                own = slice(rank * experts.num_experts, (rank + 1) * experts.num_experts)
                with torch.no_grad():
                    experts.gate_up_proj.copy_(layer.gate_up_proj[own])
                    experts.down_proj.copy_(layer.down_proj[own])
                experts._is_expert_parallel = True
                ep_class = DedupAllToAllEP if implementation == "dedup" else AllToAllEP
                with traffic.record(), torch.no_grad():
                    ep_class(experts, mesh["ep"], mesh["tp"])(
                        layer.hidden_states[rows], layer.top_k_index[rows], layer.top_k_weights[rows]
                    )
            bytes_sent[f"{routing}/{implementation}"] = traffic.bytes_sent
    totals = torch.tensor(list(bytes_sent.values()), dtype=torch.float64)
    dist.all_reduce(totals)
    if rank == 0:
        Path(result_path).write_text(json.dumps(dict(zip(bytes_sent, totals.tolist()))))
    dist.destroy_process_group()


def measure_bytes(routings: dict[str, list[RoutedLayer]], sequence_length: int, num_devices: int) -> dict[str, int]:
    """Bytes all D processes together sent to other ranks, per "routing/implementation"."""
    with tempfile.TemporaryDirectory() as folder:
        routed_path, result_path = Path(folder, "routed.pt"), Path(folder, "bytes.json")
        tensors = {routing: [asdict(layer) for layer in layers] for routing, layers in routings.items()}
        torch.save(dict(routings=tensors, sequence_length=sequence_length), routed_path)
        mp.spawn(_replay_on_rank, args=(num_devices, str(Path(folder, "init")), str(routed_path), str(result_path)),
                 nprocs=num_devices)  # fmt: skip
        return {name: int(value) for name, value in json.loads(result_path.read_text()).items()}


def mean_dispatch(layers: list[RoutedLayer], sequence_length: int, num_devices: int) -> DispatchMetrics:
    """`dispatch_metrics` of the contiguous placement, averaged over layers."""
    per_layer = []
    for layer in layers:
        top_k_index = layer.top_k_index.view(-1, sequence_length, layer.top_k_index.size(1))
        home = (torch.arange(top_k_index.size(0)) % num_devices)[:, None].expand(top_k_index.shape[:2])
        placement = torch.arange(layer.gate_up_proj.size(0)) // (layer.gate_up_proj.size(0) // num_devices)
        valid = torch.ones(top_k_index.shape[:2], dtype=torch.bool)
        per_layer.append(dispatch_metrics(top_k_index, valid, placement, home, num_devices))
    fields = ("span_frac", "remote_any_frac", "remote_pair_frac", "dedup_remote_devices_per_token")
    mean = {name: sum(getattr(metrics, name) for metrics in per_layer) / len(per_layer) for name in fields}
    load = [sum(values) / len(per_layer) for values in zip(*(metrics.device_load_share for metrics in per_layer))]
    return DispatchMetrics(**mean, device_load_share=load)


@dataclass
class SmoesBenchRow:
    devices: int
    routing: str  # "top-k" (SMoES off, contiguous experts) or "smoes" (bins placed by the export permutation)
    implementation: str  # "all_to_all" (transformers) or "dedup" (moezoo)
    bytes_sent: int  # forward all-to-alls, all ranks, to other ranks
    saving: float  # 1 - bytes / bytes of (top-k, all_to_all) at the same device count
    span_frac: float
    remote_any_frac: float
    remote_pair_frac: float
    dedup_remote_devices_per_token: float
    load_imbalance: float  # busiest device's (token, expert) pairs over the mean


@dataclass
class SmoesVerdict:
    devices: int
    saving: float  # SMoES + dedup against top-k + all_to_all
    target: float
    floor: float  # the saving of perfect specialisation under the same placement
    met: bool


def run_smoes_bench(
    devices: Sequence[int] = DEFAULT_DEVICES, steps: int = 40, batch_size: int = 8, eval_samples: int = 16
) -> tuple[list[SmoesBenchRow], list[SmoesVerdict]]:
    """Train both models, route one evaluation batch, and measure the four (routing, EP) pairs on each device count:
    one row per pair and device count, one verdict per device count."""
    num_experts, num_bins = BENCH_TEXT_CONFIG["num_experts"], BENCH_TEXT_CONFIG["smoes_num_bins"]
    for num_devices in devices:
        if eval_samples % num_devices or num_experts % num_devices:
            raise ValueError(
                f"--devices {num_devices} must divide the {eval_samples} evaluation samples and the {num_experts} "
                "experts"
            )
        check_placement(num_experts, num_bins, num_devices)
    top_k_model = train(bench_config(smoes_enabled=False), steps, batch_size)
    smoes_model = smoes_export_bin_aligned(train(bench_config(), steps, batch_size))
    batch = synthetic_batch(top_k_model.config, eval_samples, torch.Generator().manual_seed(10_000))
    sequence_length = batch["input_ids"].size(1)
    routings = {"top-k": route(top_k_model, batch), "smoes": route(smoes_model, batch)}
    rows, verdicts = [], []
    for num_devices in devices:
        bytes_sent = measure_bytes(routings, sequence_length, num_devices)
        baseline = bytes_sent["top-k/all_to_all"]
        for routing, layers in routings.items():
            metrics = mean_dispatch(layers, sequence_length, num_devices)
            for implementation in IMPLEMENTATIONS:
                sent = bytes_sent[f"{routing}/{implementation}"]
                rows.append(SmoesBenchRow(
                    num_devices, routing, implementation, sent, 1 - sent / baseline, metrics.span_frac,
                    metrics.remote_any_frac, metrics.remote_pair_frac, metrics.dedup_remote_devices_per_token,
                    metrics.load_imbalance,
                ))  # fmt: skip
        floor = 1 - _perfect_specialisation_bytes(routings["smoes"], num_devices) / baseline
        saving = 1 - bytes_sent["smoes/dedup"] / baseline
        verdicts.append(SmoesVerdict(num_devices, saving, TARGET_SAVING, floor, saving >= TARGET_SAVING))
    return rows, verdicts


def _perfect_specialisation_bytes(layers: list[RoutedLayer], num_devices: int) -> float:
    """Bytes the dedup EP would send if every token's experts sat on one device: the (D - 1) / D of the tokens whose
    home is another device go out once, with their k ids and weights, and come back once (split counts aside)."""
    total = 0.0
    for layer in layers:
        tokens, hidden_size = layer.hidden_states.shape
        k, element = layer.top_k_index.size(1), layer.hidden_states.element_size()
        row_out = hidden_size * element + k * (layer.top_k_index.element_size() + layer.top_k_weights.element_size())
        total += tokens * (num_devices - 1) / num_devices * (row_out + hidden_size * element)
    return total


def add_bench_arguments(parser) -> None:
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEFAULT_DEVICES),
                        help="expert-parallel gloo processes to measure on (each must divide 16 experts and the "
                             "evaluation samples)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=40, help="training steps of each model")
    parser.add_argument("--batch-size", type=int, default=8, help="training samples per step")
    parser.add_argument("--eval-samples", type=int, default=16, help="samples of the routed evaluation batch")
    parser.add_argument("--json", action="store_true", help="print the rows and verdicts as JSON")


def run_bench(args) -> int:
    with console.status("training the top-k and SMoES models, then replaying their routing on gloo processes"):
        rows, verdicts = run_smoes_bench(args.devices, args.steps, args.batch_size, args.eval_samples)
    if args.json:
        print(json.dumps({"rows": [asdict(row) for row in rows], "verdicts": [asdict(v) for v in verdicts]}, indent=2))
        return 0
    print_table(
        f"Expert-parallel all-to-all bytes (forward, all ranks) after {args.steps} training steps; "
        f"{args.eval_samples} samples routed, sample i on rank i mod D",
        ("devices", "routing", "EP", "bytes sent", "saving", "span", "remote any", "remote pairs",
         "dedup remote dev/token", "load max/mean"),
        [(row.devices, row.routing, row.implementation, row.bytes_sent, f"{row.saving:.1%}", row.span_frac,
          row.remote_any_frac, row.remote_pair_frac, row.dedup_remote_devices_per_token, row.load_imbalance)
         for row in rows],
    )  # fmt: skip
    print_table(
        "SMoES + dedup EP against stock EP without SMoES",
        ("devices", "saving", "target", "floor (perfect specialisation)", "met"),
        [(v.devices, f"{v.saving:.1%}", f"{v.target:.0%}", f"{v.floor:.1%}", "yes" if v.met else "no")
         for v in verdicts],
    )  # fmt: skip
    return 0
