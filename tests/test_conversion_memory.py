"""Streaming converters hold bounded memory, their default verification included (issue 29 item 1; DESIGN.md, "Real
scale"): converting a 4-layer source takes about the peak anonymous memory a 2-layer one does. Sources are checkpoints
in their releases' layouts (Qwen3.5-MoE's per-expert tensors; Llama, SigLIP, GLM-OCR, Qwen3; bf16, zeros but the
routers) at reduced widths, one layer 15-30 MB; the converters run in child processes that convert both depths
(`moezoo.bench.conversion`)."""

import pytest

from moezoo.bench.conversion import (
    depth_growth,
    measure_in_child,
    measure_several_in_child,
    write_converter_source,
    write_synthetic_source,
)


# What the peak may grow by from 2 to 4 layers, as a share of the two added layers' bytes: 0 for a converter that holds
# one layer at a time; sampling and the allocator make it vary by about 0.2 on a busy machine. Holding every layer once
# is 1 (the SMoES converter's 0.65, the MoEMB one's 1.55 before they streamed).
MAX_GROWTH = 0.4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conversion-memory")
    for layers in (2, 4):
        write_synthetic_source(folder / f"layers-{layers}", "qwen3_5_moe-reduced", layers)
    return [folder / "layers-2", folder / "layers-4"]


# The SMoES converter is held to the bound without its verification: with it, the peak of one and the same source
# varies by about 40 MB from run to run at these widths (135-187 MB measured for the 2-layer one), as much as the two
# added layers weigh, so the test failed a full suite run once without a change; a source wide enough to tell the
# depth from that noise costs more than the suite's budget allows (`moezoo bench conversion` measures it).
@pytest.mark.parametrize(("converter", "verify"), [("moemb", True), ("smoes", False)], ids=["moemb", "smoes"])
def test_the_peak_memory_does_not_grow_with_the_depth(sources, converter, verify):
    shallow, deep = measure_in_child(converter, sources, verify=verify, timeout=600)
    assert deep.source_bytes - shallow.source_bytes > 50e6
    check_depth_growth(shallow, deep, verify)


def check_depth_growth(shallow, deep, verify):
    if verify:  # the verification ran, and found the copy exact
        assert 0 <= shallow.max_abs_diff <= MAX_ABS_DIFF.get(deep.converter, 0.0)
        assert 0 <= deep.max_abs_diff <= MAX_ABS_DIFF.get(deep.converter, 0.0)
    growth = depth_growth(shallow, deep)
    assert growth < MAX_GROWTH, (
        f"{deep.converter}: the peak grew from {shallow.peak_anonymous_bytes / 1e6:.0f} MB (2 layers) to "
        f"{deep.peak_anonymous_bytes / 1e6:.0f} MB (4 layers), {growth:.2f} of the added layers' bytes"
    )


# The converters of other sources, in one child process per verification setting (Python and torch started once).
# MoTE's verification runs in the source's dtype (bf16 here) and holds a few MB. OmniMoE-VL's runs in fp32, whose peak
# varies by up to 100 MB from run to run at these widths (90-225 MB measured for 2-, 4- and 8-layer sources, not growing
# with the depth), more than the two added layers weigh: it is held to the bound without its verification (`moezoo
# bench conversion --converters omnimoe-vl` measures it).
# MoE-ViE's upcycling (SigLIP2 dual encoders, a layer of both towers 12.6 MB) is verified too, not bit-exactly: its
# experts sum each dense MLP in chunks. Before it streamed: 348 MB (2 layers) -> 688 MB (4 layers), growth 13.5.
OTHER_CONVERTERS = {"mote-llama-text": True, "mote-llama": True, "mote-glm-ocr": True, "omnimoe-vl": False,
                    "moe-vie-upcycle": True}
MAX_ABS_DIFF = {"moe-vie-upcycle": 1e-5}  # float reassociation; the others copy exactly


@pytest.fixture(scope="module")
def other_measurements(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other-converters")
    rows = []
    for verify in (True, False):
        jobs = {converter: [folder / f"{converter}-{layers}" for layers in (2, 4)]
                for converter, verified in OTHER_CONVERTERS.items() if verified == verify}  # fmt: skip
        for converter, sources in jobs.items():
            for source, layers in zip(sources, (2, 4)):
                write_converter_source(source, converter, "reduced", layers)
        rows += measure_several_in_child(jobs, verify=verify, timeout=600)
    return rows


@pytest.mark.parametrize("converter", list(OTHER_CONVERTERS))
def test_the_peak_memory_of_the_other_converters_does_not_grow_with_the_depth(other_measurements, converter):
    shallow, deep = [row for row in other_measurements if row.converter == converter]
    assert deep.source_bytes - shallow.source_bytes > 25e6
    check_depth_growth(shallow, deep, OTHER_CONVERTERS[converter])
