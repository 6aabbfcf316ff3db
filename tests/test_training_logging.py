"""Logging and trackers on `moezoo train` (issue 27, item 4): `--report_to tensorboard` writes event files into the
run's output folder (`OUT/runs`) that hold, beside the loss, the zoo's routing statistics, logged through the
Trainer's `log` (`moezoo.training.callbacks.LogsRoutingStatistics`) and so in every tracker; a tracker that is not
installed is refused in one line, naming the pip command, before anything is loaded.

The event files are read back with the protobuf classes of tensorboardX, the writer the `train` extra installs."""

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from tensorboardX.proto.event_pb2 import Event
from transformers.integrations import get_available_reporting_integrations

from conftest import run_moezoo_in_this_process
from moezoo.training.moe_vie import MoeVieTrainer
from moezoo.training.moemb_synthetic import ShapeRetrieval
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

ROUTING_STATISTICS = ("experts/load_max_over_mean", "experts/load_entropy", "experts/unused_share")
# Each train command whose routing is counted: its tiny preset.
COMMANDS = {"moe_vie": "tiny-moe_vie", "moemb": "tiny-moemb", "omnimoe_vl": "tiny-omnimoe_vl", "smoes": "tiny-smoes"}


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files under `folder`: tag -> [(step, value), ...]. An event file is a
    sequence of records: the length (uint64), its CRC (uint32), the serialized `Event`, its CRC (uint32)."""
    scalars = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, list[str]]:
    """Per command, the `--model --data` of its tiny model and four examples in the format it reads."""
    root = tmp_path_factory.mktemp("inputs")
    captions = write_shape_captions(root / "captions", 4)
    vqa = captions.with_name("vqa.jsonl")
    vqa.write_text("".join(json.dumps({"image": row["image"], "question": "what is it?", "answer": row["text"]}) + "\n"
                           for row in map(json.loads, captions.read_text().splitlines())))  # fmt: skip
    pairs = ShapeRetrieval().write_mmeb_training(root / "pairs", 4, torch.Generator().manual_seed(0))
    data = {"moe_vie": captions, "moemb": pairs, "omnimoe_vl": vqa, "smoes": captions}
    return {
        name: ["--model", create_from_preset(preset, root / name), "--data", data[name]]
        for name, preset in COMMANDS.items()
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_tensorboard_holds_the_loss_and_the_routing_statistics(command, inputs, tmp_path, capfd):
    out = tmp_path / "out"
    result = run_moezoo_in_this_process(capfd, "train", command, *inputs[command], "--out", out, "--steps", "2",
                                        "--batch-size", "2", "--logging-steps", "1", "--report_to", "tensorboard")  # fmt: skip
    assert result.returncode == 0, result.stderr
    scalars = read_scalars(out / "runs")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    for name in ROUTING_STATISTICS:
        assert [step for step, _ in scalars[f"train/{name}"]] == [1, 2], name
    values = {name: [value for _, value in scalars[f"train/{name}"]] for name in ROUTING_STATISTICS}
    assert all(value >= 1 for value in values["experts/load_max_over_mean"])
    assert all(0 < value <= 1 for value in values["experts/load_entropy"])
    assert all(0 <= value < 1 for value in values["experts/unused_share"])
    if command == "omnimoe_vl":  # the mean weight of each depth of the route: a distribution over the depths
        depths = [scalars[tag] for tag in sorted(scalars) if tag.startswith("train/depth_route/")]
        assert depths and all(len(steps) == 2 for steps in depths)
        assert math.isclose(sum(steps[0][1] for steps in depths), 1.0, rel_tol=1e-5)
    assert not (tmp_path / "out.checkpoints").exists()


def test_a_resumed_run_keeps_the_event_files_of_its_interrupted_part(inputs, tmp_path, capfd, monkeypatch):
    """While a run trains its event files are in OUT.checkpoints/runs, which an interrupted run keeps with its
    checkpoints: the resumed run ends with both parts' in OUT/runs."""
    out = tmp_path / "out"
    command = ["train", "moe_vie", *inputs["moe_vie"], "--out", out, "--steps", "2", "--batch-size", "2",
               "--logging-steps", "1", "--save_steps", "1", "--report_to", "tensorboard"]  # fmt: skip
    training_step = MoeVieTrainer.training_step

    def interrupted_at_step_2(self, *args, **kwargs):
        if self.state.global_step == 1:  # after the checkpoint of step 1
            raise KeyboardInterrupt
        return training_step(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(MoeVieTrainer, "training_step", interrupted_at_step_2)
        interrupted = run_moezoo_in_this_process(capfd, *command)
    assert interrupted.returncode != 0 and "interrupted" in interrupted.stderr
    runs = tmp_path / "out.checkpoints" / "runs"
    [first_part] = [path.relative_to(runs) for path in runs.rglob("events.out.tfevents.*")]
    result = run_moezoo_in_this_process(capfd, *command, "--resume")
    assert result.returncode == 0, result.stderr
    assert (out / "runs" / first_part).is_file() and not (tmp_path / "out.checkpoints").exists()
    # The interrupted part's writer is closed when its process ends (tensorboardX's atexit), which in this test's
    # process is after the test: the scalars read back are the resumed part's.
    scalars = read_scalars(out / "runs")
    assert 2 in [step for step, _ in scalars["train/loss"]]
    assert 2 in [step for step, _ in scalars["train/experts/load_entropy"]]


def test_a_tracker_that_is_not_installed_is_refused_with_its_pip_command(inputs, tmp_path, capfd):
    assert "trackio" not in get_available_reporting_integrations()
    result = run_moezoo_in_this_process(capfd, "train", "moe_vie", *inputs["moe_vie"], "--out", tmp_path / "out",
                                        "--report_to", "tensorboard,trackio")  # fmt: skip
    assert result.returncode != 0
    assert "--report_to trackio: not installed here, `pip install trackio` installs it" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
