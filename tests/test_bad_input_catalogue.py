"""The bad-input catalogue of the `moezoo` command: for every subcommand, the mistakes people make (missing, empty,
corrupt, wrong-architecture and wrong-format inputs, Hub ids offline or with no network, interrupts) each end in
one error line on stderr naming what to fix, a non-zero exit status, no traceback, within seconds, and no output
left behind.

One table, `CASES`. Most cases run `moezoo.cli.main` in this process: a fresh interpreter costs seconds of imports per
case, and an exception escaping `main` (what would print a traceback) fails the case just the same. "Offline" sets
huggingface_hub's HF_HUB_OFFLINE and "unreachable" points HF_ENDPOINT at a closed local port (no network, whatever
the machine has); the Hub cache is an empty folder. The cases that only a real process shows (the environment read at
import, signals) run the command itself (`process=True`).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
import torch
from PIL import Image

from conftest import free_port, run_moezoo, run_python
from moe_vie_reference import make_official_state_dict, official_model_config
from moezoo import cli
from moezoo.zoo import create_from_preset
from test_hub import fake_hub  # noqa: F401 (a fixture)


# Generous bounds: the errors come within seconds. Before the fixes, a Hub id without a network took about a minute of
# retries, a paper-scale preset offline four. A fresh process adds its imports, 5 to 40 s on a busy two-core machine.
SECONDS, SECONDS_IN_A_FRESH_PROCESS = 30, 90


@dataclass(frozen=True)
class Case:
    id: str
    argv: str  # the command line after `moezoo`, with {name} for the paths of the `inputs` fixture
    error: str  # a regular expression the error line matches
    hub: str | None = None  # "offline" (HF_HUB_OFFLINE=1) or "unreachable" (HF_ENDPOINT at a closed port)
    absent: str | None = None  # what the error must not say (advice that does not apply to this command)
    process: bool = False  # run as a fresh process (for HF_HUB_OFFLINE read at import)


def offline(what: str) -> str:
    """The error for `what` (e.g. "the model org/name") needed from the Hub with HF_HUB_OFFLINE=1 set."""
    return re.escape(what) + r" is neither a local path nor in the Hub cache, and HF_HUB_OFFLINE is set; .*`hf download"


def unreachable(what: str) -> str:
    """The error for `what` needed from a Hub that does not answer."""
    return r"cannot reach the Hub at http://127\.0\.0\.1:\d+ to download " + re.escape(what) + " "


TAKEN = r"already exists; choose another --out or pass --overwrite"
CORRUPT = r"model\.safetensors is not a complete safetensors file \(corrupt or cut short"
CLIP = "CLIP's tokenizer openai/clip-vit-base-patch32"
TRAIN_VIE = "train moe_vie --data {captions} --out out --batch-size 4 --model"
EVAL_VIE = "eval moe_vie --task retrieval --data {captions} --model"
TRAIN_MOEMB = "train moemb --data {captions} --out out --model"
EVAL_MOEMB = "eval moemb --benchmark mmeb --data {captions} --model"
TRAIN_MOTE = "train mote --data {captions} --out out --model"
DENSE_EXPERT = "--add-expert new --init-from dense --base-model org/dense"

CASES = [
    # list
    Case("list-extra-argument", "list --jsn", r"unrecognized arguments: --jsn"),
    # create
    Case("create-unknown-preset", "create tiny-moe-vie --out out", r"unknown preset 'tiny-moe-vie'; `moezoo list`"),
    Case("create-taken-out", "create tiny-moe_vie --out {vie}", TAKEN),
    Case("create-out-is-a-file", "create tiny-moe_vie --out {captions}", r"captions\.jsonl is a file, not a folder"),
    Case("create-moe-vie-offline", "create moe-vie-b16-224 --out out", offline(CLIP), hub="offline",
         absent="--tokenizer", process=True),
    Case("create-moe-vie-unreachable", "create moe-vie-b16-224 --out out", unreachable(CLIP), hub="unreachable",
         absent="--tokenizer"),
    Case("create-moemb-offline", "create moemb-a3b --out out", offline("Qwen3.5's tokenizer Qwen/Qwen3.5-35B-A3B"),
         hub="offline", absent="--tokenizer"),
    Case("create-mote-unreachable", "create glm-ocr-mote-0.9b-2e --out out",
         unreachable("the tokenizer zai-org/GLM-OCR"), hub="unreachable"),
    # convert
    Case("convert-missing-source", "convert --to moe_vie --from ./nope --out out",
         r"the source \./nope does not exist; give --from a local folder or file, or a Hub repo id"),
    Case("convert-hub-source-offline", "convert --to moe_vie --from org/nope --out out", offline("the source org/nope"),
         hub="offline"),
    Case("convert-hub-source-unreachable", "convert --to moe_vie --from org/nope --out out",
         unreachable("the source org/nope"), hub="unreachable"),
    Case("convert-empty-source", "convert --to moe_vie --from {empty} --out out", r"cannot tell what .* is: no config"),
    Case("convert-wrong-format", "convert --to moe_vie --from {vie} --out out",
         r"no moe_vie converter takes a source of type 'moe_vie'"),
    Case("convert-corrupt-source", "convert --to moe_vie --from {corrupt_siglip} --out out", CORRUPT),
    Case("convert-tokenizer-offline", "convert --to moe_vie --from {official} --out out",
         offline(CLIP).replace("; ", "; pass --tokenizer "), hub="offline"),
    Case("convert-tokenizer-unreachable", "convert --to moe_vie --from {official} --out out --tokenizer org/clip",
         unreachable("CLIP's tokenizer org/clip") + ".*pass --tokenizer", hub="unreachable"),
    Case("convert-without-out", "convert --to moe_vie --from {vie}", r"convert needs --out"),
    # export
    Case("export-missing", "export ./nope --out out", r"the model \./nope does not exist; give a local model folder"),
    Case("export-empty-folder", "export {empty} --out out", r"has no config\.json; `moezoo export` takes a model"),
    Case("export-invalid-config", "export {bad_json} --out out", r"config\.json is not valid JSON .*save the model"),
    Case("export-config-without-model-type", "export {no_model_type} --out out", r"config\.json has no model_type"),
    Case("export-foreign-model", "export {foreign} --out out", r"holds a non-moezoo model \(model_type 'bert'\)"),
    Case("export-corrupt-weights", "export {corrupt} --out out", CORRUPT),
    Case("export-cut-short-weights", "export {cut_short} --out out", CORRUPT + ".*incomplete metadata"),
    Case("export-hub-model-offline", "export org/nope --out out", offline("the model org/nope"), hub="offline"),
    Case("export-taken-out", "export {vie} --out {vie}", TAKEN),
    # push
    Case("push-missing", "push ./nope org/name", r"nope does not exist; push takes a folder written by `moezoo expo"),
    Case("push-not-exported", "push {vie} org/name", r"is not an exported folder .*run `moezoo export"),
    Case("push-unreachable", "push {exported} org/name", r"cannot reach the Hub at http://127\.0\.0\.1:\d+",
         hub="unreachable"),
    Case("push-offline", "push {exported} org/name", r"HF_HUB_OFFLINE", hub="offline", process=True),
    # train moe_vie
    Case("train-moe-vie-missing-model", f"{TRAIN_VIE} ./nope",
         r"the model \./nope does not exist; give a local model folder .*, or a Hub repo id"),
    Case("train-moe-vie-bare-name", f"{TRAIN_VIE} nope", r"the model nope does not exist"),
    Case("train-moe-vie-hub-model-offline", f"{TRAIN_VIE} org/nope", offline("the model org/nope"), hub="offline",
         process=True),
    Case("train-moe-vie-hub-model-unreachable", f"{TRAIN_VIE} org/nope", unreachable("the model org/nope"),
         hub="unreachable"),
    Case("train-moe-vie-wrong-architecture", f"{TRAIN_VIE} {{glm}}",
         r"holds a GLM-OCR-MoTE model \(model_type 'glm_ocr_mote'\); `moezoo train moe_vie` takes MoE-ViE models"),
    Case("train-moe-vie-corrupt-weights", f"{TRAIN_VIE} {{corrupt}}", CORRUPT),
    Case("train-moe-vie-empty-folder", f"{TRAIN_VIE} {{empty}}", r"has no config\.json; `moezoo train moe_vie`"),
    Case("train-moe-vie-missing-data", "train moe_vie --model {vie} --data ./nope.jsonl --out out", r"no data at"),
    Case("train-moe-vie-empty-data", "train moe_vie --model {vie} --data {empty_table} --out out", r"holds no example"),
    Case("train-moe-vie-wrong-data-format", "train moe_vie --model {vie} --data {notes} --out out",
         r"notes\.txt: expected .*jsonl"),
    Case("train-moe-vie-hub-data-unreachable", "train moe_vie --model {vie} --data org/data --out out",
         unreachable("the data set org/data") + ".*--repo-type dataset", hub="unreachable"),
    # train: the Trainer's arguments (moezoo.training.arguments), refused before anything is read
    Case("train-bf16-with-fp16", f"{TRAIN_VIE} {{vie}} --bf16 --fp16", r"--bf16 and --fp16 exclude each other"),
    Case("train-best-model-without-evaluation", f"{TRAIN_VIE} {{vie}} --load_best_model_at_end",
         r"--load_best_model_at_end needs evaluation data: give --eval_data FILE"),
    Case("train-evaluation-without-data", f"{TRAIN_MOTE} {{glm}} --eval_strategy steps",
         r"--eval_strategy needs evaluation data: give --eval_data FILE"),
    Case("train-unknown-tracker", f"{TRAIN_MOTE} {{glm}} --report_to tensorbord",
         r"--report_to tensorbord: not a tracker transformers knows \(did you mean tensorboard\?\)"),
    Case("train-config-unknown-key", f"{TRAIN_VIE} {{vie}} --config {{bad_config}}",
         r"run\.yaml: unknown key 'learning_rat' \(did you mean 'learning_rate'\?\)"),
    Case("train-unknown-flag", f"{TRAIN_VIE} {{vie}} --learning_rat 0.1", r"unrecognized arguments: --learning_rat"),
    Case("train-field-moezoo-sets", f"{TRAIN_VIE} {{vie}} --output_dir elsewhere",
         r"--output_dir cannot be set here: the Trainer's checkpoints go to OUT\.checkpoints"),
    Case("train-grpo-text-generation-field", f"{TRAIN_MOEMB} {{moemb}} --grpo --use_vllm",
         r"--use_vllm cannot be set here: it is for generating text"),
    Case("train-grpo-field-without-grpo", f"{TRAIN_MOEMB} {{moemb}} --temperature 0.5",
         r"--temperature is not one of TrainingArguments's fields"),
    # train moemb
    Case("train-moemb-missing-model", f"{TRAIN_MOEMB} ./nope", r"the model \./nope does not exist"),
    Case("train-moemb-wrong-architecture", f"{TRAIN_MOEMB} {{vie}}", r"holds a MoE-ViE model .*takes MoEMB models"),
    Case("train-moemb-hub-model-offline", f"{TRAIN_MOEMB} org/nope", offline("the model org/nope"), hub="offline"),
    # train mote
    Case("train-mote-missing-model", f"{TRAIN_MOTE} ./nope", r"the model \./nope does not exist", absent="export"),
    Case("train-mote-wrong-architecture", f"{TRAIN_MOTE} {{vie}}",
         r"holds a MoE-ViE model .*`moezoo train mote` takes VideoLLM-MoTE or GLM-OCR-MoTE models"),
    Case("train-mote-text-only-model", f"{TRAIN_MOTE} {{llama_mote}}", r"holds a Llama-MoTE model .*SFTTrainer"),
    Case("train-mote-hub-model-unreachable", f"{TRAIN_MOTE} org/nope", unreachable("the model org/nope"),
         hub="unreachable"),
    Case("train-mote-dense-base-offline", f"{TRAIN_MOTE} {{glm}} {DENSE_EXPERT}",
         offline("the dense base model org/dense").replace("; ", "; give --base-model "), hub="offline"),
    # eval moe_vie
    Case("eval-moe-vie-missing-model", f"{EVAL_VIE} ./nope", r"the model \./nope does not exist"),
    Case("eval-moe-vie-hub-model-offline", f"{EVAL_VIE} org/nope", offline("the model org/nope"), hub="offline"),
    Case("eval-moe-vie-wrong-architecture", f"{EVAL_VIE} {{moemb}}", r"holds a MoEMB model .*takes MoE-ViE models"),
    Case("eval-moe-vie-corrupt-weights", f"{EVAL_VIE} {{corrupt}}", CORRUPT),
    Case("eval-moe-vie-empty-data", "eval moe_vie --task retrieval --model {vie} --data {empty_table}",
         r"holds no examples"),
    # eval moemb
    Case("eval-moemb-missing-model", f"{EVAL_MOEMB} ./nope", r"the model \./nope does not exist"),
    Case("eval-moemb-hub-model-unreachable", f"{EVAL_MOEMB} org/nope", unreachable("the model org/nope"),
         hub="unreachable"),
    Case("eval-moemb-wrong-architecture", f"{EVAL_MOEMB} {{glm}}", r"holds a GLM-OCR-MoTE model .*takes MoEMB models"),
    Case("eval-moemb-mrmr-empty-folder", "eval moemb --benchmark mrmr --model {moemb} --data {empty}",
         r"holds no task folder: expected an MRMR task folder"),
    Case("eval-moemb-mmeb-empty-folder", "eval moemb --benchmark mmeb --model {moemb} --data {empty}",
         r"expected a .* table, or a folder of them"),
    # bench
    Case("bench-unknown-size", "bench moe-vie --size huge", r"unknown size 'huge'; choose from"),
    Case("bench-no-tokens", "bench moe-layer --tokens 0", r"token counts must be positive, got 0"),
    # demo
    Case("demo-out-is-a-file", "demo --out {captions}", r"captions\.jsonl is a file, not a folder"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Tiny models of each family, broken copies of one, and small data files: the inputs of the cases."""
    root = tmp_path_factory.mktemp("inputs")
    paths = {}
    for name, preset in (("vie", "tiny-moe_vie"), ("glm", "tiny-mote-glm-ocr"), ("llama_mote", "tiny-mote-llama"),
                         ("moemb", "tiny-moemb")):  # fmt: skip
        paths[name] = create_from_preset(preset, root / name)
    for name, weights in (("corrupt", b"\x00" * 64), ("cut_short", None)):
        paths[name] = root / name
        shutil.copytree(paths["vie"], paths[name])
        full = (paths["vie"] / "model.safetensors").read_bytes()
        (paths[name] / "model.safetensors").write_bytes(weights if weights is not None else full[: len(full) // 2])
    for name, config in (("empty", None), ("bad_json", "{\n  oops"), ("no_model_type", "{}"),
                         ("foreign", json.dumps({"model_type": "bert"}))):  # fmt: skip
        paths[name] = root / name
        paths[name].mkdir()
        if config is not None:
            (paths[name] / "config.json").write_text(config)

    from transformers import SiglipConfig, SiglipModel

    from moezoo.hub.export import export_folder

    paths["exported"] = export_folder(paths["vie"], root / "exported")
    paths["corrupt_siglip"] = root / "corrupt_siglip"
    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    siglip = SiglipConfig(text_config=tiny, vision_config=tiny | {"image_size": 32, "patch_size": 16})
    SiglipModel(siglip).save_pretrained(paths["corrupt_siglip"])
    (paths["corrupt_siglip"] / "model.safetensors").write_bytes(b"\x00" * 64)
    paths["official"] = root / "official"
    paths["official"].mkdir()
    torch.save(make_official_state_dict(), paths["official"] / "MoEViE-tiny.pt")
    (paths["official"] / "open_clip_config.json").write_text(json.dumps({"model_cfg": official_model_config()}))

    rows = []
    for index in range(8):
        Image.new("RGB", (16, 16), (30 * index, 0, 0)).save(root / f"image{index}.png")
        rows.append({"image": f"image{index}.png", "text": "a photo of red"})
    paths["captions"] = root / "captions.jsonl"
    paths["captions"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths["empty_table"] = root / "empty.jsonl"
    paths["empty_table"].write_text("")
    paths["notes"] = root / "notes.txt"
    paths["notes"].write_text("a photo of red\n")
    paths["bad_config"] = root / "run.yaml"
    paths["bad_config"].write_text("learning_rat: 0.1\n")
    return paths


def hub_environment(hub: str | None, tmp_path: Path) -> dict[str, str]:
    """An empty Hub cache, and the Hub as the case wants it."""
    environment = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub")}
    if hub == "offline":
        environment["HF_HUB_OFFLINE"] = "1"
    elif hub == "unreachable":
        environment["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    return environment


def run_in_this_process(argv: list[str], environment: dict[str, str], monkeypatch, capfd) -> tuple[int, str]:
    """`moezoo.cli.main(argv)` with huggingface_hub's constants (read when it is imported) set as `environment`
    would set them in a fresh process. An exception escaping `main` fails the test, as its traceback would."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", environment["HF_HUB_CACHE"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", "HF_HUB_OFFLINE" in environment)
    if "HF_ENDPOINT" in environment:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", environment["HF_ENDPOINT"])
    capfd.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    return status, capfd.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_mistake_ends_in_one_error_line(case, inputs, tmp_path, monkeypatch, capfd):
    work = tmp_path / "work"  # the command's working directory: --out points into it
    work.mkdir()
    monkeypatch.chdir(work)
    argv = case.argv.format(**{name: str(path) for name, path in inputs.items()}).split()
    environment = hub_environment(case.hub, tmp_path)
    start = time.monotonic()
    if case.process:
        result = run_moezoo(*argv, env=environment, cwd=work, timeout=120)
        status, stderr = result.returncode, result.stderr
    else:
        status, stderr = run_in_this_process(argv, environment, monkeypatch, capfd)
    elapsed = time.monotonic() - start

    assert status not in (0, None), stderr
    assert "Traceback" not in stderr, stderr
    *usage, error = stderr.strip().splitlines()
    assert "error:" in error and all(line.startswith(("usage:", " ")) for line in usage), stderr  # argparse's usage
    assert re.search(case.error, error), error
    assert case.absent is None or case.absent not in error, error
    assert elapsed < (SECONDS_IN_A_FRESH_PROCESS if case.process else SECONDS), f"{elapsed:.0f} s"
    assert sorted(os.listdir(work)) == [], "the command left output behind"


def test_route_selector_offline_names_its_encoder_and_how_to_give_it(tmp_path, monkeypatch):
    from moezoo.configuration.mote import TINY_GLM_OCR_MOTE, GlmOcrMoteConfig
    from moezoo.hub.sources import HubUnreachableError
    from moezoo.modeling.mote.route_selector import MoteRouteSelector

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config = GlmOcrMoteConfig(**TINY_GLM_OCR_MOTE)
    start = time.monotonic()
    with pytest.raises(HubUnreachableError) as error:  # an OSError, as transformers' own loading errors
        MoteRouteSelector.from_config(config)
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert "sentence-transformers/all-MiniLM-L6-v2" in message and "encoder=" in message and "\n" not in message


@pytest.mark.slow
def test_a_hub_model_is_checked_before_its_weights_are_downloaded_and_read_from_the_cache_offline(
    inputs, fake_hub, tmp_path  # noqa: F811
):
    find = textwrap.dedent("""
        from moezoo.hub.sources import model_folder

        def find(command, types):
            return model_folder("zoo/glm", command, types)
    """)
    run_python(find + textwrap.dedent(f"""
    import huggingface_hub, pathlib

    api = huggingface_hub.HfApi()
    api.create_repo("zoo/glm")
    api.upload_folder(folder_path="{inputs['glm']}", repo_id="zoo/glm")
    try:
        find("`moezoo train moe_vie`", ["moe_vie"])
    except ValueError as error:
        assert "zoo/glm holds a GLM-OCR-MoTE model" in str(error), error
    else:
        raise AssertionError("a model of another architecture was taken")
    cache = pathlib.Path(huggingface_hub.constants.HF_HUB_CACHE)
    downloaded = {{path.name for path in cache.rglob("*") if path.is_file() and "snapshots" in path.parts}}
    assert downloaded == {{"config.json"}}, downloaded  # the weights stayed on the Hub
    folder, model_type = find("`moezoo train mote`", ["glm_ocr_mote"])
    assert model_type == "glm_ocr_mote" and (folder / "model.safetensors").is_file()
    """), env=fake_hub)
    # Without a Hub, or offline: the cached copy, at once.
    for hub in ({"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, {"HF_HUB_OFFLINE": "1"}):
        run_python(find + "assert (find('`moezoo train mote`', ['glm_ocr_mote'])[0] / 'model.safetensors').is_file()",
                   env=fake_hub | hub, timeout=SECONDS_IN_A_FRESH_PROCESS)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_stopped_training_says_how_to_resume_and_leaves_only_its_checkpoints(stop, inputs, tmp_path):
    work, log = tmp_path / "work", tmp_path / "stderr.txt"
    work.mkdir()
    command = [sys.executable, "-m", "moezoo.cli", "train", "moe_vie", "--model", str(inputs["vie"]), "--data",
               str(inputs["captions"]), "--out", "out", "--batch-size", "4", "--steps", "100000", "--save-steps", "1"]
    with log.open("w") as stderr_file:  # a file, not a pipe, which a chatty run could fill and block on
        process = subprocess.Popen(command, cwd=work, stdout=subprocess.DEVNULL, stderr=stderr_file)
        deadline = time.monotonic() + 240
        while not list((work / "out.checkpoints").glob("checkpoint-*")):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(stop)
        process.wait(timeout=120)
    stderr = log.read_text()
    assert process.returncode == cli.INTERRUPTED, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert re.search(r"checkpoints are kept in out\.checkpoints: run the same command again with --resume", stderr)
    assert stderr.rstrip().endswith("interrupted")
    assert os.listdir(work) == ["out.checkpoints"]  # no `out`, no hidden `.out.partial-*` staging folder


@pytest.mark.parametrize("environment", [{}, {"MOEZOO_DEBUG": "1"}], ids=["--debug", "MOEZOO_DEBUG=1"])
def test_debug_shows_the_traceback(environment, tmp_path):
    debug = [] if environment else ["--debug"]
    result = run_moezoo(*debug, "export", tmp_path / "nope", "--out", tmp_path / "out", env=environment)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "FileNotFoundError: the model" in result.stderr
