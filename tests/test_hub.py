"""Export, model cards and the Hub round trip, proven on the toy architecture of tests/toy_arch.

The same machinery serves every architecture; tests/test_architectures_hub.py repeats the round trip for each
registered one.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from moezoo.hub.flatten import FlattenError, flatten_modules

from conftest import (
    TESTS, TOY_ENV, free_port, run_moezoo, run_moezoo_in_this_process, run_python, run_two_processes,
)


@pytest.fixture(scope="module")
def toy_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    created = run_moezoo("create", "tiny-moezoo_toy", "--out", root / "created", "--seed", "3")
    assert created.returncode == 0, created.stderr
    exported = run_moezoo("export", root / "created", "--out", root / "exported", "--repo-id", "zoo/toy")
    assert exported.returncode == 0, exported.stderr
    return root / "created", root / "exported"


def state_dict_of(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_exported_folder_is_flat_and_complete(toy_folders):
    _, exported = toy_folders
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "README.md",
            "moezoo.json", "configuration_toy.py", "modeling_toy.py", "processing_toy.py",
            "modeling_moe_block.py", "kernels_sorted_experts.py"} <= names
    assert not any(p.is_dir() for p in exported.iterdir())
    for code_file in exported.glob("*.py"):
        text = code_file.read_text()
        assert not re.search(r"^\s*(from|import)\s+(moezoo|toy_arch)\b", text, re.M), code_file.name
        assert not re.search(r"^\s*from\s+\.\.", text, re.M), code_file.name
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_toy.ToyMoeConfig",
        "AutoModel": "modeling_toy.ToyMoeModel",
        "AutoModelForSequenceClassification": "modeling_toy.ToyMoeForSequenceClassification",
    }
    processor_config = json.loads((exported / "processor_config.json").read_text())
    assert processor_config["auto_map"] == {"AutoProcessor": "processing_toy.ToyMoeProcessor"}
    assert processor_config["image_processor"]["auto_map"] == {
        "AutoImageProcessor": "processing_toy.ToyMoeImageProcessor"}


def test_a_package_flattens_module_by_module_and_its_init_is_never_imported_from(tmp_path, monkeypatch):
    """A family whose modeling code is a package (as `moezoo.modeling.mote`): each module becomes one flat file named
    after its dotted path, its imports within the package and up to its parent become flat ones, and no package
    `__init__` is copied, so importing names from one is refused by name rather than lost in the flat folder."""
    sources = {
        "zoo_pkg/__init__.py": "SHARED = 1\n",
        "zoo_pkg/core.py": "def helper():\n    return 2\n",
        "zoo_pkg/family/__init__.py": '"""One model family, one module per member."""\n',
        "zoo_pkg/family/common.py": "from ..core import helper\n\nBASE = helper()\n",
        "zoo_pkg/family/member.py": "from .common import BASE\n\nVALUE = BASE + 1\n",
        "zoo_pkg/family/from_init.py": "from .. import SHARED\n",
    }
    for name, source in sources.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text(source)
    monkeypatch.syspath_prepend(tmp_path / "src")
    flat = tmp_path / "flat_family"

    names = flatten_modules(["zoo_pkg.family.member"], flat)
    assert names == {"zoo_pkg.family.member": "family_member", "zoo_pkg.family.common": "family_common",
                     "zoo_pkg.core": "core"}
    assert sorted(path.name for path in flat.iterdir()) == ["core.py", "family_common.py", "family_member.py"]
    assert (flat / "family_member.py").read_text().startswith("from .family_common import BASE\n")
    assert (flat / "family_common.py").read_text().startswith("from .core import helper\n")
    run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from flat_family.family_member import VALUE
        assert VALUE == 3, VALUE
    """)
    with pytest.raises(FlattenError, match="zoo_pkg is a package: .* not from a package's __init__"):
        flatten_modules(["zoo_pkg.family.from_init"], tmp_path / "refused")


def test_fresh_process_without_moezoo_loads_every_auto_class(toy_folders):
    created, exported = toy_folders
    result = run_python(f"""
        import numpy as np, torch
        from PIL import Image
        from safetensors.torch import load_file
        from transformers import (AutoConfig, AutoImageProcessor, AutoModel, AutoModelForSequenceClassification,
                                  AutoProcessor)
        import importlib.util
        assert importlib.util.find_spec("moezoo") is None, "moezoo should not be importable here"
        path = {str(exported)!r}
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        model = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
        AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True)
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
        AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model)
        assert model.config._experts_implementation == "moezoo"
        reference = load_file({str(created / "model.safetensors")!r})
        state = model.state_dict()
        assert set(reference) == set(state)
        assert all(torch.equal(reference[k], state[k]) for k in reference)
        inputs = processor(text=["a photo of a cat", "red"], images=[Image.fromarray(np.zeros((9, 7, 3), np.uint8))] * 2,
                           return_tensors="pt", padding=True)
        with torch.no_grad():
            print(tuple(model(**inputs).pooler_output.shape))
    """, without_moezoo=True)
    assert "(2, 16)" in result.stdout


@pytest.mark.parametrize("triton_installed", [True, False])
def test_remote_code_runs_the_triton_experts_and_does_not_require_triton(toy_folders, triton_installed):
    """The exported code carries the Triton kernels (run here in the interpreter, tests/conftest.py); where triton is
    missing the folder still loads, and `moezoo_triton` hands its calls to `moezoo`."""
    _, exported = toy_folders
    assert (exported / "kernels_triton_kernels.py").is_file()
    result = run_python(f"""
        import sys
        if not {triton_installed}:
            sys.modules["triton"] = None
        import torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()
        ids = torch.tensor([[3, 5, 7, 2, 9, 4]])
        outputs = {{}}
        for implementation in ("eager", "moezoo_triton"):
            model.set_experts_implementation(implementation)
            with torch.no_grad():
                outputs[implementation] = model(input_ids=ids).last_hidden_state
        kernels_loaded = any(name.endswith("kernels_triton_kernels") for name in sys.modules)
        print(kernels_loaded, float((outputs["eager"] - outputs["moezoo_triton"]).abs().max()))
    """, without_moezoo=True)
    kernels_loaded, max_diff = result.stdout.split()
    assert kernels_loaded == str(triton_installed)
    assert float(max_diff) < 1e-5


def test_installed_moezoo_loads_without_remote_code(toy_folders):
    _, exported = toy_folders
    result = run_python(f"""
        import moezoo
        from transformers import AutoModel, AutoProcessor
        model = AutoModel.from_pretrained({str(exported)!r})
        processor = AutoProcessor.from_pretrained({str(exported)!r})
        print(type(model).__module__, type(processor).__module__)
    """, env=TOY_ENV)
    assert result.stdout.split() == ["toy_arch.modeling_toy", "toy_arch.processing_toy"]


def test_model_card_parses_and_its_usage_snippet_runs(toy_folders):
    _, exported = toy_folders
    card = ModelCard.load(exported / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "feature-extraction"
    assert {"mixture-of-experts", "moezoo_toy"} <= set(data["tags"])
    snippet = re.search(r"```python\n(.*?)```", card.text, re.S).group(1)
    assert '"zoo/toy"' in snippet
    # Run it against the local folder, in a process where moezoo cannot be imported.
    result = run_python(snippet.replace('"zoo/toy"', repr(str(exported))), without_moezoo=True)
    assert "torch.Size([1, 16])" in result.stdout


def test_large_models_are_sharded(toy_folders, tmp_path):
    created, _ = toy_folders
    result = run_moezoo("export", created, "--out", tmp_path / "sharded", "--max-shard-size", "2KB")
    assert result.returncode == 0, result.stderr
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert state_dict_of(tmp_path / "sharded").keys() == state_dict_of(created).keys()
    run_python(f"""
        from transformers import AutoModel
        AutoModel.from_pretrained({str(tmp_path / "sharded")!r}, trust_remote_code=True)
    """, without_moezoo=True)


# --- bad input ---------------------------------------------------------------------------------------------------


def broken_copy(created, tmp_path, edit_state=None, edit_config=None):
    folder = tmp_path / "broken"
    folder.mkdir()
    for path in created.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    if edit_state:
        state = load_file(folder / "model.safetensors")
        edit_state(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "edit_state,edit_config,message",
    [
        (lambda s: s.pop("blocks.1.experts.down_proj"), None, "missing keys .*blocks.1.experts.down_proj"),
        (lambda s: s.update(extra_head=torch.zeros(2)), None, "unexpected keys .*extra_head"),
        (None, lambda c: c.update(num_experts=6), "blocks.0.experts"),
        (None, lambda c: c.update(model_type="not_a_zoo_model"), r"holds a non-moezoo model \(model_type 'not_a_zoo_model'\)"),
    ],
    ids=["missing", "extra", "config-mismatch", "unknown-architecture"],
)
def test_export_refuses_broken_folders_and_leaves_nothing_behind(toy_folders, toy_registered, tmp_path, capfd,
                                                                 edit_state, edit_config, message):
    created, _ = toy_folders
    folder = broken_copy(created, tmp_path, edit_state, edit_config)
    result = run_moezoo_in_this_process(capfd, "export", folder, "--out", tmp_path / "out")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert re.search(message, " ".join(result.stderr.split())), result.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_export_of_a_truncated_checkpoint_says_so_and_leaves_nothing_behind(toy_folders, toy_registered, tmp_path,
                                                                            capfd):
    """A partly downloaded safetensors file: a message naming the file, not the reader's traceback."""
    created, _ = toy_folders
    folder = broken_copy(created, tmp_path)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    result = run_moezoo_in_this_process(capfd, "export", folder, "--out", tmp_path / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert f"{folder / 'model.safetensors'} is not a complete safetensors file" in err and "incomplete" in err, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path):
    from moezoo.hub.folders import atomic_output_dir

    target = tmp_path / "target"
    target.write_text("keep me")
    with pytest.raises(FileExistsError, match="target is a file, not a folder"):
        with atomic_output_dir(target, overwrite=True):
            pass
    assert target.read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["target"]


def test_output_folders_take_the_umask_permissions(tmp_path):
    """mkdtemp's 0700 would make every written model private to its owner on a shared machine."""
    from moezoo.hub.folders import atomic_output_dir

    previous = os.umask(0o022)
    try:
        with atomic_output_dir(tmp_path / "out") as staging:
            (staging / "config.json").write_text("{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staging_folders_of_killed_processes_are_removed_by_the_next_run(tmp_path):
    """A SIGKILL (or the out-of-memory killer) leaves its staging folder: the next write beside it removes it, while a
    live process's staging folder and another host's are kept."""
    from moezoo.hub.folders import atomic_output_dir

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host = int(child.stdout), socket.gethostname()
    killed = tmp_path / f".out.partial-{host}-{dead_pid}-0badc0de"
    live = tmp_path / f".out.partial-{host}-{os.getpid()}-00c0ffee"
    elsewhere = tmp_path / f".out.partial-another-host-{dead_pid}-feedf00d"
    for folder in (killed, live, elsewhere):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    with atomic_output_dir(tmp_path / "out") as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, elsewhere.name])


def test_a_corrupt_config_is_named(tmp_path):
    from moezoo.hub.sources import model_folder

    (tmp_path / "config.json").write_text("{\n  oops")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON .*save the model again"):
        model_folder(tmp_path, "`moezoo export`")


def test_commands_refuse_to_overwrite_without_asking(toy_folders, toy_registered, tmp_path, capfd):
    created, _ = toy_folders
    (tmp_path / "taken").mkdir()
    result = run_moezoo_in_this_process(capfd, "export", created, "--out", tmp_path / "taken")
    assert result.returncode == 2 and "--overwrite" in result.stderr
    overwritten = run_moezoo_in_this_process(capfd, "export", created, "--out", tmp_path / "taken", "--overwrite")
    assert overwritten.returncode == 0
    assert (tmp_path / "taken" / "config.json").is_file()


# --- push and pull ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(tmp_path):
    server = subprocess.Popen([sys.executable, str(TESTS / "fake_hub.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(server.stdout.readline())
        yield {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_dummy", "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_DISABLE_XET": "1"}
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_push_then_pull_in_a_fresh_process_then_offline(toy_folders, fake_hub):
    created, exported = toy_folders
    pushed = run_moezoo("push", exported, "zoo/toy", env=fake_hub)
    assert pushed.returncode == 0, pushed.stderr
    load = f"""
        import numpy as np, torch
        from PIL import Image
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoProcessor
        model = AutoModel.from_pretrained("zoo/toy", trust_remote_code=True)
        processor = AutoProcessor.from_pretrained("zoo/toy", trust_remote_code=True)
        reference = load_file({str(created / "model.safetensors")!r})
        assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())
        assert type(model.config) is model.config_class
        inputs = processor(text=["a cat"], images=[Image.fromarray(np.zeros((8, 8, 3), np.uint8))], return_tensors="pt")
        print("pooled", tuple(model(**inputs).pooler_output.shape))
    """
    assert "pooled (1, 16)" in run_python(load, env=fake_hub, without_moezoo=True).stdout
    offline = run_python(load, env=fake_hub | {"HF_HUB_OFFLINE": "1"}, without_moezoo=True)
    assert "pooled (1, 16)" in offline.stdout


def test_push_to_a_branch(toy_folders, fake_hub):
    _, exported = toy_folders
    assert run_moezoo("push", exported, "zoo/branchy", "--revision", "experiment", env=fake_hub).returncode == 0
    run_python("""
        from transformers import AutoModel
        AutoModel.from_pretrained("zoo/branchy", revision="experiment", trust_remote_code=True)
    """, env=fake_hub, without_moezoo=True)


def test_push_without_a_reachable_endpoint_fails_clearly(toy_folders, tmp_path):
    _, exported = toy_folders
    port = free_port()
    result = run_moezoo("push", exported, "zoo/toy", env={"HF_ENDPOINT": f"http://127.0.0.1:{port}",
                                                          "HF_TOKEN": "hf_dummy", "HF_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_push_refuses_a_folder_that_was_not_exported(toy_folders, fake_hub):
    created, _ = toy_folders
    result = run_moezoo("push", created, "zoo/toy", env=fake_hub)
    assert result.returncode == 2 and "moezoo export" in result.stderr


@pytest.mark.slow
def test_export_repairs_a_folder_saved_after_fsdp_training(toy_folders, tmp_path):
    """platform.md §8.3: saving a remote-code model after native FSDP2 copies torch's wrapper files and points
    auto_map at `_fsdp_init.FSDP...`; exporting that folder gives one that loads again."""
    _, exported = toy_folders
    script = tmp_path / "train.py"
    script.write_text(f"""
import sys, torch
sys.modules["moezoo"] = None
from transformers import AutoModel, AutoProcessor, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig
model = AutoModel.from_pretrained({str(exported)!r}, trust_remote_code=True,
                                  distributed_config=DistributedConfig(fsdp_size=2))
processor = AutoProcessor.from_pretrained({str(exported)!r}, trust_remote_code=True)
class PooledNormTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).pooler_output.pow(2).mean()
data = [{{"input_ids": torch.randint(0, 12, (6,))}} for _ in range(8)]
args = TrainingArguments(output_dir={str(tmp_path / "checkpoints")!r}, per_device_train_batch_size=2, max_steps=2,
                         use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
trainer = PooledNormTrainer(model=model, args=args, train_dataset=data, processing_class=processor)
trainer.train()
trainer.save_model({str(tmp_path / "trained")!r})
""")
    run_two_processes(script, timeout=300)
    trained = tmp_path / "trained"
    assert json.loads((trained / "config.json").read_text())["auto_map"]["AutoModel"].startswith("_fsdp")
    assert run_moezoo("export", trained, "--out", tmp_path / "repaired").returncode == 0
    run_python(f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(tmp_path / "repaired")!r}, trust_remote_code=True)
        trained = load_file({str(trained / "model.safetensors")!r})
        assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    """, without_moezoo=True)


@pytest.mark.slow
def test_an_installed_wheel_carries_the_model_cards_and_the_native_kernels(tmp_path):
    """`pip install moezoo` (not editable) must still render model cards at export and build its C kernels."""
    import shutil
    import zipfile

    # Built from a copy: setuptools writes its build/ folder into the tree it builds.
    source = tmp_path / "source"
    for name in ("src", "model_cards"):
        shutil.copytree(TESTS.parent / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(TESTS.parent / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("moezoo-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    result = run_python(f"""
        import moezoo
        from moezoo.hub.cards import model_cards_dir, template_path
        from moezoo.registry import get_architecture, load_catalogue
        site = {str(tmp_path / "site")!r}
        assert moezoo.__file__.startswith(site), moezoo.__file__
        load_catalogue()
        assert template_path(get_architecture("moe_vie")).resolve().is_relative_to(site)
        print(sorted(path.name for path in model_cards_dir().iterdir()))
        print((model_cards_dir().parent / "kernels" / "native_experts.c").is_file())
    """, env={"PYTHONPATH": str(tmp_path / "site")})
    templates = sorted(path.name for path in (TESTS.parent / "model_cards").iterdir())
    assert result.stdout.split("\n")[:2] == [str(templates), "True"]
