"""`moezoo bench omnimoe_vl`: the JSON contract on the tiny model, the dense projector's parameter match and its
place in the model, and bad arguments."""

import copy
import json
import math

import pytest
import torch

from moezoo.bench.omnimoe_vl import bench_inputs, dense_projector_for, dense_projector_width, run_omnimoe_vl_bench
from moezoo.cli import main
from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.modeling.moe import count_parameters
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration


def tiny_config() -> OmniMoeVlConfig:
    return OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL))


def test_json_rows_compare_both_projectors_in_one_run(capsys):
    assert main(["bench", "omnimoe_vl", "--size", "tiny", "--batch-size", "2", "--text-tokens", "5", "--new-tokens",
                 "3", "--seconds", "0.05", "--threads", "1", "--json"]) == 0  # fmt: skip
    rows = {row["model"]: row for row in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["omnimoe_vl", "dense_mlp"]
    for row in rows.values():
        # <|vision_start|>, 16 placeholders, <|vision_end|>, then the text
        assert (row["batch_size"], row["prompt_tokens"], row["new_tokens"]) == (2, 18 + 5, 3)
        assert row["prefill_ms"] > 0 and row["generate_ms"] > 0
        assert math.isclose(row["tokens_per_second"], 2 * 3 * 1e3 / row["generate_ms"])
        dense = rows["dense_mlp"]
        assert math.isclose(row["prefill_vs_dense"], row["prefill_ms"] / dense["prefill_ms"])
        assert math.isclose(row["tokens_per_second_vs_dense"], row["tokens_per_second"] / dense["tokens_per_second"])
    assert rows["dense_mlp"]["prefill_vs_dense"] == 1.0 == rows["dense_mlp"]["tokens_per_second_vs_dense"]
    # Equal active parameters: the projectors differ by less than one hidden unit of the dense one.
    config = tiny_config()
    one_unit = config.vision_config.hidden_size + 1 + config.text_config.hidden_size
    moe, dense = rows["omnimoe_vl"], rows["dense_mlp"]
    assert abs(moe["projector_parameters"] - dense["projector_parameters"]) <= one_unit / 2
    assert moe["active_parameters"] - dense["active_parameters"] == moe["projector_parameters"] - dense[
        "projector_parameters"]  # fmt: skip


def test_the_dense_projector_has_as_many_parameters_and_the_model_runs_with_it_without_route():
    torch.manual_seed(0)
    model = OmniMoeVlForConditionalGeneration(tiny_config()).eval()
    dense = dense_projector_for(model)
    parameters = count_parameters(model.model.projector).total
    width = dense_projector_width(parameters, 32, 64)
    assert count_parameters(dense).total == width * (32 + 1 + 64) + 64
    assert abs(count_parameters(dense).total - parameters) <= (32 + 1 + 64) / 2
    inputs = bench_inputs(model.config, batch_size=2, text_tokens=4)
    model.model.projector = dense
    with torch.no_grad():
        outputs = model(**inputs)
        # The dense projector's tokens are the image's: the last stream through the MLP.
        streams = model.model.get_image_features(inputs["pixel_values"]).pooler_output.view(2, 3, 16, 32)
        expected = dense.linear_2(dense.act(dense.linear_1(streams[:, -1])))
        torch.testing.assert_close(outputs.image_hidden_states, expected)
        assert outputs.routing_context is None and outputs.depth_route is None
        generated = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert generated.shape == (2, inputs["input_ids"].shape[1] + 2)


def test_run_times_both_projectors_on_one_model():
    rows = run_omnimoe_vl_bench(tiny_config(), batch_size=1, text_tokens=2, new_tokens=2, seconds=0.01, max_rounds=3)
    assert [row.model for row in rows] == ["omnimoe_vl", "dense_mlp"]
    assert all(row.tokens_per_second > 0 for row in rows)
    # Only the projector differs: the rest of the model is counted the same with either in place.
    moe, dense = rows
    assert moe.active_parameters - dense.active_parameters == moe.projector_parameters - dense.projector_parameters


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--new-tokens", "0"], "new tokens must be positive, got 0"),
        (["--batch-size", "0"], "batch size must be positive, got 0"),
        (["--threads", "0"], "--threads must be positive"),
    ],
)
def test_bad_arguments_fail_with_a_message_not_a_traceback(options, message, capsys):
    assert main(["bench", "omnimoe_vl", "--size", "tiny", "--seconds", "0.01", *options, "--json"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
