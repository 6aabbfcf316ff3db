"""Issue 3's acceptance test, for every architecture in moezoo's catalogue:

`moezoo create` of its tiny preset then `moezoo export`, then a fresh process in which `import moezoo` fails loads the folder
with AutoConfig, every Auto model class the architecture serves (AutoModel always among them, as for transformers' own
models) and AutoProcessor, gets weights identical to the created model, and runs the model card's usage example (a
forward on the processor's output for synthetic input).

Starting Python with torch and transformers costs more than the tiny models, so every architecture shares two fresh
processes (a module fixture) instead of five of its own: one runs the `moezoo` command's entry point for each and
loads each export with moezoo imported; the other, without moezoo, checks each export. Each records its failures by
architecture, and each architecture's test reports its own.
"""

import json
import re
import textwrap

import pytest
from huggingface_hub import ModelCard

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.registry import ARCHITECTURES, PRESETS, ZOO_ARCHITECTURES

from conftest import TOY_ENV, run_python


def tiny_preset(architecture: str) -> str:
    return next(p.name for p in PRESETS.values() if p.architecture == architecture and p.name.startswith("tiny-"))


def test_every_architecture_has_a_tiny_preset():
    assert ZOO_ARCHITECTURES
    for name in ZOO_ARCHITECTURES:
        assert tiny_preset(name), name


# Both children start with `root = Path(...)`, the folder that holds cases.json; they write their results there.
# `main` is what the `moezoo` command runs; each command's output is kept with its architecture. Then, as a user who
# installed moezoo would, the export loads moezoo's own classes, no remote code involved.
CREATE_AND_EXPORT = textwrap.dedent("""
    import contextlib, io, json, traceback
    import transformers
    from moezoo.cli import main

    cases, records = json.loads((root / "cases.json").read_text()), {}
    for case in cases:
        record = records[case["architecture"]] = {}
        output = io.StringIO()
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                record["create"] = main(["create", case["preset"], "--out", case["created"]])
                record["export"] = main(["export", case["created"], "--out", case["exported"],
                                         "--repo-id", case["repo_id"]])
                model = getattr(transformers, case["model_class"]).from_pretrained(case["exported"])
                record["module"] = type(model).__module__
                record["auto_model_module"] = type(transformers.AutoModel.from_pretrained(case["exported"])).__module__
        except Exception:
            record["error"] = traceback.format_exc()
        record["output"] = output.getvalue()
    (root / "records.json").write_text(json.dumps(records))
""")

# Each export's folder has its own name, so transformers gives its remote code its own modules.
LOAD_WITHOUT_MOEZOO = textwrap.dedent("""
    import json, traceback
    import torch, transformers
    from safetensors.torch import load_file
    try:
        import moezoo
        raise SystemExit("moezoo must not be importable here")
    except ImportError:
        pass

    def check(case):
        path = case["exported"]
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
        assert config.model_type == case["architecture"], config.model_type
        assert "AutoModel" in config.auto_map, config.auto_map
        for auto in case["auto_classes"]:
            getattr(transformers, auto).from_pretrained(path, trust_remote_code=True)
        model = getattr(transformers, case["model_class"]).from_pretrained(path, trust_remote_code=True)
        created = load_file(case["created"] + "/model.safetensors")
        state = transformers.core_model_loading.revert_weight_conversion(model, model.state_dict())  # as saved
        tied = dict(getattr(model, "_tied_weights_keys", None) or {})  # tied copies are not stored
        assert set(created) <= set(state) and set(state) - set(created) <= set(tied), set(created) ^ set(state)
        assert all(torch.equal(created[key], state[key]) for key in created)
        assert all(torch.equal(state[copy], state[source]) for copy, source in tied.items() if copy not in created)
        exec(compile(case["usage"], "the model card's usage example", "exec"), {"__name__": "__main__"})

    failures = {}
    for case in json.loads((root / "cases.json").read_text()):
        try:
            check(case)
        except Exception:
            failures[case["architecture"]] = traceback.format_exc()
    (root / "failures.json").write_text(json.dumps(failures))
""")


@pytest.fixture(scope="module")
def zoo(request, tmp_path_factory) -> dict[str, dict]:
    """For each architecture whose test runs: its folders, the commands' exit codes and output, the module of the
    class transformers picks with moezoo imported, and the failure (a traceback) of the checks without moezoo."""
    selected = [item.callspec.params["architecture"] for item in request.session.items
                if getattr(item, "function", None) is test_create_export_and_load_without_moezoo]  # fmt: skip
    root = tmp_path_factory.mktemp("zoo")
    cases = [{
        "architecture": architecture, "preset": tiny_preset(architecture), "repo_id": f"zoo/tiny-{architecture}",
        "created": str(root / f"created-{architecture}"), "exported": str(root / f"exported-{architecture}"),
        "model_class": next(iter(ARCHITECTURES[architecture].models)),
    } for architecture in selected]  # fmt: skip
    in_root = f"from pathlib import Path\nroot = Path({str(root)!r})\n"
    (root / "cases.json").write_text(json.dumps(cases))
    run_python(in_root + CREATE_AND_EXPORT, env=TOY_ENV, timeout=1200)
    records = json.loads((root / "records.json").read_text())
    exported = [case for case in cases if records[case["architecture"]].get("export") == 0]
    for case in exported:
        entry = ARCHITECTURES[case["architecture"]]
        card = ModelCard.load(f"{case['exported']}/README.md")
        usage = re.search(r"```python\n(.*?)```", card.text, re.S).group(1)
        case["usage"] = usage.replace(f'"{case["repo_id"]}"', repr(case["exported"]))
        case["auto_classes"] = list(entry.models) + (["AutoProcessor"] if entry.processor else ["AutoTokenizer"])
    (root / "cases.json").write_text(json.dumps(exported))
    run_python(in_root + LOAD_WITHOUT_MOEZOO, without_moezoo=True, timeout=1200)
    failures = json.loads((root / "failures.json").read_text())
    return {case["architecture"]: {**case, **records[case["architecture"]],
                                   "without_moezoo": failures.get(case["architecture"])} for case in cases}  # fmt: skip


@pytest.mark.parametrize("architecture", ZOO_ARCHITECTURES)
def test_create_export_and_load_without_moezoo(architecture, zoo):
    entry, record = ARCHITECTURES[architecture], zoo[architecture]
    assert record.get("create") == 0 and record.get("export") == 0, record["output"] + record.get("error", "")
    exported = record["exported"]

    card = ModelCard.load(f"{exported}/README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == entry.pipeline_tag
    assert {"mixture-of-experts", architecture} <= set(card.data.tags)
    assert record["without_moezoo"] is None, record["without_moezoo"]

    # With moezoo installed, the same folder loads moezoo's own classes, no remote code involved.
    assert record.get("module", "").startswith("moezoo.modeling."), record.get("error", record.get("module"))
    assert record["auto_model_module"].startswith("moezoo.modeling."), record["auto_model_module"]
    assert "AutoModel" in json.loads(open(f"{exported}/config.json").read())["auto_map"]
    assert json.loads(open(f"{exported}/moezoo.json").read())["preset"] == tiny_preset(architecture)
