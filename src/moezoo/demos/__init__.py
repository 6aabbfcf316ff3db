"""`moezoo demo`: one stage per part of the zoo, each building its own tiny models and synthetic data."""

from __future__ import annotations

from pathlib import Path

from ..terminal import console
from . import moe_core, moe_vie, moemb, mote, omnimoe_vl, smoes


# (folder name, title, stage module); each stage has `run(out_dir, quick) -> dict`.
STAGES = [
    ("moe_core", "the shared sparse-MoE core", moe_core),
    ("moe_vie", "MoE-ViE, a MoE vision encoder trained from scratch", moe_vie),
    ("moemb", "MoEMB, a universal multimodal embedder converted from Qwen3.5-MoE", moemb),
    ("mote", "MoTE: task experts on synthetic procedure videos", mote),
    ("omnimoe_vl", "OmniMoE-VL: a prompt-conditioned route over visual depths", omnimoe_vl),
    ("smoes", "SMoES: experts grouped by modality, fewer bytes for expert parallelism", smoes),
]


def run_demo(out: str | Path, quick: bool = False) -> dict[str, dict]:
    out = Path(out)
    if out.exists() and not out.is_dir():  # found before the first stage, not when it writes
        raise FileExistsError(f"{out} is a file, not a folder; choose another --out")
    results = {}
    for number, (name, title, stage) in enumerate(STAGES, start=1):
        console.rule(f"[bold]stage {number}/{len(STAGES)}: {title}")
        results[name] = stage.run(out / name, quick=quick)
    console.rule("[bold]done")
    console.print(f"everything the demo wrote is under {out}/")
    return results
