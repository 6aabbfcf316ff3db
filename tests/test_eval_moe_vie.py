"""`moezoo eval moe_vie`: zero-shot classification and image/video-text retrieval (spec moe_vie.md §8 "Evaluation").

Known answers come from `LookupModel`, whose embeddings the tests choose: an image is a solid colour whose red level
indexes a table of image vectors, a text is looked up by its token ids. The real tiny MoE-ViE runs the video test and
the command end to end.
"""

import argparse
import json
import re

import pytest
import torch
from datasets import Dataset
from PIL import Image
from torch.nn import functional as F
from transformers.modeling_outputs import BaseModelOutputWithPooling

from moezoo.configuration.moe_vie import MoeVieConfig
from moezoo.evaluation.moe_vie import (
    DEFAULT_TEMPLATES,
    add_eval_arguments,
    classification_metrics,
    embed,
    load_classification_data,
    load_retrieval_data,
    retrieval,
    retrieval_metrics,
    run_eval,
    zero_shot_classification,
    zero_shot_classifier,
)
from moezoo.modeling.moe_vie import MoeVieModel
from moezoo.presets.moe_vie import TINY_PRESET_CONFIG
from moezoo.processors.build import make_moe_vie_processor
from moezoo.training.synthetic import ColouredShapes


SHAPES = ColouredShapes(image_size=16)


@pytest.fixture(scope="module")
def processor():
    return make_moe_vie_processor(MoeVieConfig(**TINY_PRESET_CONFIG))


def solid(index: int) -> Image.Image:
    """The image `LookupModel` embeds as its image vector `index`."""
    return Image.new("RGB", (16, 16), (index, 0, 0))


class LookupModel(torch.nn.Module):
    """Embeddings chosen by the test: `image_vectors[i]` for `solid(i)`, `text_vectors[text]` for a text."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, processor, image_vectors=None, text_vectors=None):
        super().__init__()
        self.image_vectors = image_vectors
        text_vectors = text_vectors or {}
        token_ids = processor(text=list(text_vectors), return_tensors="pt")["input_ids"] if text_vectors else []
        self.text_vectors = {tuple(ids.tolist()): vector for ids, vector in zip(token_ids, text_vectors.values())}
        self.calls = 0

    def _called(self):
        assert not self.training and not torch.is_grad_enabled(), "embeddings must be computed in eval mode, no grad"
        self.calls += 1

    def get_text_features(self, input_ids, attention_mask=None):
        self._called()
        vectors = [self.text_vectors[tuple(ids.tolist())] for ids in input_ids]
        return BaseModelOutputWithPooling(pooler_output=torch.stack(vectors))

    def get_image_features(self, pixel_values, pixel_attention_mask=None, spatial_shapes=None):
        self._called()
        # The processor maps red level r to (r / 255 - 0.5) / 0.5; the first value of a patch is a red channel.
        index = ((pixel_values[:, 0, 0] * 0.5 + 0.5) * 255).round().long()
        return BaseModelOutputWithPooling(pooler_output=self.image_vectors[index])


def one_hot(index: int, size: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(index), size).float()


def brute_force_recalls(item_embeds, text_embeds, caption_items, ks):
    """Recall@k by sorting every score list and looking for a right answer in its first k entries."""
    scores = text_embeds @ item_embeds.T
    text_to_item = {k: 0 for k in ks}
    for caption, item in enumerate(caption_items):
        order = sorted(range(len(item_embeds)), key=lambda i: -scores[caption, i])
        for k in ks:
            text_to_item[k] += item in order[:k]
    item_to_text = {k: 0 for k in ks}
    for item in range(len(item_embeds)):
        order = sorted(range(len(caption_items)), key=lambda c: -scores[c, item])
        for k in ks:
            item_to_text[k] += any(caption_items[c] == item for c in order[:k])
    return (
        {f"recall@{k}": hits / len(item_embeds) for k, hits in item_to_text.items()},
        {f"recall@{k}": hits / len(caption_items) for k, hits in text_to_item.items()},
    )


# --- Zero-shot classification ----------------------------------------------------------------------------------------


def test_zero_shot_accuracy_per_class_and_top5_match_a_hand_count(processor):
    names = SHAPES.class_names[:6]
    # Class c is the unit vector e_c; each image's ranking of the classes is readable from its vector.
    image_vectors = torch.stack([
        one_hot(0, 6) + 0.5 * one_hot(1, 6),  # label 0: ranked 1st
        one_hot(0, 6) + 0.5 * one_hot(1, 6),  # label 1: ranked 2nd
        torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.1]),  # label 5: ranked 6th
        one_hot(2, 6),  # label 2: ranked 1st
    ])
    text_vectors = {f"a photo of a {name}.": one_hot(c, 6) for c, name in enumerate(names)}
    model = LookupModel(processor, image_vectors, text_vectors)
    model.train()
    images, labels = [solid(i) for i in range(4)], [0, 1, 5, 2]
    results = zero_shot_classification(model, processor, images, labels, names, templates=["a photo of a {}."],
                                       batch_size=3)
    assert model.training, "the model goes back to training mode"
    assert (results["examples"], results["classes"], results["templates"]) == (4, 6, 1)
    assert results["top1"] == pytest.approx(2 / 4) and results["top5"] == pytest.approx(3 / 4)
    assert [row["accuracy"] for row in results["per_class"]] == [1.0, 0.0, 1.0, None, None, 0.0]
    assert [row["examples"] for row in results["per_class"]] == [1, 1, 1, 0, 0, 1]
    assert results["mean_per_class_accuracy"] == pytest.approx(2 / 4)
    assert results["notes"] == []
    json.dumps(results)
    by_name = zero_shot_classification(model, processor, images, [names[label] for label in labels], names,
                                       templates=["a photo of a {}."], progress=False)
    assert by_name == results


def test_classes_average_the_normalised_embeddings_of_their_templates(processor, tmp_path):
    templates = ["a photo of a {}.", "a {}"]
    text_vectors = {
        "a photo of a red circle.": torch.tensor([10.0, 0.0, 0.0]),  # a long vector must not outweigh the other
        "a red circle": torch.tensor([0.0, 1.0, 0.0]),
        "a photo of a blue cross.": torch.tensor([0.0, 0.0, 1.0]),
        "a blue cross": torch.tensor([0.0, 0.0, 2.0]),
    }
    model = LookupModel(processor, torch.tensor([[0.3, 1.0, 0.9]]), text_vectors)
    classifier = zero_shot_classifier(model, processor, ["red circle", "blue cross"], templates)
    expected = torch.tensor([[0.5**0.5, 0.5**0.5, 0.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(classifier, expected)
    template_file = tmp_path / "templates.txt"
    template_file.write_text("\n".join(templates) + "\n\n")
    torch.testing.assert_close(zero_shot_classifier(model, processor, ["red circle", "blue cross"], template_file),
                               expected)
    # Image (0.3, 1, 0.9): cosine 0.92 / |v| with red circle, 0.9 / |v| with blue cross. Averaging raw embeddings would
    # give red circle (10, 1, 0) and the answer blue cross.
    results = zero_shot_classification(model, processor, [solid(0)], [0], ["red circle", "blue cross"], templates)
    assert results["top1"] == 1.0
    assert "top5" not in results and results["notes"] == ["top-5 accuracy left out: there are only 2 classes"]


def test_default_templates_each_hold_one_slot_for_the_class_name():
    assert len(DEFAULT_TEMPLATES) > 1 and all(template.count("{}") == 1 for template in DEFAULT_TEMPLATES)


# --- Retrieval -------------------------------------------------------------------------------------------------------


def test_recall_at_k_both_ways_with_several_captions_per_image_matches_brute_force(processor):
    generator = torch.Generator().manual_seed(0)
    captions_per_image = [1, 3, 2, 1, 2, 3, 1]
    captions = [[f"a {SHAPES.class_names[image]} moving {motion}" for motion in ("left", "right", "up")[:count]]
                for image, count in enumerate(captions_per_image)]
    texts = [text for item_captions in captions for text in item_captions]
    image_vectors = torch.randn(len(captions), 8, generator=generator)
    text_vectors = torch.randn(len(texts), 8, generator=generator) + image_vectors[
        torch.repeat_interleave(torch.arange(len(captions)), torch.tensor(captions_per_image))]
    model = LookupModel(processor, image_vectors, dict(zip(texts, text_vectors)))
    images = [solid(i) for i in range(len(captions))]
    results = retrieval(model, processor, images, captions, batch_size=4)

    caption_items = [item for item, count in enumerate(captions_per_image) for _ in range(count)]
    image_to_text, text_to_image = brute_force_recalls(F.normalize(image_vectors, dim=-1),
                                                       F.normalize(text_vectors, dim=-1), caption_items, (1, 5, 10))
    assert results["image_to_text"] == pytest.approx(image_to_text)
    # Recall@10 over 7 images is not a ranking any more: left out, with a note.
    del text_to_image["recall@10"]
    assert results["text_to_image"] == pytest.approx(text_to_image)
    assert results["notes"] == ["text_to_image recall@10 left out: there are only 7 images"]
    assert (results["task"], results["items"], results["captions"]) == ("retrieval", 7, 13)
    assert 0 < results["text_to_image"]["recall@1"] < 1, "the test data must have hits and misses"
    json.dumps(results)


@pytest.mark.parametrize("seed", range(5))
def test_retrieval_metrics_match_brute_force_on_random_embeddings(seed):
    generator = torch.Generator().manual_seed(seed)
    caption_items = torch.randint(0, 12, (40,), generator=generator)
    caption_items[:12] = torch.arange(12)  # every item has a caption
    items = F.normalize(torch.randn(12, 4, generator=generator), dim=-1)
    texts = F.normalize(torch.randn(40, 4, generator=generator), dim=-1)
    results = retrieval_metrics(texts @ items.T, caption_items, "video", ks=(1, 3, 5, 10))
    video_to_text, text_to_video = brute_force_recalls(items, texts, caption_items.tolist(), (1, 3, 5, 10))
    assert results["video_to_text"] == pytest.approx(video_to_text)
    assert results["text_to_video"] == pytest.approx(text_to_video)
    assert results["task"] == "video-retrieval" and results["notes"] == []


def test_ties_count_against_the_model():
    """A collapsed model (every embedding equal) must score 0, not 1."""
    scores = torch.zeros(6, 3)
    results = retrieval_metrics(scores, torch.tensor([0, 0, 1, 1, 2, 2]), ks=(1, 2))
    assert results["image_to_text"] == {"recall@1": 0.0, "recall@2": 0.0}
    assert results["text_to_image"] == {"recall@1": 0.0, "recall@2": 0.0}
    assert classification_metrics(torch.zeros(4, 5), torch.tensor([0, 1, 2, 3]), list("abcde"))["top1"] == 0.0


def test_video_retrieval_on_moving_shape_clips_with_the_tiny_model(processor):
    torch.manual_seed(0)
    model = MoeVieModel(MoeVieConfig(**TINY_PRESET_CONFIG))
    generator = torch.Generator().manual_seed(1)
    clips, captions = [], []
    for index, (label, motion) in enumerate([(0, "left"), (5, "up"), (10, "right"), (15, "down"), (6, "left")]):
        frames, caption = SHAPES.clip(label, motion, num_frames=2 + index, generator=generator)
        clips.append(frames)
        captions.append([caption, SHAPES.caption(label)])
    # Batches of 2 pad the shorter clip of each batch: padding must not change a clip's embedding.
    video_embeds = embed(model, processor, clips, "video", batch_size=2)
    with torch.no_grad():
        one_at_a_time = torch.cat(
            [model.get_video_features(**processor(videos=[clip], return_tensors="pt")).pooler_output for clip in clips]
        )
    torch.testing.assert_close(video_embeds, F.normalize(one_at_a_time, dim=-1), atol=1e-5, rtol=1e-5)

    results = retrieval(model, processor, clips, captions, modality="video", batch_size=2)
    text_embeds = embed(model, processor, [text for pair in captions for text in pair], "text")
    video_to_text, text_to_video = brute_force_recalls(video_embeds, text_embeds, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4],
                                                       (1, 5, 10))
    assert results["video_to_text"] == pytest.approx(video_to_text)
    del text_to_video["recall@10"]
    assert results["text_to_video"] == pytest.approx(text_to_video)
    assert results["notes"] == ["text_to_video recall@10 left out: there are only 5 videos"]


# --- Evaluation data -------------------------------------------------------------------------------------------------


def write_class_folders(root, counts):
    """An image folder with one sub-folder per class; image `solid(i)` numbered in folder order."""
    index = 0
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for _ in range(count):
            solid(index).save(root / name / f"{index}.png")
            index += 1
    return root


def test_image_folder_with_class_subfolders(tmp_path, processor):
    folder = write_class_folders(tmp_path / "shapes", {"blue cross": 2, "green circle": 2, "red square": 2})
    data = load_classification_data(folder)
    assert data.class_names == ["blue cross", "green circle", "red square"]
    assert data.labels == [0, 0, 1, 1, 2, 2]
    assert [image.getpixel((0, 0)) for image in data.images] == [(i, 0, 0) for i in range(6)]

    limited = load_classification_data(folder, limit=3)
    assert limited.labels == [0, 1, 2], "a limit keeps examples of every class"
    assert len(limited.images) == 3

    names_file = tmp_path / "names.txt"
    names_file.write_text("blue plus\ngreen disc\nred square\n")
    assert load_classification_data(folder, class_names=names_file).class_names == ["blue plus", "green disc",
                                                                                       "red square"]
    # The loaded set evaluates: images 0-5 point at classes 0, 1, 1, 1, 2, 0.
    answers = [0, 1, 1, 1, 2, 0]
    model = LookupModel(processor, torch.stack([one_hot(c, 3) for c in answers]),
                        {f"a photo of a {name}.": one_hot(c, 3) for c, name in enumerate(data.class_names)})
    results = zero_shot_classification(model, processor, data.images, data.labels, data.class_names,
                                       templates=["a photo of a {}."])
    assert results["top1"] == pytest.approx(4 / 6)
    assert [row["accuracy"] for row in results["per_class"]] == [0.5, 1.0, 0.5]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_classification_with_string_labels_and_relative_paths(tmp_path):
    (tmp_path / "images").mkdir()
    for i in range(3):
        solid(i).save(tmp_path / "images" / f"{i}.png")
    table = write_jsonl(tmp_path / "labels.jsonl", [
        {"path": "images/0.png", "shape": "red square"},
        {"path": "images/1.png", "shape": "blue cross"},
        {"path": "images/2.png", "shape": "red square"},
    ])
    data = load_classification_data(table, image_column="path", label_column="shape")
    assert data.class_names == ["blue cross", "red square"]
    assert data.labels == [1, 0, 1]
    assert [image.getpixel((0, 0)) for image in data.images] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]


def test_jsonl_retrieval_groups_the_captions_of_each_image(tmp_path):
    (tmp_path / "images").mkdir()
    for i in range(3):
        solid(i).save(tmp_path / "images" / f"{i}.png")
    table = write_jsonl(tmp_path / "captions.jsonl", [
        {"image": "images/0.png", "text": "a red square"},
        {"image": "images/1.png", "text": "a blue cross"},
        {"image": "images/0.png", "text": "a photo of a red square"},
        {"image": "images/2.png", "text": "a green circle"},
        {"image": "images/1.png", "text": "a photo of a blue cross"},
    ])
    data = load_retrieval_data(table)
    assert data.captions == [["a red square", "a photo of a red square"], ["a blue cross", "a photo of a blue cross"],
                             ["a green circle"]]
    assert [image.getpixel((0, 0)) for image in data.items] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    limited = load_retrieval_data(table, limit=2)
    assert limited.captions == [data.captions[0], data.captions[1]] and len(limited.items) == 2


def test_video_jsonl_groups_captions_by_frames(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rows = []
    for video, (label, motion) in enumerate([(0, "left"), (7, "up")]):
        frames, caption = SHAPES.clip(label, motion, num_frames=3, generator=generator)
        (tmp_path / f"video{video}").mkdir()
        for t, frame in enumerate(frames):
            frame.save(tmp_path / f"video{video}" / f"{t}.png")
        rows += [{"frames": f"video{video}", "text": text} for text in (caption, SHAPES.caption(label))]
    data = load_retrieval_data(write_jsonl(tmp_path / "videos.jsonl", rows), modality="video")
    assert data.captions == [[rows[0]["text"], rows[1]["text"]], [rows[2]["text"], rows[3]["text"]]]
    assert [len(frames) for frames in data.items] == [3, 3] and isinstance(data.items[0][0], Image.Image)


# --- Bad input -------------------------------------------------------------------------------------------------------


NAMES = ["red square", "blue cross", "green circle"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, p: zero_shot_classification(m, p, [], [], NAMES), "no labels"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0], NAMES, templates=["a photo of a"]),
         "exactly one '{}'"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0], NAMES, templates=["{} and {}"]),
         "exactly one '{}'"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0], NAMES, templates=[]), "no prompt templates"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0), solid(1)], [0, 3], NAMES), "not among the 3 classes"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], ["purple"], NAMES), "'purple'"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [None], NAMES), "not among"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0, 1], NAMES), "2 labels"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0], ["red square"]), "at least 2 class names"),
        (lambda m, p: zero_shot_classification(m, p, [solid(0)], [0], ["red square", ""]), "non-empty"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1), solid(2)], ["a", "b", "c"], ks=(5, 10)), "k <= the number"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1)], ["a", "b"], ks=(0, 1)), "positive integers"),
        (lambda m, p: retrieval(m, p, [solid(0)], ["a"]), "at least 2 items"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1)], ["a"]), "caption entries"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1)], ["a", []]), "item 1 needs at least one caption"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1)], ["a", ["b", " "]]), "non-empty strings"),
        (lambda m, p: retrieval(m, p, [solid(0), solid(1)], ["a", "b"], modality="audio"), "modality"),
        (lambda m, p: embed(m, p, [solid(0)], "image", batch_size=0), "batch_size"),
    ],
)
def test_bad_input_is_rejected_before_anything_is_embedded(processor, call, message):
    model = LookupModel(processor, torch.eye(3))
    with pytest.raises(ValueError, match=re.escape(message)):
        call(model, processor)
    assert model.calls == 0


def test_a_video_without_frames_is_rejected(processor):
    model = LookupModel(processor)
    with pytest.raises(ValueError, match="has no frames"):
        retrieval(model, processor, [[solid(0)], []], ["a red square", "a blue cross"], modality="video")


def test_non_finite_embeddings_are_rejected_rather_than_ranked_first(processor):
    model = LookupModel(processor, torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="non-finite image embeddings"):
        embed(model, processor, [solid(0)], "image")


def test_bad_data_and_files_are_rejected(tmp_path):
    (tmp_path / "images").mkdir()
    solid(0).save(tmp_path / "images" / "0.png")
    integer_labels = write_jsonl(tmp_path / "labels.jsonl", [{"image": "images/0.png", "label": 3}])
    with pytest.raises(ValueError, match="--class-names"):
        load_classification_data(integer_labels)
    folder = write_class_folders(tmp_path / "shapes", {"blue cross": 1, "green circle": 1, "red square": 1})
    (tmp_path / "two_names.txt").write_text("blue cross\ngreen circle\n")
    with pytest.raises(ValueError, match="1 of 3 labels are not among the 2 classes"):
        load_classification_data(folder, class_names=tmp_path / "two_names.txt")
    with pytest.raises(ValueError, match="holds no examples"):
        load_classification_data(Dataset.from_dict({"image": [], "label": []}))
    with pytest.raises(ValueError, match="limit must be at least 1"):
        load_retrieval_data(write_jsonl(tmp_path / "captions.jsonl", [{"image": "images/0.png", "text": "a"}]),
                            limit=0)
    with pytest.raises(FileNotFoundError, match="no templates file"):
        zero_shot_classifier(None, None, NAMES, tmp_path / "missing.txt")


# --- The command -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-moe-vie")
    torch.manual_seed(0)
    config = MoeVieConfig(**TINY_PRESET_CONFIG)
    MoeVieModel(config).save_pretrained(folder)
    make_moe_vie_processor(config).save_pretrained(folder)
    return folder


def eval_args(*argv):
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    return parser.parse_args([str(arg) for arg in argv])


def all_recalls(results, modality):
    return [value for direction in (f"{modality}_to_text", f"text_to_{modality}")
            for value in results[direction].values()]


def test_run_eval_end_to_end_on_a_saved_tiny_model(tmp_path, saved_model, capsys):
    generator = torch.Generator().manual_seed(0)
    folder = tmp_path / "shapes"
    for label in (0, 5, 10, 15, 6):
        (folder / SHAPES.class_names[label]).mkdir(parents=True)
        for i in range(2):
            SHAPES.draw(label, generator).save(folder / SHAPES.class_names[label] / f"{i}.png")
    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\na {}\n")
    assert run_eval(eval_args("--model", saved_model, "--data", folder, "--templates", templates, "--json",
                              "--batch-size", 4)) == 0
    results = json.loads(capsys.readouterr().out)
    assert (results["examples"], results["classes"], results["templates"]) == (10, 5, 2)
    assert all(0 <= results[key] <= 1 for key in ("top1", "top5", "mean_per_class_accuracy"))

    rows = []
    for index, example in enumerate(SHAPES.sample(4, generator, split="all")):
        example.image.save(tmp_path / f"{index}.png")
        rows += [{"image": f"{index}.png", "caption": example.caption},
                 {"image": f"{index}.png", "caption": example.caption.replace("a photo of ", "")}]
    table = write_jsonl(tmp_path / "captions.jsonl", rows)
    assert run_eval(eval_args("--model", saved_model, "--data", table, "--task", "retrieval", "--text-column",
                              "caption", "--json")) == 0
    results = json.loads(capsys.readouterr().out)
    assert (results["items"], results["captions"]) == (4, 8)
    assert all(0 <= value <= 1 for value in all_recalls(results, "image"))

    rows = []
    for index, (label, motion) in enumerate([(0, "left"), (9, "right"), (14, "up")]):
        frames, caption = SHAPES.clip(label, motion, num_frames=3, generator=generator)
        for t, frame in enumerate(frames):
            frame.save(tmp_path / f"clip{index}_{t}.png")
        rows.append({"frames": [f"clip{index}_{t}.png" for t in range(3)], "text": caption})
    videos = write_jsonl(tmp_path / "videos.jsonl", rows)
    assert run_eval(eval_args("--model", saved_model, "--data", videos, "--task", "video-retrieval",
                              "--resize-mode", "center_crop")) == 0
    printed = capsys.readouterr().out
    assert "video-text retrieval" in printed and re.search(r"video → text\s*│\s*3\s*│\s*3\s*│", printed)
    assert "note: text_to_video recall@5 left out: there are only 3 videos" in printed
    assert "note: video_to_text recall@10 left out: there are only 3 captions" in printed


def test_run_eval_prints_tables_and_rejects_options_of_another_task(tmp_path, saved_model, capsys):
    folder = write_class_folders(tmp_path / "shapes", {"red square": 1, "blue cross": 1})
    assert run_eval(eval_args("--model", saved_model, "--data", folder, "--limit", "2")) == 0
    printed = capsys.readouterr().out
    assert "zero-shot classification" in printed and re.search(r"2\s*│\s*2\s*│\s*8\s*│", printed)
    assert "per class" in printed and "red square" in printed
    assert "top-5 accuracy left out" in printed
    with pytest.raises(ValueError, match="--task zero-shot only"):
        run_eval(eval_args("--model", saved_model, "--data", folder, "--task", "retrieval", "--templates", "t.txt"))
    with pytest.raises(SystemExit):
        eval_args("--model", saved_model, "--data", folder, "--batch-size", "0")
