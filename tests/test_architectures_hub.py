"""Issue 3's acceptance test, for every architecture in moezoo's catalogue:

`moezoo create` of its tiny preset then `moezoo export`, then a fresh process in which `import moezoo` fails loads the folder
with AutoConfig, every Auto model class the architecture serves and AutoProcessor, gets weights identical to the
created model, and runs the model card's usage example (a forward on the processor's output for synthetic input).
"""

import json
import re

import pytest
from huggingface_hub import ModelCard

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.registry import ARCHITECTURES, PRESETS, ZOO_ARCHITECTURES

from conftest import run_moezoo, run_python


def tiny_preset(architecture: str) -> str:
    return next(p.name for p in PRESETS.values() if p.architecture == architecture and p.name.startswith("tiny-"))


def test_every_architecture_has_a_tiny_preset():
    assert ZOO_ARCHITECTURES
    for name in ZOO_ARCHITECTURES:
        assert tiny_preset(name), name


@pytest.mark.parametrize("architecture", ZOO_ARCHITECTURES)
def test_create_export_and_load_without_moezoo(architecture, tmp_path):
    entry = ARCHITECTURES[architecture]
    created, exported = tmp_path / "created", tmp_path / "exported"
    assert run_moezoo("create", tiny_preset(architecture), "--out", created).returncode == 0
    result = run_moezoo("export", created, "--out", exported, "--repo-id", f"zoo/tiny-{architecture}")
    assert result.returncode == 0, result.stderr

    card = ModelCard.load(exported / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == entry.pipeline_tag
    assert {"mixture-of-experts", architecture} <= set(card.data.tags)
    usage = re.search(r"```python\n(.*?)```", card.text, re.S).group(1)
    auto_classes = list(entry.models) + (["AutoProcessor"] if entry.processor else ["AutoTokenizer"])
    load_all = "\n".join(
        f"transformers.{auto}.from_pretrained(path, trust_remote_code=True)" for auto in auto_classes
    )
    run_python(f"""
        import torch, transformers
        from safetensors.torch import load_file
        path = {str(exported)!r}
        try:
            import moezoo
            raise SystemExit("moezoo must not be importable here")
        except ImportError:
            pass
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
        assert config.model_type == {architecture!r}
        {load_all.replace(chr(10), chr(10) + "        ")}
        model = transformers.{next(iter(entry.models))}.from_pretrained(path, trust_remote_code=True)
        created = load_file({str(created / "model.safetensors")!r})
        state = transformers.core_model_loading.revert_weight_conversion(model, model.state_dict())  # as saved
        tied = dict(getattr(model, "_tied_weights_keys", None) or {{}})  # tied copies are not stored
        assert set(created) <= set(state) and set(state) - set(created) <= set(tied), set(created) ^ set(state)
        assert all(torch.equal(created[key], state[key]) for key in created)
        assert all(torch.equal(state[copy], state[source]) for copy, source in tied.items() if copy not in created)
    """, without_moezoo=True)
    run_python(usage.replace(f'"zoo/tiny-{architecture}"', repr(str(exported))), without_moezoo=True)

    # With moezoo installed, the same folder loads moezoo's own classes, no remote code involved.
    local = run_python(f"""
        import moezoo, transformers
        model = transformers.{next(iter(entry.models))}.from_pretrained({str(exported)!r})
        print(type(model).__module__)
    """)
    assert local.stdout.strip().startswith("moezoo.modeling.")
    assert json.loads((exported / "moezoo.json").read_text())["preset"] == tiny_preset(architecture)
