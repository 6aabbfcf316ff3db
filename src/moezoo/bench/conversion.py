"""`moezoo bench conversion`: the peak memory and wall time of the streaming converters on synthetic sources at the
papers' real widths, a few layers deep (issue 29 item 1; DESIGN.md, "Real scale").

A source is written as its release is on the Hub (`SOURCES`: Qwen3.5-MoE, Llama, GLM-OCR, Qwen3, SigLIP 2 vision
towers): transformers' own class, built on the meta device, gives every tensor's name and shape,
`revert_weight_conversion` the checkpoint layout (Qwen3.5-MoE's per-expert 2D tensors), and the tensors are written in
bf16, one layer at a time, into shards; they are zeros but the routers (random, so that tokens spread over the experts
as they would). A converter that reads two checkpoints (a language model and a vision tower) finds the second in a
subfolder of the first (`CONVERTERS`).

Each converter runs in a child process (a fresh interpreter, so the parent's memory does not count) that converts the
sources one after the other, after an unmeasured conversion of the first (so that what is imported or cached on the
first call is not counted as the first source's), and reports per source the peak of its anonymous resident memory
(`RssAnon`, sampled every few milliseconds: the pages of the memory-mapped safetensors files are the page cache's,
shared and reclaimable, not the conversion's) above what it held before, and the wall time. The growth of that peak
from a shallow to a deeper source, as a share of what the added layers weigh, is what "does not grow with the depth"
means: near 0."""

from __future__ import annotations

import argparse
import copy
import ctypes
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers.core_model_loading import revert_weight_conversion

from ..configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB
from ..configuration.mote import GLM_OCR, LLAMA_3_2_1B_INSTRUCT, SIGLIP2_LARGE_PATCH16_384_VISION
from ..conversion.streaming import ShardWriter
from ..terminal import print_table


@dataclass(frozen=True)
class SourceKind:
    """A family of source checkpoints: transformers' class that gives every tensor's name and shape, the config fields
    that hold its depth (dotted paths into config.json), and the tensors written random rather than zeros (routers,
    so that tokens spread over the experts as they would)."""

    model_class: str  # a class of `transformers`
    depth_fields: tuple[str, ...] = ("num_hidden_layers",)
    random_tensors: tuple[str, ...] = ()  # key suffixes


@dataclass(frozen=True)
class SyntheticSource:
    """One source checkpoint: its kind (a key of `SOURCE_KINDS`), the config fields at its widths, and the size of the
    shards written from it (at test widths smaller than a layer, since a conversion holds one)."""

    kind: str
    fields: dict
    shard_size: str


# Qwen3-8B and SigLIP2-g-opt/16-384 (OmniMoE-VL's sources; spec omnimoe_vl.md, "Base models").
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
SIGLIP2_GIANT_PATCH16_384_VISION = dict(
    hidden_size=1536, intermediate_size=6144, num_hidden_layers=40, num_attention_heads=16, image_size=384,
    patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
)
_SIGLIP2_BASE_TOWER = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12)
SIGLIP2_BASE_PATCH16_NAFLEX = dict(
    text_config=_SIGLIP2_BASE_TOWER | dict(vocab_size=256000, max_position_embeddings=64, projection_size=768),
    vision_config=_SIGLIP2_BASE_TOWER | dict(num_patches=256, patch_size=16),
)
_REDUCED_TOWER = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, projection_size=512)
SOURCE_KINDS = {
    "qwen3_5_moe": SourceKind("Qwen3_5MoeForConditionalGeneration", ("text_config.num_hidden_layers",),
                              random_tensors=("mlp.gate.weight",)),
    "llama": SourceKind("LlamaForCausalLM"),
    "glm_ocr": SourceKind("GlmOcrForConditionalGeneration", ("text_config.num_hidden_layers", "vision_config.depth")),
    "qwen3": SourceKind("Qwen3ForCausalLM"),
    "siglip_vision": SourceKind("SiglipVisionModel"),
    # every weight random: a tower of zeros embeds every input as the zero vector, which SigLIP normalises into NaN
    "siglip2": SourceKind("Siglip2Model", ("text_config.num_hidden_layers", "vision_config.num_hidden_layers"),
                          random_tensors=("weight", "probe")),
}  # fmt: skip

# The real widths are the releases' (config.json on the Hub; the specs quote them); "-reduced" keeps a layout at widths
# a test affords, one decoder layer 15-30 MB in bf16. The output shards are smaller than the two layers a deeper source
# adds: a conversion holds the shard it fills, so a larger one would hide the growth the bench looks for. Every other
# Qwen3.5 layer uses full attention, so that two layers already hold both kinds of its layers.
_A3B = MOEMB_CONFIGS["MoEMB-A3B"]  # Qwen3.5-35B-A3B: hidden 2048, 256 experts of 512, vocabulary 248320
_REDUCED_DECODER = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096)
_REDUCED_VISION = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, image_size=64, patch_size=16)
SOURCES = {
    "qwen3_5_moe": SyntheticSource("qwen3_5_moe", dict(
        text_config=dict(_A3B["text_config"], full_attention_interval=2), vision_config=_A3B["vision_config"],
    ), "1GB"),
    "qwen3_5_moe-reduced": SyntheticSource("qwen3_5_moe", dict(
        text_config=dict(
            TINY_MOEMB["text_config"], hidden_size=512, num_experts=64, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, vocab_size=4096, full_attention_interval=2,
        ),
        vision_config=dict(TINY_MOEMB["vision_config"], out_hidden_size=512),
        image_token_id=4000, video_token_id=4001, vision_start_token_id=4002, vision_end_token_id=4003,
    ), "8MB"),
    # MoTE (spec mote.md §2.7, §4.3): VideoLLM-MoTE's Llama-3.2-1B-Instruct and SigLIP 2 ViT-L/16-384, the
    # Llama-3-8B of the split ablation (Table 9), GLM-OCR.
    "llama3_2_1b": SyntheticSource("llama", LLAMA_3_2_1B_INSTRUCT, "100MB"),
    "llama3_2_1b-reduced": SyntheticSource("llama", LLAMA_3_2_1B_INSTRUCT | _REDUCED_DECODER | dict(
        intermediate_size=4096, bos_token_id=1, eos_token_id=2,
    ), "8MB"),
    "llama3_8b": SyntheticSource("llama", LLAMA_3_2_1B_INSTRUCT | dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128, max_position_embeddings=8192,
        tie_word_embeddings=False, eos_token_id=128001, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    ), "400MB"),
    "siglip2_large": SyntheticSource("siglip_vision", SIGLIP2_LARGE_PATCH16_384_VISION, "1GB"),
    "siglip2_large-reduced": SyntheticSource("siglip_vision", SIGLIP2_LARGE_PATCH16_384_VISION | _REDUCED_VISION,
                                             "8MB"),
    "glm_ocr": SyntheticSource("glm_ocr", GLM_OCR, "100MB"),
    "glm_ocr-reduced": SyntheticSource("glm_ocr", GLM_OCR | dict(
        text_config=GLM_OCR["text_config"] | _REDUCED_DECODER | dict(
            intermediate_size=4096, pad_token_id=0, eos_token_id=[1, 2],
            rope_parameters=GLM_OCR["text_config"]["rope_parameters"] | {"mrope_section": [8, 12, 12]},
        ),
        vision_config=GLM_OCR["vision_config"] | dict(
            hidden_size=256, num_heads=4, intermediate_size=1024, out_hidden_size=512, image_size=56,
        ),
        image_token_id=4000, video_token_id=4001, image_start_token_id=4002, image_end_token_id=4003,
        video_start_token_id=4004, video_end_token_id=4005,
    ), "8MB"),
    # OmniMoE-VL (spec omnimoe_vl.md): Qwen3-8B and SigLIP2-Giant (fixed resolution, 384 px, patch 16).
    "qwen3_8b": SyntheticSource("qwen3", QWEN3_8B, "400MB"),
    "qwen3_8b-reduced": SyntheticSource("qwen3", QWEN3_8B | _REDUCED_DECODER | dict(intermediate_size=2048), "8MB"),
    "siglip2_giant": SyntheticSource("siglip_vision", SIGLIP2_GIANT_PATCH16_384_VISION, "1GB"),
    "siglip2_giant-reduced": SyntheticSource("siglip_vision", SIGLIP2_GIANT_PATCH16_384_VISION | _REDUCED_VISION,
                                             "8MB"),
    # MoE-ViE upcycling (spec moe_vie.md §6.2): a SigLIP2 NaFlex dual encoder at MoE-ViE-B/16's widths (ViT-B: 768
    # wide, MLPs of 3072, 12 heads; google/siglip2-base-patch16-naflex).
    "siglip2_base": SyntheticSource("siglip2", SIGLIP2_BASE_PATCH16_NAFLEX, "1GB"),
    "siglip2_base-reduced": SyntheticSource("siglip2", dict(
        text_config=SIGLIP2_BASE_PATCH16_NAFLEX["text_config"] | _REDUCED_TOWER | dict(vocab_size=4096),
        vision_config=SIGLIP2_BASE_PATCH16_NAFLEX["vision_config"] | _REDUCED_TOWER | dict(num_patches=16),
    ), "8MB"),
}  # fmt: skip
DEFAULT_LAYERS = (2, 4)
SAMPLE_SECONDS = 0.002
# The child's glibc serves every allocation from this size up with its own mapping, unmapped when freed. By default
# the threshold rises (up to 32 MB) with the sizes freed, and a verification that runs a model layer by layer at test
# widths (weights of 1-16 MB, loaded and dropped per layer) then leaves each layer's freed weights on the heap, resident
# until trimmed: the peak grew with the depth (MoE-ViE's upcycling, 2 -> 6 layers: 0.14 -> 0.26 GB) though the
# memory in use did not (0.10 GB at every depth with this threshold).
MMAP_THRESHOLD = 1 << 20
SOURCE_FILE = "moezoo_bench_source.json"  # beside a synthetic source's config.json: what it was written from


# --- the synthetic source -------------------------------------------------------------------------------------------


def write_synthetic_source(folder: Path, widths: str, num_layers: int, seed: int = 0) -> int:
    """A checkpoint folder (config.json, bf16 safetensors shards and their index) of `SOURCES[widths]` with
    `num_layers` layers in each of its stacks; returns the bytes of its tensors."""
    source = SOURCES[widths]
    kind = SOURCE_KINDS[source.kind]
    model_class = getattr(transformers, kind.model_class)
    fields = copy.deepcopy(source.fields)
    for path in kind.depth_fields:
        *parents, name = path.split(".")
        stack = functools.reduce(dict.__getitem__, parents, fields)
        stack[name] = num_layers
        stack.pop("layer_types", None)  # a per-layer list of another depth: the config derives it again
    config = model_class.config_class(**fields)
    with torch.device("meta"):
        model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(folder, _bytes(source.shard_size), torch.bfloat16)
    shapes = {key: tensor.shape for key, tensor in model.state_dict().items()}
    for keys in _by_layer(list(shapes)):
        tensors = {}
        for key in keys:
            random = key.endswith(kind.random_tensors)
            tensors[key] = (torch.randn(shapes[key], generator=generator) * 0.02 if random else (
                torch.zeros(shapes[key]))).to(torch.bfloat16)
        for key, tensor in revert_weight_conversion(model, tensors).items():
            writer.add(key, tensor)
    writer.finish()
    config.dtype = torch.bfloat16
    config.architectures = [model_class.__name__]
    config.save_pretrained(folder)
    (folder / SOURCE_FILE).write_text(json.dumps({"widths": widths, "num_layers": num_layers}))
    return writer.total_size


def _by_layer(keys: list[str]) -> list[list[str]]:
    """The state-dict keys in groups: one per layer or block of each stack, and one of the rest."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        layer = _LAYER.match(key)
        groups.setdefault(layer[0] if layer else "", []).append(key)
    return list(groups.values())


_LAYER = re.compile(r".*?\.(?:layers|blocks)\.\d+\.")


def _bytes(size: str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


def source_record(folder: Path) -> dict:
    """What `write_synthetic_source` wrote `folder` from: `{"widths": ..., "num_layers": ...}`."""
    return json.loads((folder / SOURCE_FILE).read_text())


# --- the converters, as the bench runs them ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConverter:
    """How the bench runs a converter: `run(source folder, verify)` returns its report; `sources` names, by width
    ("real" or "reduced"), the `SOURCES` it converts: the first is written at the source folder, the others (a
    vision tower) into its subfolders named by `companions`."""

    run: Callable[[Path, bool], dict]
    sources: dict[str, str]
    companions: dict[str, dict[str, str]] = field(default_factory=dict)  # subfolder -> sources by width


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


def _mote_llama(source: Path, verify: bool) -> dict:
    from ..conversion.mote_llama import convert

    vision = source / VISION_FOLDER
    # no tokenizer: the <v> placeholder is a row of the source's own vocabulary
    placeholders = dict(vision=vision, video_token_id=_vocab_size(source) - 1, frame_token_interval_id=11)
    return convert(source, verify=verify, max_shard_size=_shard_size(source),
                   **(placeholders if vision.is_dir() else {})).provenance


def _mote_glm_ocr(source: Path, verify: bool) -> dict:
    from ..conversion.mote_glm_ocr import convert

    return convert(source, verify=verify, max_shard_size=_shard_size(source)).provenance


def _omnimoe_vl(source: Path, verify: bool) -> dict:
    from ..conversion.omnimoe_vl_upcycle import convert

    # two streams, from the first two blocks (which every depth has) instead of the paper's taps 1, 5, ..., 37, and
    # the projector's top-k within them; no tokenizer: the vision tokens are rows of the source's own vocabulary
    vocab_size = _vocab_size(source)
    return convert(source, vision=source / VISION_FOLDER, verify=verify, vision_feature_layers=[1, 2],
                   projector={"depth_top_k": 2, "fusion_top_k": 2}, image_token_id=vocab_size - 3,
                   vision_start_token_id=vocab_size - 2, vision_end_token_id=vocab_size - 1,
                   max_shard_size=_shard_size(source)).provenance


def _moe_vie_upcycle(source: Path, verify: bool) -> dict:
    from ..conversion.moe_vie_upcycle import upcycle_siglip_folder
    from ..conversion.streaming import StreamedModel
    from ..modeling.moe_vie import MoeVieModel

    # the converter of `moezoo convert --to moe_vie` without the processor (the synthetic source has no tokenizer)
    model = StreamedModel(MoeVieModel, "moezoo-bench-moe-vie-")
    return upcycle_siglip_folder(source, model.folder, verify=verify, max_shard_size=_shard_size(source))


def _vocab_size(source: Path) -> int:
    return transformers.AutoConfig.from_pretrained(source).get_text_config().vocab_size


def _shard_size(source: Path) -> str:
    """The output shards of a source's widths (what `write_synthetic_source` wrote it from)."""
    return SOURCES[source_record(source)["widths"]].shard_size


VISION_FOLDER = "vision"
_QWEN3_5_MOE = {"real": "qwen3_5_moe", "reduced": "qwen3_5_moe-reduced"}
_LLAMA = {"real": "llama3_2_1b", "reduced": "llama3_2_1b-reduced"}
CONVERTERS: dict[str, BenchConverter] = {
    "moemb": BenchConverter(_moemb("native"), _QWEN3_5_MOE),
    "smoes": BenchConverter(_smoes, _QWEN3_5_MOE),
    "mote-llama": BenchConverter(_mote_llama, _LLAMA, {
        VISION_FOLDER: {"real": "siglip2_large", "reduced": "siglip2_large-reduced"},
    }),
    "mote-llama-text": BenchConverter(_mote_llama, _LLAMA),
    "mote-glm-ocr": BenchConverter(_mote_glm_ocr, {"real": "glm_ocr", "reduced": "glm_ocr-reduced"}),
    "omnimoe-vl": BenchConverter(_omnimoe_vl, {"real": "qwen3_8b", "reduced": "qwen3_8b-reduced"}, {
        VISION_FOLDER: {"real": "siglip2_giant", "reduced": "siglip2_giant-reduced"},
    }),
    "moe-vie-upcycle": BenchConverter(_moe_vie_upcycle, {"real": "siglip2_base", "reduced": "siglip2_base-reduced"}),
}  # fmt: skip


def write_converter_source(folder: Path, converter: str, widths: str, num_layers: int) -> int:
    """The sources `converter` reads at `widths` ("real" or "reduced"), each `num_layers` deep: the first at `folder`,
    the others in its subfolders; returns the bytes of all their tensors."""
    bench = CONVERTERS[converter]
    total = write_synthetic_source(folder, bench.sources[widths], num_layers)
    for subfolder, sources in bench.companions.items():
        total += write_synthetic_source(folder / subfolder, sources[widths], num_layers)
    return total


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
    """Free what the last conversion left in reference cycles (a loaded model, its hooks) and hand the allocator's freed
    pages back to the system, so that one conversion's leftovers do not raise the next one's starting point (and,
    freed during it, lower its peak) (glibc keeps small freed blocks)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def measure_here(converter: str, sources: Sequence[Path], verify: bool) -> list[Measurement]:
    """Convert each source in this process, the first once unmeasured before, and report each."""
    run = CONVERTERS[converter].run
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
        results.append(Measurement(
            converter=converter, source_layers=source_record(source)["num_layers"],
            source_bytes=sum(path.stat().st_size for path in source.rglob("*.safetensors")), verify=verify,
            peak_anonymous_bytes=sampler.peak - before, seconds=round(seconds, 2),
            max_abs_diff=report.get("max_abs_diff"),
        ))  # fmt: skip
    return results


def measure_in_child(converter: str, sources: Sequence[Path], verify: bool, timeout: float | None = None
                     ) -> list[Measurement]:  # fmt: skip
    """`measure_here` in a fresh interpreter (one for all the sources, which it converts in turn)."""
    return measure_several_in_child({converter: sources}, verify, timeout)


def measure_several_in_child(jobs: dict[str, Sequence[Path]], verify: bool, timeout: float | None = None
                             ) -> list[Measurement]:  # fmt: skip
    """`measure_here` for each converter of `jobs` (converter -> its sources) in turn, all in one fresh interpreter,
    which pays for starting Python and importing torch once."""
    command = [sys.executable, "-m", "moezoo.bench.conversion", "--child",
               json.dumps({converter: list(map(str, sources)) for converter, sources in jobs.items()})]  # fmt: skip
    if not verify:
        command.append("--no-verify")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    if done.returncode != 0:
        raise RuntimeError(f"converting with {', '.join(jobs)} failed:\n{done.stderr[-4000:]}")
    return [Measurement(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def depth_growth(shallow: Measurement, deep: Measurement) -> float:
    """How much the peak grew from the shallow source to the deep one, as a share of what the added layers weigh."""
    return (deep.peak_anonymous_bytes - shallow.peak_anonymous_bytes) / (deep.source_bytes - shallow.source_bytes)


# --- `moezoo bench conversion` ----------------------------------------------------------------------------------------


def add_bench_arguments(parser) -> None:
    parser.add_argument("--converters", nargs="+", choices=list(CONVERTERS), default=list(CONVERTERS))
    parser.add_argument("--widths", choices=("real", "reduced"), default="real",
                        help="real: the released checkpoints' widths (Qwen3.5-35B-A3B's layers weigh about 2 GB in "
                             "bf16); reduced: the same layouts at test widths")
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                        help="source depths to convert (the growth is measured between the first and the last)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="convert without the default verification against the source model")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the sources and conversions are written (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")


def run_bench(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="moezoo-bench-conversion-", dir=args.workdir) as workdir:
        for converter in args.converters:
            sources = [Path(workdir) / f"{converter}-{layers}" for layers in args.layers]
            for folder, layers in zip(sources, args.layers):
                write_converter_source(folder, converter, args.widths, layers)
            rows += measure_in_child(converter, sources, args.verify)
            for folder in sources:
                shutil.rmtree(folder)
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
        f"conversion of synthetic sources at {args.widths} widths (bf16, zeros but the routers)"
        + (", with the default verification" if args.verify else ", --no-verify"),
        ["converter", "layers", "source", "peak anonymous memory", "wall time", "max |Δ|", "growth (share of the "
         "added layers' bytes)"],
        table,
    )
    return 0


def _child(argv: Sequence[str]) -> None:
    """`python -m moezoo.bench.conversion --child '{"CONVERTER": [SOURCE, ...], ...}' [--no-verify]`: `measure_here`
    for each converter, as JSON."""
    verify = "--no-verify" not in argv
    [jobs] = [arg for arg in argv if arg != "--no-verify"]
    rows = [row for converter, sources in json.loads(jobs).items()
            for row in measure_here(converter, [Path(source) for source in sources], verify)]  # fmt: skip
    print(json.dumps([asdict(row) for row in rows]))


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    from ..terminal import quiet_libraries

    with quiet_libraries():
        _child(sys.argv[2:])
