"""Static expert pruning of MoEMB (spec moemb.md §3.11, §5.6, §10 D-22): the five saliency scores against a hand
computation, the slicing of routers and experts, the survivors' outputs, the calibration data, and the command."""

import copy
import json
import math

import pytest
import torch
from PIL import Image
from transformers import AutoModel, PretrainedConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from moezoo.cli import main
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.conversion.moemb_expert_pruning import (
    ExpertPruning,
    ExpertSaliency,
    calibrate,
    calibration_inputs,
    keep_experts,
    kept_experts,
    moe_blocks,
)
from moezoo.conversion.moemb_qwen3_5 import convert
from moezoo.hub.folders import read_provenance
from moezoo.modeling.moe.block import SparseMoeBlock
from moezoo.modeling.moe.spec import MoeLayerSpec
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.build_moemb import make_moemb_processor, tiny_tokenizer_for


def make_model(seed=0, **overrides) -> MoEmbForEmbedding:
    torch.manual_seed(seed)
    model = MoEmbForEmbedding(MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | overrides))).eval()
    with torch.no_grad():  # decisive routers (the initial std of 0.02 routes almost uniformly)
        for block in moe_blocks(model):
            block.gate.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def processor():
    return make_moemb_processor(MoEmbConfig(**copy.deepcopy(TINY_MOEMB)))


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """MMEB training rows: two captioning rows (image query, text target) and two text-to-text rows."""
    folder = tmp_path_factory.mktemp("calibration")
    for colour in ("red", "blue"):
        Image.new("RGB", (32, 32), colour).save(folder / f"{colour}.png")
    rows = [
        {"qry": "<|image_1|> Find a caption.", "qry_image_path": "red.png", "pos_text": "a red square",
         "pos_image_path": ""},
        {"qry": "<|image_1|> Find a caption.", "qry_image_path": "blue.png", "pos_text": "a blue square",
         "pos_image_path": ""},
        {"qry": "what colour is the sky", "qry_image_path": "", "pos_text": "blue", "pos_image_path": ""},
    ]  # fmt: skip
    path = folder / "calibration.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text_only = folder / "text_only.jsonl"
    text_only.write_text(json.dumps(rows[2]) + "\n")
    return path, text_only


def words(count, generator):
    return torch.randint(1, 120, (count,), generator=generator)


# --- saliency scores --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_saliency_scores_match_a_hand_computation():
    """Two tokens, three SwiGLU experts, top-2: every score written out from its definition (spec §3.11)."""
    spec = MoeLayerSpec(hidden_size=2, num_experts=3, num_experts_per_tok=2, expert_intermediate_size=1)
    config = PretrainedConfig()
    config._experts_implementation = "eager"
    block = SparseMoeBlock(config, spec, layer_idx=0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        block.experts.gate_up_proj.copy_(torch.tensor([[[1.0, 0.0], [0.0, 1.0]],
                                                       [[0.5, 0.5], [1.0, -1.0]],
                                                       [[1.0, 1.0], [1.0, 1.0]]]))  # fmt: skip
        block.experts.down_proj.copy_(torch.tensor([[[1.0], [2.0]], [[-1.0], [1.0]], [[3.0], [0.0]]]))
    x = torch.tensor([[2.0, 1.0], [0.5, 1.5]])

    # logits z = W x: token 0 (2, 1, -3), token 1 (0.5, 1.5, -2); both select experts 0 and 1, expert 2 never.
    logits = torch.tensor([[2.0, 1.0, -3.0], [0.5, 1.5, -2.0]])
    p = torch.softmax(logits.double(), dim=-1)
    alpha = p[:, :2] / p[:, :2].sum(-1, keepdim=True)  # renormalised top-2 weights of experts 0 and 1

    def ffn(expert, token):  # down_j (silu(g_j . x) * (u_j . x))
        gate, up = block.experts.gate_up_proj[expert].double() @ x[token].double()
        return block.experts.down_proj[expert, :, 0].double() * (torch.nn.functional.silu(gate) * up)

    norms = torch.tensor([[ffn(j, t).norm() for j in range(2)] for t in range(2)], dtype=torch.float64)
    expected = {
        "freq": torch.tensor([1.0, 1.0, 0.0]),
        "prob": p.mean(0),
        "man": torch.cat([norms.mean(0), torch.zeros(1)]),
        "msan": torch.cat([norms.square().mean(0), torch.zeros(1)]),
        "reap": torch.cat([(alpha * norms).mean(0), torch.zeros(1)]),
    }
    saliency = ExpertSaliency.zeros(3)
    saliency.add(block, x[:1])  # sums accumulate over batches
    saliency.add(block, x[1:])
    assert saliency.num_tokens == 2
    for method, scores in expected.items():
        torch.testing.assert_close(saliency.scores(method), scores.double(), rtol=1e-6, atol=1e-7, msg=method)
    with pytest.raises(ValueError, match="--prune-experts"):
        saliency.scores("entropy")


def test_ties_go_to_the_lower_expert_id():
    saliency = ExpertSaliency.zeros(4)
    saliency.num_tokens = 1
    saliency.selections = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    assert kept_experts([saliency], "freq", 3) == [[0, 1, 3]]


# --- slicing and exactness ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def text_batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.stack([torch.cat([words(11, generator), torch.tensor([124])]) for _ in range(3)])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


@torch.no_grad()
def test_keeping_every_expert_is_exact(model, text_batch):
    pruned = copy.deepcopy(model)
    keep_experts(pruned, [list(range(8))] * 8)
    assert torch.equal(pruned(**text_batch).embeddings, model(**text_batch).embeddings)
    assert pruned.config.kept_expert_ids == [list(range(8))] * 8 and pruned.config.pruned_from_num_experts == 8


@torch.no_grad()
def test_tokens_whose_experts_all_survive_keep_their_moe_output(model):
    """At the MoE block: same experts, same weights, a routed output bit-identical given those weights, and the block
    output equal to the last bits of the router's softmax; tokens that lost an expert change."""
    kept_ids = [0, 2, 3, 5, 6, 7]
    pruned = copy.deepcopy(model)
    keep_experts(pruned, [kept_ids] * 8)
    block, pruned_block = moe_blocks(model)[1], moe_blocks(pruned)[1]
    tokens = torch.randn(400, 64, generator=torch.Generator().manual_seed(2))
    logits, weights, index = block.gate(tokens)
    pruned_logits, pruned_weights, pruned_index = pruned_block.gate(tokens)
    kept = torch.tensor(kept_ids)
    survivors = torch.isin(index, kept).all(-1)
    assert 0 < int(survivors.sum()) < len(tokens)
    assert torch.equal(kept[pruned_index[survivors]], index[survivors])
    torch.testing.assert_close(pruned_weights[survivors], weights[survivors], rtol=0, atol=1e-6)
    assert torch.equal(
        pruned_block.experts(tokens[survivors], pruned_index[survivors], weights[survivors]),
        block.experts(tokens[survivors], index[survivors], weights[survivors]),
    )
    output, _ = block(tokens)
    pruned_output, _ = pruned_block(tokens)
    torch.testing.assert_close(pruned_output[survivors], output[survivors], rtol=0, atol=1e-6)
    assert (pruned_output[~survivors] - output[~survivors]).abs().max() > 1e-3


@torch.no_grad()
def test_embeddings_are_kept_when_no_token_selects_a_pruned_expert(text_batch):
    """A router whose logit bias rules experts 1 and 4 out for every token: pruning them changes no selection, and
    the bias (indexed by expert) is sliced with the weights."""
    model = make_model(router_bias=True)
    for block in moe_blocks(model):
        block.gate.bias[[1, 4]] = -1e4
    pruned = copy.deepcopy(model)
    keep_experts(pruned, [[0, 2, 3, 5, 6, 7]] * 8)
    assert moe_blocks(pruned)[0].gate.bias.shape == (6,)
    torch.testing.assert_close(pruned(**text_batch).embeddings, model(**text_batch).embeddings, rtol=0, atol=1e-6)


def test_pruning_a_pruned_model_keeps_the_original_ids(tmp_path):
    model = make_model()
    keep_experts(model, [[0, 2, 3, 5, 6, 7]] * 8)
    keep_experts(model, [[0, 1, 3, 5]] * 8)
    assert model.config.kept_expert_ids == [[0, 2, 5, 7]] * 8
    assert model.config.pruned_from_num_experts == 8 and model.config.text_config.num_experts == 4
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert moe_blocks(reloaded)[3].experts.gate_up_proj.shape == (4, 64, 64)
    assert torch.equal(moe_blocks(reloaded)[3].experts.down_proj, moe_blocks(model)[3].experts.down_proj)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kept_expert_ids": [[0, 1, 2, 3]] * 8}, "set both or neither"),
        ({"kept_expert_ids": [[0, 1, 2, 3]] * 7, "pruned_from_num_experts": 8}, "one list of expert ids per layer"),
        ({"kept_expert_ids": [[0, 1, 2, 9]] * 8, "pruned_from_num_experts": 8}, r"kept_expert_ids\[0\]"),
        ({"kept_expert_ids": [[3, 1, 2, 0]] * 8, "pruned_from_num_experts": 8}, "distinct ascending"),
        ({"kept_expert_ids": [[0, 1, 2, 3]] * 8, "pruned_from_num_experts": 2}, "pruned_from_num_experts=2"),
        ({"kept_expert_ids": [[0, 1, 2]] * 8, "pruned_from_num_experts": 8, "num_experts": 3},
         r"num_experts_per_tok=4 exceeds the text_config.num_experts=3 experts kept by expert pruning"),
    ],
)
def test_invalid_pruning_fields_name_the_field(overrides, message):
    overrides = dict(overrides)
    text_config = copy.deepcopy(TINY_MOEMB["text_config"]) | {"num_experts": overrides.pop("num_experts", 4)}
    with pytest.raises(ValueError, match=message):
        MoEmbConfig(**(copy.deepcopy(TINY_MOEMB) | {"text_config": text_config} | overrides))


@pytest.mark.parametrize("keep", [3, 9])
def test_keep_outside_top_k_and_the_expert_count_names_the_option(model, processor, calibration_file, keep):
    pruning = ExpertPruning("reap", keep, calibration_file[0])
    with pytest.raises(ValueError, match=rf"--keep {keep} \(keep={keep}\).*num_experts_per_tok=4.*num_experts=8"):
        pruning.apply(copy.deepcopy(model), processor)


# --- calibration --------------------------------------------------------------------------------------------------


def test_calibration_inputs_are_balanced_over_text_and_image(calibration_file):
    inputs = calibration_inputs(calibration_file[0], num_samples=4)
    assert [bool(item.get("images")) for item in inputs] == [False, False, True, True]
    assert [item["text"] for item in inputs[:2]] == ["a red square", "a blue square"]  # file order


def test_calibration_data_with_one_modality_is_refused(calibration_file):
    with pytest.raises(ValueError, match=r"only 0 image input.*--calibration-modalities text,image"):
        calibration_inputs(calibration_file[1], num_samples=2)
    with pytest.raises(ValueError, match="--calibration-samples 16"):
        calibration_inputs(calibration_file[0])  # 3 text and 2 image inputs
    assert len(calibration_inputs(calibration_file[1], num_samples=2, modalities=("text",))) == 2


def test_calibration_counts_every_real_token_of_every_layer(model, processor, calibration_file):
    inputs = calibration_inputs(calibration_file[0], num_samples=4)
    saliency = calibrate(model, processor, inputs, batch_size=3)
    real_tokens = int(processor(inputs)["attention_mask"].sum())
    assert [layer.num_tokens for layer in saliency] == [real_tokens] * 8
    for layer in saliency:
        assert layer.selections.sum() == real_tokens * 4  # top-4
        torch.testing.assert_close(layer.scores("prob").sum().item(), 1.0)


# --- the command --------------------------------------------------------------------------------------------------


def test_convert_prunes_a_moemb_folder(tmp_path, calibration_file):
    source = tmp_path / "tiny"
    model, processor = make_model(), make_moemb_processor(MoEmbConfig(**copy.deepcopy(TINY_MOEMB)))
    model.save_pretrained(source)
    processor.save_pretrained(source)
    out = tmp_path / "pruned"
    main(["convert", "--to", "moemb", "--from", str(source), "--out", str(out), "--prune-experts", "reap",
          "--keep", "5", "--calibration", str(calibration_file[0]), "--calibration-samples", "4"])  # fmt: skip
    pruned = AutoModel.from_pretrained(out)
    config = pruned.config
    assert config.text_config.num_experts == 5 and config.pruned_from_num_experts == 8
    assert len(config.kept_expert_ids) == 8 and all(len(ids) == 5 for ids in config.kept_expert_ids)
    first = config.kept_expert_ids[0]
    assert torch.equal(moe_blocks(pruned)[0].gate.weight, moe_blocks(model)[0].gate.weight[first])
    provenance = read_provenance(out)
    assert provenance["converter"] == "moemb-prune-experts"
    assert provenance["expert_pruning"]["kept_expert_ids"] == config.kept_expert_ids
    assert math.isfinite(provenance["max_abs_diff"]) and provenance["max_abs_diff"] > 0
    assert (out / "tokenizer_config.json").is_file()


def test_convert_needs_keep_and_calibration_with_prune_experts():
    with pytest.raises(ValueError, match="needs --keep"):
        ExpertPruning.pop_from({"prune_experts": "reap", "keep": None, "calibration": "data.jsonl"})
    with pytest.raises(ValueError, match="only apply with --prune-experts"):
        ExpertPruning.pop_from({"prune_experts": None, "keep": 4, "calibration": None})
    options = {"prune_experts": None, "keep": None, "calibration": None, "dtype": "float32"}
    assert ExpertPruning.pop_from(options) is None and options == {"dtype": "float32"}


def test_qwen3_5_conversion_prunes_after_converting(tmp_path, calibration_file):
    """`--prune-experts` on a Qwen3.5-MoE source: the exact conversion, then the pruning, which calibrates with the
    source's tokenizer."""
    source_config = {key: value for key, value in copy.deepcopy(TINY_MOEMB).items() if key != "emb_token_id"}
    Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**source_config)).save_pretrained(tmp_path)
    options = dict(prune_experts="msan", keep=5, calibration=str(calibration_file[0]), calibration_samples=4)
    with pytest.raises(ValueError, match="--prune-experts msan .* needs a tokenizer"):
        convert(tmp_path, verify=False, emb_token_id=124, **options)
    tiny_tokenizer_for(MoEmbConfig(**copy.deepcopy(TINY_MOEMB))).save_pretrained(tmp_path)
    result = convert(tmp_path, **options)
    config = result.model.config
    assert config.text_config.num_experts == 5 and config.pruned_from_num_experts == 8
    differences = result.provenance["max_abs_diff_by_output"]
    assert differences["last_hidden_state"] == differences["router_logits"] == 0.0  # the conversion is exact
    assert result.provenance["max_abs_diff"] == differences["embeddings_after_expert_pruning"] > 0
    assert result.provenance["expert_pruning"]["kept_expert_ids"] == config.kept_expert_ids


def test_kept_ids_are_checked_before_any_tensor_is_sliced():
    model = make_model()
    with pytest.raises(ValueError, match="layer 1: .* distinct ascending ids below 8"):
        keep_experts(model, [[0, 1, 2, 3, 4]] + [[0, 1, 2, 3, 9]] * 7)
    assert moe_blocks(model)[0].num_experts == 8 and model.config.kept_expert_ids is None
