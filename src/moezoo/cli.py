"""The `moezoo` command."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from . import __version__
from .terminal import error_console


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as error:
        if args.debug:
            raise
        error_console.print(f"[bold red]error:[/] {error}")
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moezoo",
        description="A Hugging Face Hub-compatible zoo of multimodal Mixture-of-Experts models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moezoo {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of errors")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_bench(commands)
    _add_demo(commands)
    return parser


def _command(commands, name: str, help: str, examples: str) -> argparse.ArgumentParser:
    return commands.add_parser(
        name,
        help=help,
        description=help,
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_bench(commands) -> None:
    bench = _command(
        commands,
        "bench",
        "measure moezoo's implementations against transformers' own, in one run",
        """
        moezoo bench moe-layer
        moezoo bench moe-layer --tokens 64 2048 --mode fwd --json
        """,
    )
    targets = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    moe_layer = _command(
        targets,
        "moe-layer",
        "one sparse-MoE experts layer: eager, grouped_mm, batched_mm and moezoo on identical weights",
        """
        moezoo bench moe-layer
        moezoo bench moe-layer --tokens 512 --experts 8 --top-k 2 --hidden 256 --expert-width 512
        """,
    )
    moe_layer.add_argument("--tokens", type=int, nargs="+", default=[64, 2048, 8192])
    moe_layer.add_argument("--experts", type=int, default=64)
    moe_layer.add_argument("--top-k", type=int, default=8)
    moe_layer.add_argument("--hidden", type=int, default=512)
    moe_layer.add_argument("--expert-width", type=int, default=256)
    moe_layer.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    moe_layer.add_argument("--impl", nargs="+", default=None, help="implementations to time (default: all)")
    moe_layer.add_argument("--mode", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"])
    moe_layer.add_argument("--seconds-per-case", type=float, default=6.0, help="time budget per (tokens, mode)")
    moe_layer.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    moe_layer.set_defaults(run=_run_bench_moe_layer)


def _run_bench_moe_layer(args) -> int:
    import torch

    from .bench.moe_layer import DEFAULT_IMPLEMENTATIONS, print_moe_layer_table, rows_as_dicts, run_moe_layer_bench
    from .terminal import progress_bar

    with progress_bar(transient=True) as progress:
        task = progress.add_task("moe-layer", total=len(args.tokens) * len(args.mode))

        rows, peak = run_moe_layer_bench(
            tokens=args.tokens,
            num_experts=args.experts,
            top_k=args.top_k,
            hidden=args.hidden,
            expert_width=args.expert_width,
            dtype=getattr(torch, args.dtype),
            implementations=args.impl or DEFAULT_IMPLEMENTATIONS,
            modes=args.mode,
            seconds_per_case=args.seconds_per_case,
            on_case_done=lambda case: progress.update(task, advance=1, description=case),
        )
    if args.json:
        print(json.dumps(rows_as_dicts(rows), indent=2))
        return 0
    print_moe_layer_table(
        rows,
        peak,
        f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width {args.expert_width}, "
        f"{args.dtype}",
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
