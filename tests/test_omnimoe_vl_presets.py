"""OmniMoE-VL's presets and their parameter counts (spec omnimoe_vl.md §4.3, §9.15): the tiny preset against the
closed-form count of its config, the paper's configuration on the meta device against the spec's numbers, and the
reconciliation of the paper's "28B total / 9B active" that `moezoo list` prints."""

import json

import pytest
import torch

from moezoo.cli import main
from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig, OmniMoeVlVisionConfig
from moezoo.modeling.moe.accounting import count_parameters
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration, OmniMoeVlVisionModel
from moezoo.presets.omnimoe_vl import MID_OMNIMOE_VL, PAPER_OMNIMOE_VL
from moezoo.registry import get_preset


def on_meta(config) -> OmniMoeVlForConditionalGeneration:
    with torch.device("meta"):
        return OmniMoeVlForConditionalGeneration(config)


def closed_form_counts(config: OmniMoeVlConfig) -> tuple[int, int]:
    """(total, active) from the config alone: the module shapes of spec §2 written out (active: top-k of E experts)."""
    vision, text = config.vision_config, config.text_config
    d_v, i_v, d, i_t = vision.hidden_size, vision.intermediate_size, text.hidden_size, text.moe_intermediate_size
    # Vision: patch embedding, positions; per block two LayerNorms, four biased projections, then a biased GELU MLP
    # or E biased GELU experts with a bias-free router.
    vision_total = d_v * 3 * vision.patch_size**2 + d_v + vision.num_patches * d_v
    vision_active = vision_total
    for layer in range(vision.num_hidden_layers):
        common = 2 * 2 * d_v + 4 * (d_v * d_v + d_v)
        expert = 2 * d_v * i_v + i_v + d_v
        routed = layer in vision.moe_layers
        vision_total += common + (vision.num_experts * expert + vision.num_experts * d_v if routed else expert)
        vision_active += common + (vision.num_experts_per_tok * expert + vision.num_experts * d_v if routed else expert)
    # Language: embeddings, final norm, lm_head (unless tied to the embeddings); per layer q/k/v/o, q/k norms, two
    # RMSNorms, SwiGLU MLP or experts with a bias-free router.
    heads, kv_heads, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    text_total = (1 if config.tie_word_embeddings else 2) * text.vocab_size * d + d
    text_active = text_total
    for layer in range(text.num_hidden_layers):
        common = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 2 * head_dim + 2 * d
        if text.is_moe_layer(layer):
            text_total += common + text.num_experts * 3 * d * i_t + text.num_experts * d
            text_active += common + text.num_experts_per_tok * 3 * d * i_t + text.num_experts * d
        else:
            text_total += common + 3 * d * text.intermediate_size
            text_active += common + 3 * d * text.intermediate_size
    # Projector: per stream LN + Linear(d_V, d) + Linear(d, d), a cross-attention (4 bias-free d x d_a) and a score MLP;
    # the query synthesis, fusion norm and scale; the injection's banks, adapters, gains and two attentions + norms.
    streams, attn, score = config.num_streams, config.projector_attn_dim, config.depth_score_hidden
    q, r = config.num_query_prototypes, config.num_router_queries
    cross_attention = 4 * d * attn
    per_stream = 2 * d_v + d_v * d + d + d * d + d + cross_attention + d * score + 2 * score + 1
    queries = d + q * d + q + r * q + 2 * d + cross_attention + 2 * d + d + d * d
    rank, adapter = config.injection_rank, config.adapter_rank
    injection = rank * d + streams * rank * d + 2 * len(config.injection_layers) * adapter * d
    injection += 3 * len(config.injection_layers) + 2 * (cross_attention + 2 * d)
    projector = streams * per_stream + queries + 2 * d + 1 + injection
    return vision_total + text_total + projector, vision_active + text_active + projector


@pytest.mark.parametrize("config", [TINY_OMNIMOE_VL, PAPER_OMNIMOE_VL, MID_OMNIMOE_VL], ids=["tiny", "paper", "mid"])
def test_counts_equal_the_closed_form_of_the_config(config):
    config = OmniMoeVlConfig(**config)
    counts = count_parameters(on_meta(config))
    assert (counts.total, counts.active) == closed_form_counts(config)


def matches_billions(count: int, printed: float) -> bool:
    """Whether `count` is the spec's `printed` number of billions, to its last printed digit (the spec rounds some
    numbers and truncates others: SigLIP2-g's 1.1356B is printed 1.135)."""
    digits = len(str(printed).partition(".")[2])
    return abs(count / 1e9 - printed) <= 10**-digits


def test_paper_configuration_counts_equal_the_spec_numbers():
    """Spec §4.3's table, measured on the meta device (no weights)."""
    # The config's defaults describe the same model (the preset adds Qwen3's bos / eos ids for generation).
    paper, defaults = OmniMoeVlConfig(**PAPER_OMNIMOE_VL).to_dict(), OmniMoeVlConfig().to_dict()
    for config in (paper, defaults):
        config["text_config"].pop("bos_token_id"), config["text_config"].pop("eos_token_id")
    assert paper == defaults
    model = on_meta(OmniMoeVlConfig(**PAPER_OMNIMOE_VL))
    language = [count_parameters(model.get_submodule(name)) for name in ("model.language_model", "lm_head")]
    text = model.config.text_config
    upcycled_total, active = sum(c.total for c in language), sum(c.active for c in language)
    added_experts = len(range(0, 36, 2)) * ((text.num_experts - 1) * 3 * 4096 * 12288 + text.num_experts * 4096)
    embeddings = 2 * text.vocab_size * text.hidden_size
    assert matches_billions(upcycled_total - added_experts, 8.191)  # Qwen3-8B dense
    assert matches_billions(upcycled_total, 27.217)
    assert matches_billions(active, 10.909)
    assert matches_billions(active - embeddings, 9.665)
    vision = count_parameters(model.model.vision_tower)
    assert matches_billions(vision.total - vision.active, 2.511)  # top-1: the active tower is the dense one
    assert matches_billions(count_parameters(model.model.projector).total, 0.51)

    # The whole SigLIP2-g tower (40 blocks, experts on its 20 even blocks): the spec's "literal" reading.
    full_tower = OmniMoeVlVisionConfig(**{**PAPER_OMNIMOE_VL["vision_config"], "num_hidden_layers": 40,
                                          "moe_layers": list(range(0, 40, 2))})
    with torch.device("meta"):
        full = count_parameters(OmniMoeVlVisionModel(full_tower))
    assert matches_billions(full.active, 1.135) and matches_billions(full.total - full.active, 2.643)
    projector = count_parameters(model.model.projector).total
    assert matches_billions(upcycled_total + full.total + projector, 31.5)
    assert matches_billions(active + full.active + projector, 12.6)
    # As built (truncated to the last tap, spec D23): the counts `moezoo list` shows.
    whole = count_parameters(model)
    assert whole.total == upcycled_total + vision.total + projector
    assert whole.active == active + vision.active + projector


def test_moezoo_list_prints_the_reconciliation_of_the_paper_claim(capsys):
    assert main(["list", "--json"]) == 0
    presets = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    paper = presets["omnimoe-vl-qwen3-8b"]
    assert (paper["claimed_total_parameters"], paper["claimed_active_parameters"]) == (28_000_000_000, 9_000_000_000)
    parts = {part["part"]: part for part in paper["claim_parts"]}
    assert matches_billions(parts["language model without embeddings"]["active"], 9.665)
    assert matches_billions(parts["language model + lm_head"]["total"], 27.217)
    assert paper["base_checkpoints"] == ["Qwen/Qwen3-8B", "google/siglip2-giant-opt-patch16-384"]
    assert paper["converter"] == "omnimoe_vl-upcycle"
    assert presets["omnimoe-vl-qwen3-1.7b"]["claimed_total_parameters"] is None
    assert presets["tiny-omnimoe_vl"]["claim_parts"] == []

    assert main(["list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("omnimoe-vl-qwen3-8b:"))
    assert "the paper states 28B total / 9B active (§5.2, Table 2); counted here 31.3B / 12.5B" in line
    assert "language model without embeddings 26B / 9.66B" in line


def test_presets_name_their_base_checkpoints_and_converter():
    mid = get_preset("omnimoe-vl-qwen3-1.7b")
    assert mid.converter == "omnimoe_vl-upcycle" and mid.base_checkpoints[0] == "Qwen/Qwen3-1.7B"
    config = OmniMoeVlConfig(**mid.config)
    # The taps the description tells `moezoo convert` to use, within the 25 blocks kept of the 27-block tower.
    assert config.vision_feature_layers == [1, 4, 7, 10, 13, 16, 19, 22, 25]
    assert config.vision_config.num_hidden_layers == 25 and config.injection_layers == list(range(9))
    assert "--vision-feature-layers 1,4,7,10,13,16,19,22,25" in mid.description
