"""`moezoo bench conversion`: the peak memory and wall time of the streaming converters on synthetic sources at the
papers' real widths, a few layers deep (issue 29 item 1; DESIGN.md, "Real scale").

A source is written as its release is on the Hub: transformers' own class, built on the meta device, gives every
tensor's name and shape, `revert_weight_conversion` the checkpoint layout (Qwen3.5-MoE's per-expert 2D tensors), and
the tensors are written in bf16, one decoder layer at a time, into shards; they are zeros but the routers (random, so
that tokens spread over the experts as they would). Every other layer uses full attention, so that two layers already
hold both kinds of Qwen3.5's layers.

Each converter runs in a child process (a fresh interpreter, so the parent's memory does not count) that converts the
sources one after the other, after an unmeasured conversion of the first (so that what is imported or cached on the
first call is not counted as the first source's), and reports per source the peak of its anonymous resident memory (`RssAnon`, sampled
every few milliseconds: the pages of the memory-mapped safetensors files are the page cache's, shared and reclaimable,
not the conversion's) above what it held before, and the wall time. The growth of that peak from a shallow to a deeper
source, as a share of what the added layers weigh, is what "does not grow with the depth" means: near 0.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.core_model_loading import revert_weight_conversion

from ..configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB
from ..conversion.streaming import ShardWriter
from ..terminal import print_table


# Qwen3.5-35B-A3B as released (hidden 2048, 256 experts of 512, vocabulary 248320, its vision tower); "reduced" keeps
# the layout at widths a test affords (one layer: 2 x 26 MB of experts in bf16).
_A3B = MOEMB_CONFIGS["MoEMB-A3B"]
SOURCES = {
    "qwen3_5_moe": dict(text_config=dict(_A3B["text_config"], full_attention_interval=2),
                        vision_config=_A3B["vision_config"]),
    "qwen3_5_moe-reduced": dict(
        text_config=dict(
            TINY_MOEMB["text_config"], hidden_size=512, num_experts=64, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, vocab_size=4096, full_attention_interval=2,
        ),
        vision_config=dict(TINY_MOEMB["vision_config"], out_hidden_size=512),
        image_token_id=4000, video_token_id=4001, vision_start_token_id=4002, vision_end_token_id=4003,
    ),
}  # fmt: skip
DEFAULT_LAYERS = (2, 4)
# The output shards: the run at real widths; at test widths, smaller than a layer (a conversion holds one).
SHARD_SIZES = {"qwen3_5_moe": "1GB", "qwen3_5_moe-reduced": "8MB"}
SAMPLE_SECONDS = 0.002
WIDTHS_FILE = "moezoo_bench_widths.json"


# --- the synthetic source -------------------------------------------------------------------------------------------


def write_synthetic_source(folder: Path, widths: str, num_layers: int, seed: int = 0) -> int:
    """A Qwen3.5-MoE checkpoint folder (config.json, bf16 safetensors shards and their index) at `widths` (a key of
    `SOURCES`) with `num_layers` decoder layers; returns the bytes of its tensors."""
    fields = copy.deepcopy(SOURCES[widths])
    fields["text_config"] |= {"num_hidden_layers": num_layers, "layer_types": None}
    config = Qwen3_5MoeConfig(**fields)
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, _bytes(SHARD_SIZES[widths]), torch.bfloat16)
    shapes = {key: tensor.shape for key, tensor in model.state_dict().items()}
    for keys in _by_layer(list(shapes)):
        tensors = {}
        for key in keys:
            router = key.endswith("mlp.gate.weight")
            tensors[key] = (torch.randn(shapes[key], generator=generator) * 0.02 if router else (
                torch.zeros(shapes[key]))).to(torch.bfloat16)
        for key, tensor in revert_weight_conversion(model, tensors).items():
            writer.add(key, tensor)
    writer.finish()
    config.dtype = torch.bfloat16
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    (folder / WIDTHS_FILE).write_text(json.dumps(widths))
    return writer.total_size


def _by_layer(keys: list[str]) -> list[list[str]]:
    """The state-dict keys in groups: one per decoder layer, and one of the rest."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        prefix, _, rest = key.partition(".layers.")
        group = f"{prefix}.layers.{rest.split('.')[0]}" if rest else ""
        groups.setdefault(group, []).append(key)
    return list(groups.values())


def _bytes(size: str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


# --- the converters, as the bench runs them ---------------------------------------------------------------------------


def _moemb(variant: str) -> Callable[[Path, bool], dict]:
    def run(source: Path, verify: bool) -> dict:
        from ..conversion.moemb_qwen3_5 import convert

        config = json.loads((source / "config.json").read_text())
        emb_token_id = config["text_config"]["vocab_size"] - 1  # no tokenizer: a row of the source's own
        return convert(source, variant, verify=verify, emb_token_id=emb_token_id,
                       max_shard_size=_shard_size(source)).provenance

    return run


def _smoes(source: Path, verify: bool) -> dict:
    from ..conversion.smoes_qwen3_5_moe import convert_qwen3_5_moe_to_smoes

    return convert_qwen3_5_moe_to_smoes(source, verify=verify, max_shard_size=_shard_size(source))[1]


def _shard_size(source: Path) -> str:
    """The output shards of a source's widths (what `write_synthetic_source` wrote beside it)."""
    return SHARD_SIZES[json.loads((source / WIDTHS_FILE).read_text())]


CONVERTERS: dict[str, Callable[[Path, bool], dict]] = {
    "moemb": _moemb("native"),
    "smoes": _smoes,
}


# --- measuring ------------------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    converter: str
    source_layers: int
    source_bytes: int
    verify: bool
    peak_anonymous_bytes: int  # above what the process held before the conversion
    seconds: float
    max_abs_diff: float | None


def anonymous_resident_bytes() -> int:
    """This process's `RssAnon` (Linux): resident memory that no file backs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon: measuring memory needs Linux")


class PeakSampler:
    """The highest `RssAnon` a thread sees while the `with` block runs (every `SAMPLE_SECONDS`)."""

    def __enter__(self) -> PeakSampler:
        self.peak = anonymous_resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, anonymous_resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_resident_bytes())


def release_freed_memory() -> None:
    """Hand the allocator's freed pages back to the system, so that one conversion's leftovers do not raise the next
    one's starting point (glibc keeps small freed blocks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def measure_here(converter: str, sources: Sequence[Path], verify: bool) -> list[Measurement]:
    """Convert each source in this process, the first once unmeasured before, and report each."""
    run = CONVERTERS[converter]
    run(sources[0], verify)
    results = []
    for source in sources:
        release_freed_memory()
        before = anonymous_resident_bytes()
        start = time.perf_counter()
        with PeakSampler() as sampler:
            report = run(source, verify)
        seconds = time.perf_counter() - start
        release_freed_memory()
        config = json.loads((source / "config.json").read_text())
        results.append(Measurement(
            converter=converter, source_layers=config["text_config"]["num_hidden_layers"],
            source_bytes=sum(path.stat().st_size for path in source.glob("*.safetensors")), verify=verify,
            peak_anonymous_bytes=sampler.peak - before, seconds=round(seconds, 2),
            max_abs_diff=report.get("max_abs_diff"),
        ))  # fmt: skip
    return results


def measure_in_child(converter: str, sources: Sequence[Path], verify: bool, timeout: float | None = None
                     ) -> list[Measurement]:  # fmt: skip
    """`measure_here` in a fresh interpreter (one for all the sources, which it converts in turn)."""
    command = [sys.executable, "-m", "moezoo.bench.conversion", "--child", converter, *map(str, sources)]
    if not verify:
        command.append("--no-verify")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"converting with {converter} failed:\n{done.stderr[-4000:]}")
    return [Measurement(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def depth_growth(shallow: Measurement, deep: Measurement) -> float:
    """How much the peak grew from the shallow source to the deep one, as a share of what the added layers weigh."""
    return (deep.peak_anonymous_bytes - shallow.peak_anonymous_bytes) / (deep.source_bytes - shallow.source_bytes)


# --- `moezoo bench conversion` ----------------------------------------------------------------------------------------


def add_bench_arguments(parser) -> None:
    parser.add_argument("--converters", nargs="+", choices=list(CONVERTERS), default=list(CONVERTERS))
    parser.add_argument("--widths", choices=list(SOURCES), default="qwen3_5_moe",
                        help="qwen3_5_moe: Qwen3.5-35B-A3B's real widths (about 2 GB per layer in bf16); "
                             "qwen3_5_moe-reduced: the same layout at test widths")
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                        help="source depths to convert (the growth is measured between the first and the last)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="convert without the default verification against the source model")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the sources and conversions are written (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="moezoo-bench-conversion-", dir=args.workdir) as workdir:
        sources = [Path(workdir) / f"source-{layers}" for layers in args.layers]
        for folder, layers in zip(sources, args.layers):
            write_synthetic_source(folder, args.widths, layers)
        rows = [row for converter in args.converters for row in measure_in_child(converter, sources, args.verify)]
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    table = []
    for row in rows:
        shallowest = next(other for other in rows if other.converter == row.converter)
        growth = "" if row is shallowest else f"{depth_growth(shallowest, row):.2f}"
        table.append([row.converter, row.source_layers, f"{row.source_bytes / 1e9:.2f} GB",
                      f"{row.peak_anonymous_bytes / 1e9:.2f} GB", f"{row.seconds:.1f} s", row.max_abs_diff, growth])
    print_table(
        f"conversion of synthetic {args.widths} sources (bf16, zeros but the routers)"
        + (", with the default verification" if args.verify else ", --no-verify"),
        ["converter", "layers", "source", "peak anonymous memory", "wall time", "max |Δ|", "growth (share of the "
         "added layers' bytes)"],
        table,
    )
    return 0


def _child(argv: Sequence[str]) -> None:
    """`python -m moezoo.bench.conversion --child CONVERTER SOURCE... [--no-verify]`: `measure_here`, as JSON."""
    verify = "--no-verify" not in argv
    converter, *sources = [arg for arg in argv if arg != "--no-verify"]
    rows = measure_here(converter, [Path(source) for source in sources], verify)
    print(json.dumps([asdict(row) for row in rows]))


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    from ..terminal import quiet_libraries

    with quiet_libraries():
        _child(sys.argv[2:])
