"""The `moezoo` command as a user meets it: what its help shows, and what it refuses before doing any work."""

import json

import pytest

from conftest import run_moezoo


def test_convert_help_with_to_shows_the_options_of_its_converters():
    """Converter options are parsed only once the converter is known, so argparse's own --help never showed them."""
    result = run_moezoo("convert", "--to", "moezoo_toy", "--help")
    assert result.returncode == 0, result.stderr
    assert "--from SOURCE" in result.stdout  # the command's own options
    assert "toy-per-expert" in result.stdout and "--num-labels" in result.stdout and "stored in the config" in result.stdout


def test_bench_without_a_benchmark_shows_the_benchmarks():
    result = run_moezoo("bench")
    assert result.returncode == 2
    assert result.stdout.startswith("usage: moezoo bench") and "moe-layer" in result.stdout


def test_convert_refuses_a_taken_out_before_reading_the_source(tmp_path):
    """A conversion can download and convert for hours: a taken --out must fail first, not after it."""
    source = tmp_path / "source"
    source.mkdir()  # a toy per-expert source whose weights file is missing: converting it would fail
    (source / "config.json").write_text(json.dumps({"model_type": "moezoo_toy_per_expert", "hidden_size": 16}))
    (tmp_path / "taken").mkdir()
    result = run_moezoo("convert", "--to", "moezoo_toy", "--from", source, "--out", tmp_path / "taken")
    assert result.returncode == 2
    # one line, not wrapped by rich at 80 columns: the path can be copied from a log
    assert f"error: {tmp_path / 'taken'} already exists; choose another --out or pass --overwrite\n" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "taken"]


def _never(*args, **kwargs):
    raise AssertionError("the work started although --out was taken")


def test_create_and_export_refuse_a_taken_out_before_building_or_loading(toy_registered, tmp_path, monkeypatch):
    from moezoo import zoo
    from moezoo.hub import export

    (tmp_path / "taken").mkdir()
    monkeypatch.setattr(zoo, "build_config", _never)
    with pytest.raises(FileExistsError, match="taken already exists"):
        zoo.create_from_preset("tiny-moezoo_toy", tmp_path / "taken")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": toy_registered.name}))
    monkeypatch.setattr(export, "load_model_checked", _never)
    with pytest.raises(FileExistsError, match="taken already exists"):
        export.export_folder(model, tmp_path / "taken")


def test_export_and_push_say_what_is_wrong_with_the_folder(tmp_path):
    from moezoo.hub.export import export_folder
    from moezoo.hub.push import check_exported

    with pytest.raises(FileNotFoundError, match="nowhere does not exist; give a local model folder"):
        export_folder(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="has no config.json; `moezoo export` takes a model folder"):
        export_folder(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist; push takes"):
        check_exported(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "auto_map": {"AutoModel": "modeling_x.X"}}))
    with pytest.raises(ValueError, match=r"not an exported folder \(modeling_x.py, README.md missing\)"):
        check_exported(tmp_path)


def test_names_and_paths_with_brackets_are_printed_as_they_are(tmp_path, capsys):
    """rich reads "[...]" as markup: it dropped "[kie]" from messages and failed with a traceback on "[/x]"."""
    unknown = run_moezoo("create", "[/tiny] [kie]", "--out", tmp_path / "x")
    assert unknown.returncode == 2 and "error: unknown preset '[/tiny] [kie]'" in unknown.stderr
    created = run_moezoo("create", "tiny-moezoo_toy", "--out", tmp_path / "runs[/a]")
    assert created.returncode == 0, created.stderr
    assert f"to {tmp_path / 'runs[/a]'}" in " ".join(created.stdout.split())
    from moezoo.terminal import print_table

    print_table("t", ["source", "converter"], [["data/[/raw] [kie]", "x"]])
    assert "data/[/raw] [kie]" in capsys.readouterr().out
