"""The SMoES demo stage in quick mode: both models trained, their MSI and all-to-all bytes finite, the heatmap
written. Measured on seeds 0-2 at the quick step count: mean MSI 0.26-0.39 (top-k) against 0.79-0.90 (SMoES), and the
dedup EP sends about 72% fewer bytes than stock EP without SMoES against about 47% for top-k routing."""

import math

import pytest

from moezoo.demos import smoes


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("smoes_demo")
    return out_dir, smoes.run(out_dir, quick=True)


def test_the_stage_writes_the_heatmap_and_finite_figures(demo):
    out_dir, result = demo
    assert result["heatmap"] == out_dir / "routing_by_modality.png" and result["heatmap"].is_file()
    for name in ("top-k", "SMoES"):
        figures = result[name]
        assert len(figures["msi_per_layer"]) == 4
        assert all(0.0 <= value <= 1.0 for value in (*figures["msi_per_layer"], figures["msi"])), figures
        assert all(math.isfinite(value) and value > 0 for value in (figures["bytes_stock_ep"], figures["bytes_dedup_ep"]))


def test_smoes_specialises_by_modality_and_the_dedup_ep_sends_less(demo):
    _, result = demo
    top_k, smoes_figures = result["top-k"], result["SMoES"]
    assert smoes_figures["msi"] > top_k["msi"], result
    # the dedup EP never sends more than stock EP; with SMoES' bin-aligned experts it sends less still
    assert top_k["bytes_dedup_ep"] < top_k["bytes_stock_ep"]
    assert smoes_figures["bytes_dedup_ep"] < top_k["bytes_dedup_ep"], result
