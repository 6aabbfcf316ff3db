"""Bringing your own data to `moezoo train` / `moezoo eval`: the formats the loaders promise (CSV, Parquet, webdataset,
image folders), images as they display (EXIF orientation, transparency, 16-bit greyscale), and data errors that name
the file, row or column to fix instead of failing deep in PIL, datasets or the processor, or going unnoticed."""

import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset
from PIL import Image

from moezoo.evaluation.moemb import load_corpus_task, mmeb_inputs
from moezoo.evaluation.moe_vie import load_retrieval_data
from moezoo.training.data import load_image_text_dataset, load_video_text_dataset
from moezoo.training.moemb import load_mmeb_dataset
from moezoo.training.mote import load_mote_dataset

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sideways_photo(path):
    """A JPEG stored 8 wide and 4 high, blue on the left, whose EXIF orientation (6) says to turn it a quarter
    clockwise to display it: upright it is 4 wide and 8 high, blue at the top."""
    image = Image.new("RGB", (8, 4), RED)
    image.paste(BLUE, (0, 0, 4, 4))
    exif = Image.Exif()
    exif[0x0112] = 6
    image.save(path, exif=exif.tobytes(), quality=100)
    return path


def assert_upright(image):
    assert image.size == (4, 8)
    assert np.abs(np.subtract(image.getpixel((2, 1)), BLUE)).max() < 8
    assert np.abs(np.subtract(image.getpixel((2, 6)), RED)).max() < 8


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (4, 4), RED).save(folder / "red.png")
    Image.new("RGB", (4, 4), BLUE).save(folder / "blue.png")
    return folder


# --- formats ---------------------------------------------------------------------------------------------------------


def test_csv_and_parquet_image_paths_are_relative_to_the_data_file(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # not the data's folder: paths must not resolve against the working directory
    rows = {"image": ["images/red.png", "images/blue.png"], "text": ["a red square", "a blue square"]}
    (tmp_path / "pairs.csv").write_text("image,text\n" + "".join(f"{i},{t}\n" for i, t in zip(*rows.values())))
    # Polars (and datasets, for every CSV) type string columns as large strings.
    pq.write_table(pa.table({key: pa.array(value, pa.large_string()) for key, value in rows.items()}),
                   tmp_path / "pairs.parquet")  # fmt: skip
    for name in ("pairs.csv", "pairs.parquet"):
        dataset = load_image_text_dataset(tmp_path / name)
        assert [example["image"].getpixel((0, 0)) for example in dataset] == [RED, BLUE], name
        assert dataset[1]["text"] == "a blue square"
    retrieval = load_retrieval_data(tmp_path / "pairs.csv")
    assert retrieval.captions == [["a red square"], ["a blue square"]]


def write_shard(path, images, pairs, text_suffix="txt"):
    """A webdataset shard of (image file in `images`, caption) pairs, keyed 0000, 0001, ..."""
    with tarfile.open(path, "w") as shard:
        for key, (image, caption) in enumerate(pairs):
            for name, data in ((f"{key:04d}.png", (images / image).read_bytes()),
                               (f"{key:04d}.{text_suffix}", caption.encode())):  # fmt: skip
                info = tarfile.TarInfo(name)
                info.size = len(data)
                shard.addfile(info, io.BytesIO(data))


def test_webdataset_caption_files_are_read_as_text(images, tmp_path):
    write_shard(tmp_path / "shard-0.tar", images, [("red.png", "a red square"), ("blue.png", "a bleu carré ☕")],
                text_suffix="caption")
    dataset = load_image_text_dataset(tmp_path / "shard-0.tar")
    assert [example["text"] for example in dataset] == ["a red square", "a bleu carré ☕"]


def test_retrieval_over_webdataset_shards_keeps_members_of_the_same_name_apart(images, tmp_path):
    """Member names repeat from shard to shard (0000.png in each): they name no file, so two shards' images were
    merged into one item with both captions."""
    write_shard(tmp_path / "shard-0.tar", images, [("red.png", "a red square")])
    write_shard(tmp_path / "shard-1.tar", images, [("blue.png", "a blue square")])
    data = load_retrieval_data(str(tmp_path / "shard-*.tar"))
    assert sorted(data.captions) == [["a blue square"], ["a red square"]]


# --- images as they display ------------------------------------------------------------------------------------------


def test_exif_rotated_photos_are_upright_in_every_format(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    sideways_photo(folder / "photo.jpg")
    write_jsonl(folder / "metadata.jsonl", [{"file_name": "photo.jpg", "text": "a photo"}])
    write_jsonl(tmp_path / "pairs.jsonl", [{"image": "photos/photo.jpg", "text": "a photo"}])
    assert_upright(load_image_text_dataset(folder)[0]["image"])  # datasets' image feature turns it
    assert_upright(load_image_text_dataset(tmp_path / "pairs.jsonl")[0]["image"])  # and so must a table of paths
    write_jsonl(tmp_path / "clips.jsonl", [{"frames": ["photos/photo.jpg"], "text": "a clip"}])
    assert_upright(load_video_text_dataset(tmp_path / "clips.jsonl")[0]["frames"][0])


def test_transparent_and_16_bit_images_keep_their_look(tmp_path):
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(tmp_path / "transparent.png")
    Image.new("LA", (4, 4), (0, 0)).save(tmp_path / "transparent_grey.png")
    Image.fromarray(np.full((4, 4), 32896, dtype=np.uint16)).save(tmp_path / "grey16.png")  # 16-bit mid-grey
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    names = ["transparent.png", "transparent_grey.png", "grey16.png", "cmyk.jpg"]
    write_jsonl(tmp_path / "pairs.jsonl", [{"image": name, "text": name} for name in names])
    pixels = [example["image"].getpixel((0, 0)) for example in load_image_text_dataset(tmp_path / "pairs.jsonl")]
    # Transparent pixels on white, as the processors composite in-memory images (not the black they hide).
    assert pixels[:2] == [WHITE, WHITE]
    assert pixels[2] == (128, 128, 128)  # PIL's own conversion clips 16-bit values: white
    assert np.abs(np.subtract(pixels[3], RED)).max() < 8


def test_unreadable_images_are_errors_naming_the_file(images, tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(images / "noise.png")
    png = (images / "noise.png").read_bytes()
    (images / "truncated.png").write_bytes(png[: len(png) // 2])  # the header is whole, the pixels are not
    write_jsonl(tmp_path / "pairs.jsonl", [{"image": "images/truncated.png", "text": "cut short"},
                                           {"image": "images/missing.png", "text": "gone"}])  # fmt: skip
    dataset = load_image_text_dataset(tmp_path / "pairs.jsonl")
    with pytest.raises(ValueError, match=r"cannot read the image .*truncated\.png: image file is truncated"):
        dataset[0]
    with pytest.raises(FileNotFoundError, match=r"no image file .*images/missing\.png"):
        dataset[1]


# --- data errors -----------------------------------------------------------------------------------------------------


def test_rows_without_an_image_or_a_caption_are_named(images, tmp_path):
    rows = [{"image": "images/red.png", "text": "a red square"}, {"image": None, "text": "no image"},
            {"image": "images/blue.png", "text": "  "}, {"image": "images/blue.png", "text": None}]  # fmt: skip
    with pytest.raises(ValueError, match=r"1 row\(s\) have an empty 'image' \(rows 1, counting from 0\)"):
        load_image_text_dataset(write_jsonl(tmp_path / "a.jsonl", rows))
    with pytest.raises(ValueError, match=r"2 row\(s\) have an empty 'caption' \(rows 2, 3, counting from 0\)"):
        load_image_text_dataset(write_jsonl(tmp_path / "b.jsonl", [{"path": r["image"] or "images/red.png",
                                                                    "caption": r["text"]} for r in rows]),
                                image_column="path", text_column="caption")  # fmt: skip


@pytest.mark.parametrize("content", ["", "\n\n", "image,text\n"], ids=["empty", "blank lines", "header only"])
def test_files_without_rows_say_so_in_every_loader(tmp_path, content):
    suffix = ".csv" if "," in content else ".jsonl"
    path = tmp_path / f"data{suffix}"
    path.write_text(content)
    for load in (load_image_text_dataset, load_mmeb_dataset, load_mote_dataset):
        with pytest.raises(ValueError, match=r"data\.(jsonl|csv) holds no examples"):
            load(path)


def test_a_malformed_json_lines_file_is_named_with_its_parse_error(tmp_path):
    (tmp_path / "pairs.jsonl").write_text('{"image": "a.png", "text": "a"}\n{"image": "b.png", "text": \n')
    with pytest.raises(ValueError, match=r"pairs\.jsonl is not a valid JSON file: .*JSON parse error"):
        load_image_text_dataset(tmp_path / "pairs.jsonl")


def test_mote_rows_without_a_target_are_named_and_frames_may_be_a_folder(tmp_path):
    (tmp_path / "clip").mkdir()
    sideways_photo(tmp_path / "clip" / "0.jpg")
    Image.new("RGB", (8, 4), RED).save(tmp_path / "clip" / "1.png")
    example = {"task": "step", "prompt": "What step?", "frames": "clip"}
    rows = [example | {"answer": "stir"}, example | {"responses": [{"frame": 1, "text": "stir"}]}]
    dataset = load_mote_dataset(write_jsonl(tmp_path / "ok.jsonl", rows))
    assert [len(row["frames"]) for row in dataset] == [2, 2]
    assert_upright(dataset[0]["frames"][0])
    # A file mixing offline examples and streams: a row with neither an answer nor responses.
    rows.append(example | {"answer": None, "responses": None})
    with pytest.raises(ValueError, match=r"1 row\(s\) have neither an answer nor responses \(rows 2,"):
        load_mote_dataset(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_mmeb_candidates_that_are_missing_or_empty_are_named_by_query():
    good = {"qry_text": "red", "tgt_text": ["a red thing", "a blue thing"], "tgt_img_path": ["", ""]}
    with pytest.raises(ValueError, match=r"query 1: tgt_text and tgt_img_path must be lists .* tgt_text=None"):
        mmeb_inputs(Dataset.from_list([good, good | {"tgt_text": None}]), None)
    with pytest.raises(ValueError, match="query 1: candidate 1 has no text, image or video"):
        mmeb_inputs(Dataset.from_list([good, good | {"tgt_text": ["a red thing", ""]}]), None)
    with pytest.raises(ValueError, match="query 0: its query has no text, image or video"):
        mmeb_inputs(Dataset.from_list([good | {"qry_text": ""}]), None)


def test_a_repeated_corpus_id_is_an_error_not_a_lower_score(tmp_path):
    # With "d0" twice, the qrels could mark only one copy relevant and a perfect model would lose NDCG.
    corpus = [{"id": "d0", "text": "red"}, {"id": "d1", "text": "blue"}, {"id": "d0", "text": "red"}]
    write_jsonl(tmp_path / "corpus.jsonl", corpus)
    write_jsonl(tmp_path / "query.jsonl", [{"id": "q0", "text": "which is red?"}])
    write_jsonl(tmp_path / "qrels.jsonl", [{"query_id": "q0", "corpus_id": "d0", "score": 1}])
    with pytest.raises(ValueError, match=r"corpus\.jsonl repeats the id\(s\) 'd0'"):
        load_corpus_task(tmp_path)
    write_jsonl(tmp_path / "corpus.jsonl", corpus[:2])
    write_jsonl(tmp_path / "qrels.jsonl", [{"query": "q0", "document": "d0", "score": 1}])
    with pytest.raises(ValueError, match=r"qrels\.jsonl has no column query_id, corpus_id"):
        load_corpus_task(tmp_path)
