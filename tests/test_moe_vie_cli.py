"""MoE-ViE through the command: `moezoo convert` (official checkpoint, SigLIP2 upcycling), `list`, and export."""

import json
import re

import pytest
import torch
from transformers import Siglip2Config, Siglip2Model

from conftest import run_moezoo_in_this_process, run_python
from moe_vie_reference import make_official_state_dict, official_model_config
from moezoo.cli import main
from moezoo.processors.tiny_tokenizers import build_tiny_clip_tokenizer


# Vision tower with its projection, total / active, as the spec recounts the official releases (moe_vie.md §2.5).
SPEC_VISION_COUNTS = {
    "moe-vie-b16-224": (0.457e9, 0.094e9),
    "moe-vie-l16-384": (1.671e9, 0.318e9),
    "moe-vie-h14-448": (3.499e9, 1.059e9),
}


def test_list_counts_match_the_spec_recount(capfd):
    result = run_moezoo_in_this_process(capfd, "list", "--json")
    assert result.returncode == 0, result.stderr
    presets = {row["name"]: row for row in json.loads(result.stdout)}
    assert "tiny-moe_vie" in presets
    for name, (total, active) in SPEC_VISION_COUNTS.items():
        row = presets[name]
        assert row["paper_counted_modules"] == ["vision_model", "visual_projection"]
        assert abs(row["paper_total_parameters"] - total) / total < 0.005, name
        assert abs(row["paper_active_parameters"] - active) / active < 0.005, name
        assert row["converter"] == "moe-vie-official"
        assert row["base_checkpoints"][0].lower() == f"facebook/{name.replace('moe-vie', 'moevie')}"


@pytest.fixture
def tokenizer_folder(tmp_path):
    build_tiny_clip_tokenizer().save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


@pytest.fixture
def official_folder(tmp_path):
    """A tiny checkpoint in the official release's format, with its model config beside it."""
    source = tmp_path / "official"
    source.mkdir()
    torch.save({"state_dict": make_official_state_dict(seed=3)}, source / "MoEViE-tiny.pt")
    (source / "MoEViE-tiny.json").write_text(json.dumps(official_model_config()))
    return source


def test_convert_an_official_checkpoint_then_export(tmp_path, official_folder, tokenizer_folder, capfd):
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "moe_vie", "--from", official_folder, "--out",
                                        tmp_path / "converted", "--tokenizer", tokenizer_folder)
    assert result.returncode == 0, result.stderr
    provenance = json.loads((tmp_path / "converted" / "moezoo.json").read_text())
    assert provenance["converter"] == "moe-vie-official" and provenance["license"] == "cc-by-nc-4.0"
    assert provenance["key_accounting"]["unexpected"] == []
    exported = run_moezoo_in_this_process(capfd, "export", tmp_path / "converted", "--out", tmp_path / "hub")
    assert exported.returncode == 0, exported.stderr
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "license: cc-by-nc-4.0" in card and "moe-vie-official" in card
    run_python(f"""
        import torch
        from transformers import AutoModel, AutoProcessor
        model = AutoModel.from_pretrained({str(tmp_path / "hub")!r}, trust_remote_code=True)
        processor = AutoProcessor.from_pretrained({str(tmp_path / "hub")!r}, trust_remote_code=True)
        assert processor.image_processor.size["height"] == 16
        inputs = processor(text=["a photo of a cat"], images=[torch.zeros(3, 20, 20, dtype=torch.uint8)],
                           return_tensors="pt")
        print(model(**inputs).logits_per_image.shape)
    """, without_moezoo=True)


@pytest.fixture
def siglip2_folder(tmp_path):
    """A tiny SigLIP2 dual encoder with moezoo's tiny CLIP tokenizer (its vocabulary and special ids)."""
    torch.manual_seed(0)
    config = Siglip2Config(
        text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, projection_size=32, pad_token_id=0,
                         bos_token_id=97, eos_token_id=98),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_channels=3, patch_size=4, num_patches=16),
    )
    source = tmp_path / "siglip2"
    Siglip2Model(config).save_pretrained(source)
    build_tiny_clip_tokenizer().save_pretrained(source)
    return source


def test_upcycle_a_siglip2_folder_exactly(tmp_path, siglip2_folder, capfd):
    result = run_moezoo_in_this_process(capfd, "convert", "--to", "moe_vie", "--from", siglip2_folder, "--out",
                                        tmp_path / "upcycled", "--num-experts", "8", "--granularity", "4",
                                        "--top-k", "3")
    assert result.returncode == 0, result.stderr
    provenance = json.loads((tmp_path / "upcycled" / "moezoo.json").read_text())
    assert provenance["converter"] == "moe-vie-upcycle" and provenance["max_abs_diff"] <= 1e-5
    assert provenance["upcycling"]["n_routed_experts"] == 7
    processor_config = json.loads((tmp_path / "upcycled" / "processor_config.json").read_text())
    assert processor_config["image_processor"]["resize_mode"] == "naflex"
    wrong = run_moezoo_in_this_process(capfd, "convert", "--to", "moe_vie", "--from", siglip2_folder, "--out",
                                       tmp_path / "bad", "--top-k", "99")
    assert wrong.returncode == 2 and "top_k" in wrong.stderr and not (tmp_path / "bad").exists()


def test_a_tokenizer_that_is_not_the_models_fails_the_conversion_and_writes_nothing(tmp_path, official_folder):
    """transformers returns an empty tokenizer instead of raising when the files cannot be found (offline, or a
    mistyped --tokenizer); the command must fail instead of saving it next to the model."""
    (tmp_path / "typo").mkdir()  # a folder without tokenizer files; a Hub id that cannot be reached gives the same
    out = tmp_path / "converted"
    assert main(["convert", "--to", "moe_vie", "--from", str(official_folder), "--out", str(out), "--tokenizer",
                 str(tmp_path / "typo")]) == 2
    assert not out.exists()


@pytest.mark.parametrize("profile", ["moe_vie", "siglip"])
def test_model_card_usage_runs_and_pads_texts_to_the_full_length(
    profile, tmp_path, siglip2_folder, tokenizer_folder
):
    """The SigLIP profile (upcycled models) pools the last position: a label padded only to the longest label of
    the call would get an embedding that depends on the other labels."""
    folder, exported = tmp_path / "model", tmp_path / "hub"
    if profile == "moe_vie":
        assert main(["create", "tiny-moe_vie", "--out", str(folder)]) == 0
    else:
        # The CLIP tokenizer by its own folder: beside a SigLIP2 config, AutoTokenizer would read it as Siglip2's.
        assert main(["convert", "--to", "moe_vie", "--from", str(siglip2_folder), "--out", str(folder),
                     "--tokenizer", str(tokenizer_folder), "--num-experts", "8", "--top-k", "3"]) == 0
    assert main(["export", str(folder), "--out", str(exported), "--repo-id", "zoo/model"]) == 0
    usage = re.search(r"```python\n(.*?)```", (exported / "README.md").read_text(), re.DOTALL).group(1)
    namespace = {}
    exec(usage.replace('"zoo/model"', repr(str(exported))), namespace)  # noqa: S102 (the card's own example)
    assert namespace["model"].config.text_config.pooling_type == ("last" if profile == "siglip" else "eos")
    assert namespace["inputs"]["input_ids"].shape == (2, namespace["processor"].tokenizer.model_max_length)
