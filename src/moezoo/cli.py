"""The `moezoo` command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap

from rich.markup import escape
from safetensors import SafetensorError

from . import __version__
from .bench.timing import add_device_arguments, add_threads_argument, apply_threads, describe_device
from .terminal import VERBOSE_VARIABLE, error_console, quiet_libraries


# What a user can fix (a wrong argument, path or file, no network, a missing package): one error line, no traceback.
# OSError covers missing, taken and unreadable paths and an unreachable Hub (moezoo.hub.sources.HubUnreachableError).
USER_ERRORS = (ValueError, KeyError, OSError, ImportError, SafetensorError)
# Exit status of a command stopped by Ctrl-C or a kill (SIGTERM), as shells report a SIGINT: 128 + 2.
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `convert` passes the options it does not know to the chosen converter's own parser, and module subcommands
    # (`train ARCH`, `eval ARCH`, `bench moemb`, ...) to the module's parser.
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "options"):
        args.options = extra + args.options
    elif extra and getattr(args, "run", None) is not _run_convert:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.converter_args = extra
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("MOEZOO_DEBUG", "") not in ("", "0")
    # A kill stops a command as Ctrl-C does (Python's default would end the process at once): output folders being
    # written are removed and an interrupted training run says how to resume (moezoo.hub.folders, training.arguments).
    previous_handler = signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.verbose:
        os.environ[VERBOSE_VARIABLE] = "1"
    try:
        with quiet_libraries():  # commands show their own progress; the libraries' only with --verbose
            return args.run(args) or 0
    except KeyboardInterrupt:
        if debug:
            raise
        error_console.print("interrupted")
        return INTERRUPTED
    except USER_ERRORS as error:
        if debug:
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        if isinstance(error, SafetensorError):  # raised by the reader, which does not name the file
            message = f"a safetensors file is corrupt or incomplete ({message}): download or save it again"
        # Escaped: rich would take a "[name]" in the message for markup (and drop it, or fail on "[/path]"). Not
        # wrapped by rich (at 80 columns when stderr is piped): paths in the message stay whole for copy-paste.
        error_console.print(f"[bold red]error:[/] {escape(str(message))}", soft_wrap=True)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moezoo",
        description="A Hugging Face Hub-compatible zoo of multimodal Mixture-of-Experts models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moezoo {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of errors (as does the environment variable MOEZOO_DEBUG=1)")
    parser.add_argument("--verbose", action="store_true",
                        help="also show the progress bars, logging and warnings of transformers, datasets, "
                             "huggingface_hub and DeepSpeed, hidden by default (as does MOEZOO_VERBOSE=1)")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_list(commands)
    _add_create(commands)
    _add_convert(commands)
    _add_export(commands)
    _add_push(commands)
    _add_train(commands)
    _add_eval(commands)
    _add_bench(commands)
    _add_demo(commands)
    return parser


def _command(commands, name: str, help: str, examples: str, **options) -> argparse.ArgumentParser:
    return commands.add_parser(
        name,
        help=help,
        description=help,
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **options,
    )


def _print_help(parser: argparse.ArgumentParser) -> int:
    """What a command that needs a subcommand does without one: its own help (not the top level's), exit code 2."""
    parser.print_help()
    return 2


def _add_list(commands) -> None:
    parser = _command(
        commands,
        "list",
        "the presets: every architecture and size by name, with parameter counts computed on the meta device",
        """
        moezoo list
        moezoo list --json
        moezoo list --memory
        """,
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of presets")
    parser.add_argument("--memory", action="store_true",
                        help="also the size of each preset's model on disk (and to load) in every dtype, counted "
                             "on the meta device")
    parser.set_defaults(run=_run_list)


def _run_list(args) -> int:
    from .terminal import print_table
    from .conversion.cost import human_bytes
    from .zoo import human_count, list_presets

    summaries = list_presets(memory=args.memory)
    if args.json:
        print(json.dumps([summary.as_dict() for summary in summaries], indent=2))
        return 0
    if args.memory:
        dtypes = list(summaries[0].size_bytes) if summaries else []
        print_table(
            "moezoo presets: size on disk (and to load) by dtype",
            ["name", "architecture", "total params", *dtypes],
            [[s.name, s.architecture, human_count(s.total_parameters), *map(human_bytes, s.size_bytes.values())]
             for s in summaries],
        )
        return 0
    print_table(
        "moezoo presets",
        ["name", "architecture", "total params", "active params", "as the paper counts", "base checkpoint",
         "converter"],
        [
            [s.name, s.architecture, human_count(s.total_parameters), human_count(s.active_parameters),
             f"{' + '.join(s.paper_counted_modules)}: {human_count(s.paper_total_parameters)} / "
             f"{human_count(s.paper_active_parameters)}" if s.paper_counted_modules else "-",
             ", ".join(s.base_checkpoints) or "-", s.converter or "-"]
            for s in summaries
        ],
    )
    for reconciliation in filter(None, (s.claim_reconciliation() for s in summaries)):
        print(reconciliation)
    return 0


def _add_create(commands) -> None:
    parser = _command(
        commands,
        "create",
        "write a randomly initialised model of a preset and its processor (the start of from-scratch training)",
        """
        moezoo create tiny-moe_vie --out tiny-moe-vie
        moezoo create tiny-moe_vie --out tiny-moe-vie --seed 3 --overwrite
        """,
    )
    parser.add_argument("preset")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=_run_create)


def _run_create(args) -> int:
    from .terminal import console
    from .zoo import create_from_preset

    out = create_from_preset(args.preset, args.out, seed=args.seed, overwrite=args.overwrite)
    console.print(f"wrote {args.preset} (seed {args.seed}) to {out}", markup=False)
    return 0


def _add_convert(commands) -> None:
    # Each converter has its own options, parsed once the converter is known: argparse's --help would stop at the
    # options above, so --help is handled by _run_convert, which adds the options of the converters into --to.
    parser = _command(
        commands,
        "convert",
        "convert a source checkpoint (local folder or file, or a Hub repo id) into a moezoo architecture",
        """
        moezoo convert --list
        moezoo convert --to moe_vie --help          # with the options of every converter into moe_vie
        moezoo convert --to moe_vie --from facebook/MoEViE-B16-224 --out moe-vie-b16
        moezoo convert --to moe_vie --from ./siglip2-base --out upcycled --num-experts 32 --top-k 3
        moezoo convert --to mote --from zai-org/GLM-OCR --out glm-ocr-mote --experts ocr,kie:"read receipts"
        moezoo convert --to moemb --from Qwen/Qwen3.5-35B-A3B --out moemb-a3b --dtype bfloat16 --dry-run
        """,
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help message and exit; with --to, also the options of its converters")
    parser.add_argument("--list", action="store_true", help="show the converters and what they take")
    parser.add_argument("--to", dest="architecture", help="the architecture (or family: mote) to convert into")
    parser.add_argument("--from", dest="source", help="a local folder or file, or a Hub repo id")
    parser.add_argument("--out")
    parser.add_argument("--variant", help="the design to convert into, for architectures that have several")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--dry-run", action="store_true",
                        help="say what the conversion will cost (parameters, size on disk, peak memory) from the "
                             "sources' configs and headers, without reading a weight or writing anything")
    parser.set_defaults(run=_run_convert, convert_parser=parser)


def _converter_options_parser(converter, architecture: str) -> argparse.ArgumentParser:
    """The parser of a converter's own options (what follows `--to ARCH --from SRC --out DIR`)."""
    from .registry import resolve

    parser = argparse.ArgumentParser(
        prog=f"moezoo convert --to {architecture} ({converter.name})",
        description=f"{converter.description} (takes: {', '.join(converter.sources)})",
    )
    if converter.add_arguments:
        resolve(converter.add_arguments)(parser)
    return parser


def _run_convert(args) -> int:
    from pathlib import Path

    from .conversion.common import find_converter, local_source, source_headers, write_conversion
    from .conversion.cost import check_disk_space, conversion_cost
    from .hub.folders import atomic_output_dir
    from .registry import CONVERTERS, architectures_named, resolve
    from .terminal import console, print_table

    if args.help:
        args.convert_parser.print_help()
        if args.architecture:
            members = {member.name for member in architectures_named(args.architecture)}
            for converter in CONVERTERS.values():
                if converter.architecture in members:
                    print()
                    _converter_options_parser(converter, args.architecture).print_help()
        return 0
    if args.list:
        print_table(
            "moezoo converters",
            ["name", "into", "takes", "variants", "description"],
            [[c.name, c.architecture, ", ".join(c.sources), ", ".join(c.variants) or "-", c.description]
             for c in CONVERTERS.values()],
        )
        return 0
    required = (("--to", args.architecture), ("--from", args.source)) + (() if args.dry_run else (("--out", args.out),))
    missing = [flag for flag, value in required if not value]
    if missing:
        raise ValueError(f"convert needs {', '.join(missing)} (or --list)")
    if args.dry_run:
        with source_headers(args.source) as source:  # a Hub repo's configs and headers, not its weights
            _, converter, options = _chosen_converter(args, source)
            cost = conversion_cost(converter, source, options)
        if cost is None:
            raise ValueError(f"{converter.name} cannot say what it will cost: it has no plan function (Converter.plan)")
        _print_cost(cost, args.out)
        return 0
    targets = [architecture.name for architecture in architectures_named(args.architecture)]
    # The output folder is claimed first, so that a taken --out fails before a download and a conversion that can
    # take hours, not after them.
    with atomic_output_dir(args.out, overwrite=args.overwrite) as staging:
        source = local_source(args.source)
        kind, converter, options = _chosen_converter(args, source)
        cost = conversion_cost(converter, source, options)
        if cost is not None:
            check_disk_space(staging, cost.disk_bytes)
        with console.status(escape(f"converting {args.source} with {converter.name}")):
            result = resolve(converter.function)(source, **options)
        produced = result.model.config.model_type
        if produced not in targets:
            raise ValueError(
                f"{converter.name} produced a {produced} model from these options, not "
                f"{args.architecture}; see `moezoo convert --to {args.architecture} --help`"
            )
        # A family target (`--to mote`) records the member's own converter, the one `--to <member>` would name.
        converter = find_converter(produced, kind, args.variant)
        write_conversion(result, converter, staging)
    print_table(
        f"converted into {produced}",
        ["source", "converter", "max |Δ| vs source", "output"],
        [[str(args.source), converter.name, result.provenance.get("max_abs_diff"), str(Path(args.out))]],
    )
    return 0


def _chosen_converter(args, source: Path):
    """The kind of the local `source`, the converter that takes it and the converter's parsed options."""
    from .conversion.common import find_converter, source_kind

    kind = source_kind(source)
    converter = find_converter(args.architecture, kind, args.variant)
    options = vars(_converter_options_parser(converter, args.architecture).parse_args(args.converter_args))
    if args.variant:
        options["variant"] = args.variant
    return kind, converter, options


def _print_cost(cost, out: str | None) -> None:
    """The cost of a conversion as a table, with how the peak memory is estimated and, given --out, the space there."""
    from .conversion.cost import free_disk_space, human_bytes
    from .terminal import console, print_table
    from .zoo import human_count

    row = [cost.converter, cost.architecture, human_count(cost.parameters), str(cost.dtype).removeprefix("torch."),
           human_bytes(cost.disk_bytes), human_bytes(cost.peak_memory_bytes)]
    columns = ["converter", "into", "parameters", "dtype", "on disk", "peak memory"]
    if out:
        folder, free = free_disk_space(out)
        columns.append(f"free at {folder}")
        row.append(f"{human_bytes(free)} ({'enough' if free >= cost.disk_bytes else 'NOT enough'})")
    print_table("what the conversion will cost (no weight read)", columns, [row])
    console.print(
        f"peak memory = 2 x the largest source tensor ({cost.largest_source_tensor}, "
        f"{human_bytes(cost.largest_source_tensor_bytes)}) + one output shard ({human_bytes(cost.output_shard_bytes)}),"
        " as the conversion streams tensor by tensor; Python and torch add a few hundred MB",
        markup=False,
    )


def _add_export(commands) -> None:
    parser = _command(
        commands,
        "export",
        "write a flat folder that loads with trust_remote_code=True and can be pushed as is",
        """
        moezoo export tiny-moe-vie --out tiny-moe-vie-hub
        moezoo export trained/ --out hub/ --repo-id my-org/my-moe-vie --max-shard-size 2GB
        """,
    )
    parser.add_argument("source", help="a model folder (from create, convert, train or save_pretrained)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--repo-id", help="the Hub id the model card's usage example loads (default: the folder name)")
    parser.add_argument("--max-shard-size", type=_shard_size, default="5GB", help="e.g. 5GB, 500MB or bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=_run_export)


def _shard_size(text: str) -> int | str:
    """A shard size checked while parsing: the export would reject a bad one only after loading the model."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write it like 5GB, 500MB, 100KB or in bytes")
    return int(text) if text.isdigit() else text


def _run_export(args) -> int:
    from .hub.export import export_folder
    from .terminal import console

    with console.status(escape(f"exporting {args.source}")):
        out = export_folder(args.source, args.out, repo_id=args.repo_id, overwrite=args.overwrite,
                            max_shard_size=args.max_shard_size)
    console.print(f"exported {args.source} to {out}: load it with AutoModel.from_pretrained(..., trust_remote_code=True)",
                  markup=False)
    return 0


def _add_push(commands) -> None:
    parser = _command(
        commands,
        "push",
        "upload an exported folder to the Hub (uses HF_ENDPOINT and HF_TOKEN)",
        """
        moezoo push tiny-moe-vie-hub my-org/tiny-moe-vie
        moezoo push hub/ my-org/my-moe-vie --private --revision experiments
        """,
    )
    parser.add_argument("folder")
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", help="a branch to push to (created if needed)")
    parser.set_defaults(run=_run_push)


def _run_push(args) -> int:
    from .hub.push import push_folder
    from .terminal import console

    with console.status(escape(f"pushing {args.folder} to {args.repo_id}")):
        url = push_folder(args.folder, args.repo_id, private=args.private, revision=args.revision)
    console.print(f"pushed: {url}", markup=False)
    return 0


# `moezoo train <arch>` and `moezoo eval <arch>`: each architecture's module brings its own options and runner, and
# is imported only when its command runs (training code pulls in Trainer, PEFT and datasets).
TRAINERS = {"moe_vie": "moezoo.training.moe_vie", "moemb": "moezoo.training.moemb", "mote": "moezoo.training.mote",
            "omnimoe_vl": "moezoo.training.omnimoe_vl", "smoes": "moezoo.training.smoes"}
EVALUATORS = {"moe_vie": "moezoo.evaluation.moe_vie", "moemb": "moezoo.evaluation.moemb",
              "omnimoe_vl": "moezoo.evaluation.omnimoe_vl"}


def _add_architecture_command(commands, name, help, examples, modules, add_arguments, run, runner=None) -> None:
    parser = _command(commands, name, help, examples)
    parser.add_argument("architecture", choices=sorted(modules))
    parser.add_argument("options", nargs=argparse.REMAINDER, help=f"see `moezoo {name} ARCH --help`")
    parser.set_defaults(
        run=lambda args: _run_module_command(f"{name} {args.architecture}", modules[args.architecture],
                                             add_arguments, run, args.options, runner)
    )


def _add_module_subcommand(subcommands, name, help, module, add_arguments, run, prog) -> None:
    """A subcommand whose options live in `module`, imported only when the subcommand runs."""
    parser = subcommands.add_parser(name, help=help, description=help, add_help=False)
    parser.add_argument("options", nargs=argparse.REMAINDER, help=f"see `moezoo {prog} --help`")
    parser.set_defaults(run=lambda args: _run_module_command(prog, module, add_arguments, run, args.options))


def _run_module_command(prog, module_name, add_arguments, run, options, runner=None) -> int:
    """Runs `module.run(args)`, `args` parsed by argparse from the options `module.add_arguments(parser)` declares,
    or `runner(parser, options, module.run)` when the command runs in its own way."""
    import importlib

    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"moezoo {prog}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    getattr(module, add_arguments)(parser)
    if runner is not None:
        return runner(parser, options, getattr(module, run))
    return getattr(module, run)(parser.parse_args(options))


def _run_train(parser, options, run) -> int:
    """
    A train command: its options, with its `--config FILE`; then, with `--push_to_hub`, the Hub checked before the
    recipe loads anything, and its trained folder exported and pushed once written (on the main process of a
    distributed launch). Imported here: training code pulls in the Trainer.
    """
    from .training.arguments import parse_train_arguments
    from .training.distributed import world
    from .training.push import push_trained_folder, take_push_options
    from .terminal import console

    args = parse_train_arguments(parser, options)
    push = take_push_options(parser, args)
    status = run(args)
    if push is not None and status == 0 and world()[0] == 0:
        with console.status(escape(f"exporting {args.out} and pushing it to {push.repo_id}")):
            url = push_trained_folder(args.out, push)
        console.print(f"pushed: {url}", markup=False)
    return status


def _add_train(commands) -> None:
    _add_architecture_command(
        commands,
        "train",
        "train a model of the zoo with transformers' Trainer (curves and routing heatmaps written as PNG files)",
        """
        moezoo train moe_vie --model tiny-moe-vie --data captions.jsonl --out trained --steps 500
        moezoo train moe_vie --model trained --data clips.jsonl --out video --video --num-frames 8
        moezoo train moemb --model tiny-moemb --data pairs.jsonl --out trained --config run.yaml --bf16
        """,
        TRAINERS, "add_train_arguments", "run_train", _run_train,
    )


def _add_eval(commands) -> None:
    _add_architecture_command(
        commands,
        "eval",
        "evaluate a model of the zoo with its benchmarks' protocols",
        """
        moezoo eval moe_vie --model trained --data imagenet-val/ --task zero-shot
        moezoo eval moe_vie --model trained --data captions.jsonl --task retrieval --json
        """,
        EVALUATORS, "add_eval_arguments", "run_eval",
    )


def _add_bench(commands) -> None:
    bench = _command(
        commands,
        "bench",
        "measure moezoo's implementations against transformers' own, in one run",
        """
        moezoo bench moe-layer
        moezoo bench moe-layer --tokens 64 2048 --mode fwd --json
        moezoo bench moe-vie
        moezoo bench moemb --inputs text image+text
        moezoo bench mote --experts 1 2 4 8 16
        moezoo bench gpu-check --out gpu_check_output
        """,
    )
    bench.set_defaults(run=lambda args: _print_help(bench))  # `moezoo bench` without a benchmark
    targets = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for name, help in (
        ("moemb", "embeddings per second: MoEMB against transformers' Qwen3.5-MoE forward on the same weights"),
        ("mote", "per-sample latency and active parameters of MoTE as the number of stored experts grows"),
        ("omnimoe_vl", "generation tokens/s and prefill latency of OmniMoE-VL against a dense MLP projector"),
        ("smoes", "bytes expert parallelism sends: stock and dedup all-to-all, with and without SMoES' bins"),
        ("conversion", "peak memory and wall time of the streaming converters on synthetic sources at real widths"),
        ("gpu-check", "the GPU tests and benchmarks in one run of under 8 minutes, reported as JSON and Markdown"),
    ):
        _add_module_subcommand(targets, name, help, f"moezoo.bench.{name.replace('-', '_')}", "add_bench_arguments",
                               "run_bench", f"bench {name}")
    moe_layer = _command(
        targets,
        "moe-layer",
        "one sparse-MoE experts layer: eager, grouped_mm, batched_mm and moezoo on identical weights",
        """
        moezoo bench moe-layer
        moezoo bench moe-layer --tokens 512 --experts 8 --top-k 2 --hidden 256 --expert-width 512
        moezoo bench moe-layer --device cuda --dtype bfloat16 --mode fwd
        """,
    )
    moe_layer.add_argument("--tokens", type=int, nargs="+", default=[64, 2048, 8192])
    moe_layer.add_argument("--experts", type=int, default=64)
    moe_layer.add_argument("--top-k", type=int, default=8)
    moe_layer.add_argument("--hidden", type=int, default=512)
    moe_layer.add_argument("--expert-width", type=int, default=256)
    add_device_arguments(moe_layer)
    moe_layer.add_argument("--mode", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"])
    moe_layer.add_argument("--seconds-per-case", type=float, default=6.0, help="time budget per (tokens, mode)")
    add_threads_argument(moe_layer)
    moe_layer.add_argument("--json", action="store_true",
                           help="print the case, the matmul peak, the rows and the targets with their verdicts as JSON")
    moe_layer.set_defaults(run=_run_bench_moe_layer)
    moe_vie = _command(
        targets,
        "moe-vie",
        "vision-tower images per second: MoE-ViE with every experts implementation against a dense tower of the same "
        "active parameters and transformers' SigLIP2 of the same width and depth",
        """
        moezoo bench moe-vie
        moezoo bench moe-vie --batch-size 16 --impl grouped_mm moezoo --json
        moezoo bench moe-vie --size b16 --batch-size 4 --seconds-per-case 60
        moezoo bench moe-vie --size h14 --device cuda --dtype bfloat16 --batch-size 16 32 64 128
        """,
    )
    moe_vie.add_argument(
        "--size", default="cpu",
        help="cpu (width 384, 6 layers, 196 tokens: B/16's proportions), b16, l16, h14 (the official MoE-ViE vision "
        "towers, heavy on a CPU) or tiny (for tests)",
    )
    moe_vie.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    moe_vie.add_argument("--image-size", type=int, default=None, help="square resolution (default: the size's)")
    moe_vie.add_argument("--layers", type=int, default=None, help="depth (default: the size's); MoE in all but block 0")
    add_device_arguments(moe_vie)
    moe_vie.add_argument("--seconds-per-case", type=float, default=20.0, help="time budget per batch size")
    add_threads_argument(moe_vie)
    moe_vie.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    moe_vie.set_defaults(run=_run_bench_moe_vie)


def _run_bench_moe_layer(args) -> int:
    import torch

    from .bench.moe_layer import (
        check_targets,
        default_implementations,
        print_moe_layer_table,
        print_target_checks,
        rows_as_dicts,
        run_moe_layer_bench,
    )
    from .terminal import progress_bar

    apply_threads(args)
    case = {"num_experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "expert_width": args.expert_width,
            "dtype": getattr(torch, args.dtype), "device": args.device}
    with progress_bar(transient=True) as progress:
        task = progress.add_task("moe-layer", total=len(args.tokens) * len(args.mode))

        rows, peak = run_moe_layer_bench(
            tokens=args.tokens,
            implementations=args.impl or default_implementations(args.device),
            modes=args.mode,
            seconds_per_case=args.seconds_per_case,
            on_case_done=lambda case: progress.update(task, advance=1, description=case),
            **case,
        )
    checks = check_targets(rows, **case)
    if args.json:
        print(json.dumps({
            "case": {**case, "dtype": args.dtype}, "matmul_peak_gflops": peak, "rows": rows_as_dicts(rows),
            "targets": [check.as_dict() for check in checks],
        }, indent=2))  # fmt: skip
        return 0
    print_moe_layer_table(
        rows,
        peak,
        f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width {args.expert_width}, "
        f"{args.dtype}, {args.device}",
        device=args.device,
    )
    print_target_checks(checks)
    return 0


def _run_bench_moe_vie(args) -> int:
    import torch

    from .bench.moe_layer import default_implementations, rows_as_dicts
    from .bench.moe_vie import moe_vie_bench_config, print_moe_vie_table, run_moe_vie_bench
    from .terminal import progress_bar

    config = moe_vie_bench_config(args.size, image_size=args.image_size, num_layers=args.layers)
    apply_threads(args)
    with progress_bar(transient=True) as progress:
        task = progress.add_task("moe-vie", total=len(args.batch_size))
        rows = run_moe_vie_bench(
            config,
            batch_sizes=args.batch_size,
            implementations=args.impl or default_implementations(args.device),
            seconds_per_case=args.seconds_per_case,
            on_case_done=lambda case: progress.update(task, advance=1, description=case),
            device=args.device,
            dtype=getattr(torch, args.dtype),
        )
    if args.json:
        print(json.dumps(rows_as_dicts(rows), indent=2))
        return 0
    grid = config.image_size // config.patch_size
    print_moe_vie_table(
        rows,
        f"Vision towers ({args.size}): width {config.hidden_size}, {config.num_hidden_layers} layers "
        f"({len(config.moe_layers)} MoE: {config.n_shared_experts} shared + top-{config.num_experts_per_tok} of "
        f"{config.n_routed_experts} experts of width {config.moe_intermediate_size}), {config.num_attention_heads} "
        f"heads, {grid}x{grid} = {grid * grid} tokens per image; {args.dtype}, sdpa, "
        + describe_device(args.device),
    )
    return 0


def _add_demo(commands) -> None:
    demo = _command(
        commands,
        "demo",
        "the zoo at work on this machine: each stage builds its own tiny models and synthetic data",
        """
        moezoo demo
        moezoo demo --out demo_output --quick
        """,
    )
    demo.add_argument("--out", default="demo_output", help="folder for the PNG files and models the demo writes")
    demo.add_argument("--quick", action="store_true", help="shorter training and a smaller benchmark")
    demo.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from .demos import run_demo

    run_demo(args.out, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
