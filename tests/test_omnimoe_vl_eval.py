"""`moezoo eval omnimoe_vl` on the tiny preset (spec omnimoe_vl.md §7.1, §7.5, §7.7): VQA scores against scores
computed by hand for a model whose answers are forced, answer NLLs against a one-row-at-a-time computation, route
distances and interventions (ΔNLL = 0 for the native route, spec §9.6), utilisation statistics, bad data."""

import json

import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn
from transformers import AutoModelForImageTextToText, AutoProcessor

from moezoo.cli import main
from moezoo.evaluation.omnimoe_vl import (
    answer_nll,
    evaluate_access,
    evaluate_utilization,
    evaluate_vqa,
    load_vqa_examples,
    multiple_choice_prompt,
    open_answer_score,
    route_distances,
    total_variation,
)
from moezoo.zoo import create_from_preset


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny preset (random weights, seed 0) and three drawn images."""
    root = tmp_path_factory.mktemp("omnimoe_vl_eval")
    create_from_preset("tiny-omnimoe_vl", root / "model")
    for name, (colour, shape) in {"red-circle": ("red", "ellipse"), "blue-square": ("blue", "rectangle"),
                                  "green-circle": ("green", "ellipse")}.items():  # fmt: skip
        image = Image.new("RGB", (64, 64), "white")
        getattr(ImageDraw.Draw(image), shape)((12, 12, 52, 52), fill=colour)
        image.save(root / f"{name}.png")
    return root


@pytest.fixture(scope="module")
def processor(folder):
    return AutoProcessor.from_pretrained(folder / "model")


@pytest.fixture(scope="module")
def model(folder):
    """The tiny model with routes that depend on the question and an injection that matters: a freshly initialised
    projector attends almost uniformly over the patches whatever the prompt, and its depth scores are nearly equal
    (the prompt reaches the route only through what the router queries attend to, spec §2.4)."""
    model = AutoModelForImageTextToText.from_pretrained(folder / "model").eval()
    projector = model.model.projector
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in projector.named_parameters():
            if name.startswith(("queries.", "depth_attn.")) and weight.ndim == 2:
                weight.normal_(std=0.5)
        for score in projector.depth_score:
            score.fc2.weight.normal_(std=3.0)
        projector.injection.gate.fill_(0.5)
    return model


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


class ForcedAnswerHead(nn.Module):
    """An LM head that makes one token certain at every position: the model answers it, whatever it is asked."""

    def __init__(self, vocab_size: int, token_id: int):
        super().__init__()
        self.logits = torch.full((vocab_size,), -30.0)
        self.logits[token_id] = 30.0

    def forward(self, hidden_states):
        return self.logits.expand(*hidden_states.shape[:-1], -1)


def test_vqa_scores_equal_the_scores_computed_by_hand(folder, processor):
    model = AutoModelForImageTextToText.from_pretrained(folder / "model").eval()
    forced = processor.tokenizer.convert_tokens_to_ids("2")
    model.lm_head = ForcedAnswerHead(model.config.text_config.vocab_size, forced)
    data = write_jsonl(folder / "forced.jsonl", [
        {"image": "red-circle.png", "question": "How many?", "choices": ["1", "2", "3"], "answer": "2", "task": "mc"},
        {"image": "red-circle.png", "question": "How many?", "choices": ["2", "3"], "answer": 1, "task": "mc"},
        {"image": "blue-square.png", "question": "How many?", "choices": ["4", "2", "3"], "answer": 1, "task": "mc"},
        {"image": "blue-square.png", "question": "How many?", "answers": ["2"], "task": "open"},
        {"image": "blue-square.png", "question": "How many?", "answers": "3", "task": "open"},
        {"image": "green-circle.png", "question": "How many?", "answers": ["2", "2", "2", "4"], "task": "counts"},
        {"image": "green-circle.png", "question": "How many?", "answers": ["2", "5", "6"], "task": "counts"},
    ])  # fmt: skip
    examples = load_vqa_examples(data)
    exact = evaluate_vqa(model, processor, examples, batch_size=3, max_new_tokens=1, progress=False)
    assert [row["prediction"] for row in exact["rows"]] == ["2"] * 7
    # By hand: mc 2 of 3 right; open 1 of 2; counts both match a reference.
    assert {task["task"]: task["score"] for task in exact["tasks"]} == pytest.approx(
        {"mc": 200 / 3, "open": 50.0, "counts": 100.0}
    )
    assert exact["average"] == pytest.approx((200 / 3 + 50 + 100) / 3)
    vqa = evaluate_vqa(model, processor, examples, batch_size=4, max_new_tokens=1, open_metric="vqa", progress=False)
    # VQA accuracy: "2" given by 1 of 1, 0 of 1, 3 of 4 and 1 of 3 references: min(1, n / 3).
    assert [row["score"] for row in vqa["rows"][3:]] == pytest.approx([1 / 3, 0.0, 1.0, 1 / 3])
    assert {task["task"]: task["score"] for task in vqa["tasks"]}["counts"] == pytest.approx(100 * (1 + 1 / 3) / 2)


def test_open_answers_are_normalised_before_matching():
    assert open_answer_score("The Red.", ["red"]) == 1.0
    assert open_answer_score("a  red car", ["Red car!"]) == 1.0
    assert open_answer_score("red", ["blue", "green"]) == 0.0
    with pytest.raises(ValueError, match="open-answer metric must be one of exact, vqa"):
        open_answer_score("red", ["red"], metric="anls")


def test_answer_nll_in_a_padded_batch_equals_each_row_alone(folder, processor, model):
    data = write_jsonl(folder / "nll.jsonl", [
        {"image": "red-circle.png", "question": "What colour is the circle?", "answers": ["red"]},
        {"image": "blue-square.png", "question": "Shape?", "answers": ["a blue square"]},
    ])  # fmt: skip
    examples = load_vqa_examples(data)
    questions, answers = [e.question for e in examples], [e.reference for e in examples]
    with torch.no_grad():
        batched, routes = answer_nll(model, processor, examples, questions, answers)
        for index, example in enumerate(examples):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example.question}]},
                        {"role": "assistant", "content": [{"type": "text", "text": example.reference}]}]  # fmt: skip
            inputs = processor(images=[Image.open(example.image)], text=[processor.apply_chat_template(messages)],
                               return_tensors="pt")  # fmt: skip
            answer_ids = processor.tokenizer(example.reference, add_special_tokens=False)["input_ids"]
            # The answer's tokens sit just before the closing <|im_end|> and its newline.
            end = inputs["input_ids"].shape[1] - 2
            assert inputs["input_ids"][0, end - len(answer_ids) : end].tolist() == answer_ids
            outputs = model(**inputs)
            log_probs = outputs.logits[0, end - len(answer_ids) - 1 : end - 1].float().log_softmax(-1)
            expected = -log_probs[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].mean()
            assert batched[index].item() == pytest.approx(expected.item(), abs=1e-5)
            torch.testing.assert_close(routes[index], outputs.depth_route[0].float(), atol=1e-6, rtol=0)


def test_route_distances_and_interventions(folder, processor, model):
    data = write_jsonl(folder / "access.jsonl", [
        {"image": "red-circle.png", "question": "What colour is the circle?", "answers": ["red"], "target": "colour"},
        {"image": "red-circle.png", "question": "Which colour does the circle have?", "answers": ["red"],
         "target": "colour"},
        {"image": "red-circle.png", "question": "Is the shape round or square, answer in one word?",
         "answers": ["round"], "target": "shape"},
        {"image": "blue-square.png", "question": "What colour is the square?", "answers": ["blue"]},
        {"image": "blue-square.png", "question": "What colour is the square?", "answers": ["blue"]},
    ])  # fmt: skip
    examples = load_vqa_examples(data)
    results = evaluate_access(model, processor, examples, batch_size=2, progress=False)
    interventions = {(row["fusion"], row["injection"]): row for row in results["interventions"]}
    # The native route given as an override changes nothing (spec §9.6), in every row.
    native = interventions["native", "native"]
    assert native["rows"] == 5 and native["delta_nll"] == 0.0
    # Rows 0 and 1 are each other's paraphrase; rows 0-2 have another question about their image; the blue square's
    # two rows have distinct targets (one per line by default), so each is the other's other question.
    assert interventions["paraphrase", "paraphrase"]["rows"] == 2 and interventions["other", "other"]["rows"] == 5
    # Another question's route changes the answer's NLL through fusion and through injection alone.
    assert interventions["other", "native"]["delta_nll"] != 0.0
    assert interventions["native", "other"]["delta_nll"] != 0.0

    distances = results["route_distances"]
    assert distances["images"] == 2 and distances["paraphrase_images"] == 1
    assert 0.0 < distances["different_questions"] <= 1.0
    assert distances["gap"] == pytest.approx(distances["different_questions"] - distances["paraphrases"])


def test_route_distance_of_a_prompt_with_itself_is_zero(folder):
    data = write_jsonl(folder / "same.jsonl", [
        {"image": "red-circle.png", "question": "Colour?", "answers": ["red"], "target": "colour"},
        {"image": "red-circle.png", "question": "Colour?", "answers": ["red"], "target": "colour"},
        {"image": "red-circle.png", "question": "Shape?", "answers": ["round"], "target": "shape"},
    ])  # fmt: skip
    examples = load_vqa_examples(data)
    routes = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.25, 0.75]])
    # Aggregation by hand: target "colour" (rows 0, 1): paraphrase pair D_TV 0, different pairs (0, 2), (1, 2) each
    # 0.75; target "shape": different pairs (2, 0), (2, 1) each 0.75; the image: mean over its targets.
    assert route_distances(examples, routes) == {"different_questions": 0.75, "paraphrases": 0.0, "gap": 0.75,
                                                 "images": 1, "paraphrase_images": 1}  # fmt: skip
    assert total_variation(routes[0], routes[0]) == 0.0
    assert total_variation(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0  # disjoint supports


def test_utilization_statistics_and_heatmaps(folder, processor, model, tmp_path):
    data = write_jsonl(folder / "use.jsonl", [
        {"image": image, "question": question, "answers": ["x"]}
        for image in ("red-circle.png", "blue-square.png") for question in ("Colour?", "What shape is drawn here?")
    ])  # fmt: skip
    result = evaluate_utilization(model, processor, load_vqa_examples(data), batch_size=3, out=tmp_path,
                                  progress=False)  # fmt: skip
    config = model.config
    depth = result["depth"]
    assert sum(depth["mean_weight"]) == pytest.approx(1.0)
    assert sum(depth["selection_frequency"]) == pytest.approx(config.depth_top_k)  # k depths per sample
    assert 0.0 < depth["route_entropy"] <= depth["entropy_of_mean_route"] + 1e-6  # entropy is concave
    assert sorted(result["lm"]) == [f"layers.{i}.mlp" for i in (0, 2, 4)]
    assert sorted(result["vision"]) == [f"encoder.layers.{i}.mlp" for i in (0, 2, 4)]
    for shares in [*result["lm"].values(), *result["vision"].values()]:
        assert len(shares) == 8 and sum(shares) == pytest.approx(1.0)
    assert [path.endswith(name) for path, name in zip(result["plots"], ("experts.png", "depths.png"))] == [True, True]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("experts.png", "depths.png"))


def test_command_prints_json_and_writes_heatmaps(folder, tmp_path, capsys):
    data = write_jsonl(folder / "cli.jsonl", [
        {"image": "red-circle.png", "question": "Colour?", "choices": ["red", "blue"], "answer": 0, "task": "mc"},
        {"image": "red-circle.png", "question": "Shape?", "answers": ["circle"], "task": "open"},
    ])  # fmt: skip
    out = tmp_path / "plots"
    assert main(["eval", "omnimoe_vl", "--model", str(folder / "model"), "--data", data, "--out", str(out),
                 "--max-new-tokens", "2", "--json"]) == 0  # fmt: skip
    results = json.loads(capsys.readouterr().out)
    assert results["examples"] == 2 and set(results) >= {"vqa", "utilization", "access"}
    assert [task["task"] for task in results["vqa"]["tasks"]] == ["mc", "open"]
    assert (out / "depths.png").is_file() and (out / "experts.png").is_file()
    assert main(["eval", "omnimoe_vl", "--model", str(folder / "model"), "--data", data, "--task", "vqa"]) == 0
    assert "average over 2 task(s) (Eq. 19)" in capsys.readouterr().out


def test_multiple_choice_prompt_lists_the_options(folder):
    data = write_jsonl(folder / "prompt.jsonl", [
        {"image": "red-circle.png", "question": "Colour?", "choices": ["red", "blue"], "answer": "red"}
    ])  # fmt: skip
    assert multiple_choice_prompt(load_vqa_examples(data)[0]) == "Colour?\nA. red\nB. blue"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"image": "nowhere.png", "question": "Q?", "answers": ["a"]}, r"line 1: no image file .*nowhere\.png"),
        ({"question": "Q?", "answers": ["a"]}, r"line 1: 'image' must be a non-empty string"),
        ({"image": "red-circle.png", "question": "Q?", "choices": "red, blue", "answer": 0},
         r"line 1: 'choices' must be a list of 2 to 26 distinct non-empty strings"),
        ({"image": "red-circle.png", "question": "Q?", "choices": ["red"], "answer": 0}, r"'choices' must be a list"),
        ({"image": "red-circle.png", "question": "Q?", "choices": ["red", "blue"], "answer": "green"},
         r"line 1: 'answer' must be the index \(0 to 1\) or the text of the correct choice, got 'green'"),
        ({"image": "red-circle.png", "question": "Q?", "choices": ["red", "blue"], "answer": 2}, r"'answer' must be"),
        ({"image": "red-circle.png", "question": "Q?", "answers": []}, r"line 1: 'answers' must be a non-empty"),
        ({"image": "red-circle.png", "question": "Q?"}, r"line 1: give either 'choices' .* or 'answers'"),
        ({"image": "red-circle.png", "question": "Q?", "answers": ["a"], "choices": ["a", "b"], "answer": 0},
         r"give either"),
    ],
)  # fmt: skip
def test_bad_rows_fail_naming_the_line_and_field(folder, row, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_vqa_examples(write_jsonl(folder / "bad.jsonl", [row]))


def test_bad_files_fail_with_a_message_not_a_traceback(folder, capsys):
    (folder / "broken.jsonl").write_text('{"image": "red-circle.png", "question": "Q?", "answers": ["a"]}\n{oops\n')
    assert main(["eval", "omnimoe_vl", "--model", str(folder / "model"), "--data", str(folder / "broken.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "broken.jsonl line 2 is not JSON" in err and "Traceback" not in err
    assert main(["eval", "omnimoe_vl", "--model", str(folder / "model"), "--data", str(folder / "none.jsonl")]) == 2
    assert "no data file" in capsys.readouterr().err
    single = write_jsonl(folder / "single.jsonl", [{"image": "red-circle.png", "question": "Q?", "answers": ["a"]}])
    assert main(["eval", "omnimoe_vl", "--model", str(folder / "model"), "--data", single, "--task", "access"]) == 2
    assert "route distances need two questions about one image" in capsys.readouterr().err
