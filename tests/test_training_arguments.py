"""The Trainer's own arguments on every `moezoo train ARCH` (`moezoo.training.arguments`): each TrainingArguments field
a flag of its name (GRPOConfig's under `moezoo train moemb --grpo`), a YAML or JSON `--config` file that the flags
override, today's flag names as aliases, the defaults of each recipe when nothing is given, and the fields a recipe
cannot honour refused by name before anything is loaded (the command-line cases of those are in
test_bad_input_catalogue.py).

Every recipe runs up to its Trainer, which is replaced by one that records its arguments and stops the run: what is
checked is the TrainingArguments the recipe itself builds, in seconds, without training."""

import argparse
import json
import os

import pytest
import torch
from transformers import TrainingArguments
from trl import GRPOConfig

from conftest import run_moezoo_in_this_process
from moezoo.training import moe_vie, moemb, moemb_grpo, mote, omnimoe_vl, smoes
from moezoo.training.arguments import parse_train_arguments, trainer_options
from moezoo.training.moemb_synthetic import ShapeRetrieval
from moezoo.training.smoes_synthetic import write_shape_captions
from moezoo.zoo import create_from_preset

FLAGS = ["--lr_scheduler_type", "constant", "--max_grad_norm", "0.5", "--learning_rate", "0.002"]
# Each train command: its module, the Trainer class the recipe builds, and its tiny model's preset.
COMMANDS = {
    "moe_vie": (moe_vie, "MoeVieTrainer", "tiny-moe_vie"),
    "moemb": (moemb, "MoEmbTrainer", "tiny-moemb"),
    "moemb --grpo": (moemb_grpo, "GatePolicyGRPOTrainer", "tiny-moemb"),
    "mote": (mote, "MoteTrainer", "tiny-mote-glm-ocr"),
    "omnimoe_vl": (omnimoe_vl, "OmniMoeVlTrainer", "tiny-omnimoe_vl"),
    "smoes": (smoes, "SmoesTrainer", "tiny-smoes"),
}


class Stop(Exception):
    """Raised by the recording Trainer, with the arguments the recipe gave it."""


def recording_trainer(*args, **kwargs):
    raise Stop(kwargs["args"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, list[str]]:
    """Per command, the `--model --data` of a tiny model and a few examples in the data format it reads."""
    root = tmp_path_factory.mktemp("inputs")
    captions = write_shape_captions(root / "captions", 8)
    rows = [json.loads(line) for line in captions.read_text().splitlines()]
    vqa = captions.with_name("vqa.jsonl")
    vqa.write_text("".join(json.dumps({"image": row["image"], "question": "what is it?", "answer": row["text"]}) + "\n"
                           for row in rows))  # fmt: skip
    mote_model = create_from_preset("tiny-mote-glm-ocr", root / "mote")
    experts = json.loads((mote_model / "config.json").read_text())["text_config"]["mote_expert_names"]
    tasks = captions.with_name("tasks.jsonl")
    tasks.write_text("".join(json.dumps({"task": experts[i % len(experts)], "prompt": "read", "answer": row["text"],
                                         "image": row["image"]}) + "\n" for i, row in enumerate(rows)))  # fmt: skip
    pairs = ShapeRetrieval().write_mmeb_training(root / "pairs", 8, torch.Generator().manual_seed(0))
    moemb_model = create_from_preset("tiny-moemb", root / "moemb")
    data = {"moe_vie": captions, "moemb": pairs, "moemb --grpo": pairs, "mote": tasks, "omnimoe_vl": vqa,
            "smoes": captions}  # fmt: skip
    models = {"moemb": moemb_model, "moemb --grpo": moemb_model, "mote": mote_model}
    for name, (_, _, preset) in COMMANDS.items():
        if name not in models:
            models[name] = create_from_preset(preset, root / name)
    return {name: ["--model", str(models[name]), "--data", str(data[name])] for name in COMMANDS}


def recipe_arguments(command, inputs, out, monkeypatch, capfd, *flags) -> TrainingArguments:
    """The Trainer arguments that `moezoo train COMMAND FLAGS` gives its Trainer (stopped there)."""
    module, trainer, _ = COMMANDS[command]
    monkeypatch.setattr(module, trainer, recording_trainer)
    arch, *grpo = command.split()
    with pytest.raises(Stop) as stopped:
        run_moezoo_in_this_process(capfd, "train", arch, *grpo, *inputs[command], "--out", out, "--steps", "2",
                                   "--batch-size", "4", *flags)  # fmt: skip
    assert not out.exists()
    return stopped.value.args[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_train_command_gives_its_trainer_the_flags(command, inputs, tmp_path, monkeypatch, capfd):
    arguments = recipe_arguments(command, inputs, tmp_path / "out", monkeypatch, capfd, *FLAGS, "--weight-decay",
                                 "0.1", "--seed", "3", "--logging-steps", "1", "--save-steps", "2")  # fmt: skip
    assert isinstance(arguments, GRPOConfig if command == "moemb --grpo" else TrainingArguments)
    assert arguments.lr_scheduler_type == "constant" and arguments.max_grad_norm == 0.5
    assert arguments.learning_rate == 0.002 and arguments.weight_decay == 0.1 and arguments.seed == 3
    assert arguments.max_steps == 2 and arguments.per_device_train_batch_size == 4 and arguments.logging_steps == 1
    assert arguments.save_steps == 2 and arguments.output_dir == str(tmp_path / "out.checkpoints")
    assert arguments.report_to == [] and not arguments.remove_unused_columns


def test_nothing_given_is_each_recipes_run_of_before(inputs, tmp_path, monkeypatch, capfd):
    vie = recipe_arguments("moe_vie", inputs, tmp_path / "vie", monkeypatch, capfd)
    assert vie.lr_scheduler_type == "cosine" and vie.learning_rate == 1e-3 and vie.weight_decay == 0.05
    assert vie.report_to == [] and vie.logging_steps == 2 and vie.dataloader_drop_last and not vie.bf16
    embedder = recipe_arguments("moemb", inputs, tmp_path / "moemb", monkeypatch, capfd)
    assert embedder.lr_scheduler_type == "cosine_with_min_lr" and embedder.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert embedder.learning_rate == 1e-4 and embedder.adam_beta2 == 0.98 and embedder.max_grad_norm == 1.0
    grpo = recipe_arguments("moemb --grpo", inputs, tmp_path / "grpo", monkeypatch, capfd, "--rollouts", "3",
                            "--temperature", "0.5", "--epsilon_high", "0.3")  # fmt: skip
    assert grpo.num_generations == grpo.steps_per_generation == 3 and grpo.temperature == 0.5
    assert grpo.epsilon == 0.2 and grpo.epsilon_high == 0.3 and grpo.beta == 0.0 and grpo.learning_rate == 5e-5
    assert not grpo.gradient_checkpointing and grpo.lr_scheduler_type == "cosine"  # TrainingArguments' defaults


def parse(module, argv: list[str], options_class=None):
    """The command's parsed options, and the Trainer's as the fields of `options_class`."""
    parser = argparse.ArgumentParser()
    module.add_train_arguments(parser)
    args = parse_train_arguments(parser, argv)
    return args, options_class and options_class(**trainer_options(args, options_class))


def test_a_config_file_holds_the_options_and_the_flags_override_it(tmp_path):
    required = ["--model", "m", "--data", "d", "--out", "o"]
    (tmp_path / "run.yaml").write_text(
        "learning_rate: 2.0e-4\nlr_scheduler_type: constant_with_warmup\nwarmup_steps: 5\nlora-r: 4\nsteps: 30\n"
        "report_to: [none]\nlr_scheduler_kwargs: {}\nrecipe: tuned\nnegatives: true\nmax_grad_norm: 2\n"
    )
    args, options = parse(moemb, [*required, "--config", str(tmp_path / "run.yaml"), "--max_grad_norm", "0.5"],
                          moemb.MoEmbTrainingOptions)  # fmt: skip
    assert (options.learning_rate, options.warmup_steps, options.steps) == (2e-4, 5, 30)
    assert args.lora_r == 4 and args.recipe == "tuned" and args.negatives
    assert options.training_args == {"lr_scheduler_type": "constant_with_warmup", "report_to": "none",
                                     "lr_scheduler_kwargs": "{}", "max_grad_norm": 0.5}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps({"model": "m", "data": "d", "out": "o", "max_steps": 7,
                                                   "bf16": True, "stage": "II", "lora": 2}))  # fmt: skip
    args, _ = parse(omnimoe_vl, ["--config", str(tmp_path / "run.json"), "--max_steps", "9"])
    assert (args.model, args.stage, args.lora_r, args.max_steps, args.bf16) == ("m", "II", 2, 9, True)
    for switch, train_router in [("freeze-router: true", False), ("train_router: false", False),
                                 ("freeze-router: false", None), ("train-router: true", True)]:  # fmt: skip
        (tmp_path / "switch.yaml").write_text(switch)
        args, _ = parse(moemb, [*required, "--config", str(tmp_path / "switch.yaml")], moemb.MoEmbTrainingOptions)
        assert args.train_router is train_router, switch


def test_todays_flag_names_still_work(tmp_path):
    argv = ["--model", "m", "--data", "d", "--out", "o", "--steps", "5", "--batch-size", "3", "--lr", "0.01",
            "--weight-decay", "0.2", "--warmup-steps", "1", "--gradient-accumulation-steps", "2", "--seed", "4",
            "--logging-steps", "2", "--save-steps", "5", "--gradient-checkpointing", "--resume"]  # fmt: skip
    _, options = parse(smoes, argv, smoes.SmoesTrainingOptions)
    assert (options.steps, options.batch_size, options.learning_rate, options.weight_decay) == (5, 3, 0.01, 0.2)
    assert (options.warmup_steps, options.gradient_accumulation_steps, options.seed) == (1, 2, 4)
    assert (options.logging_steps, options.save_steps, options.gradient_checkpointing, options.resume) == (2, 5, True,
                                                                                                          True)
    assert options.training_args == {}
    _, defaults = parse(mote, ["--model", "m", "--data", "d", "--out", "o"], mote.MoteTrainingOptions)
    assert defaults == mote.MoteTrainingOptions()


@pytest.mark.parametrize(("training_args", "error"), [
    ({"output_dir": "x"}, r"--output_dir cannot be set here: the Trainer's checkpoints go to OUT\.checkpoints"),
    ({"remove_unused_columns": True}, r"--remove_unused_columns cannot be set here: the zoo's collators"),
    ({"dataloader_drop_last": False}, r"--dataloader_drop_last cannot be set here: the global contrastive"),
    ({"max_steps": 3}, r"--max_steps: it is MoeVieTrainingOptions\.steps"),
    ({"learning_rat": 3}, r"--learning_rat is not one of TrainingArguments's fields \(did you mean --learning_rate"),
    ({"temperature": 0.5}, r"--temperature is not one of TrainingArguments's fields"),
    ({"bf16": True, "fp16": True}, r"--bf16 and --fp16 exclude each other"),
    ({"eval_strategy": "steps"}, r"--eval_strategy needs evaluation data: give --eval_data FILE"),
    ({"load_best_model_at_end": True}, r"--load_best_model_at_end needs evaluation data: give --eval_data FILE"),
    ({"report_to": "tensorbord"}, r"--report_to tensorbord: not a tracker transformers knows \(did you mean "
                                  r"tensorboard\?\)"),
    ({"push_to_hub": True}, r"--push_to_hub is the train command's .*moezoo\.training\.push\.push_trained_folder"),
])  # fmt: skip
def test_the_python_api_refuses_what_the_recipe_cannot_honour(training_args, error):
    with pytest.raises(ValueError, match=error):
        moe_vie.MoeVieTrainingOptions(training_args=training_args)


def test_grpo_refuses_what_generates_text_and_what_it_fixes():
    with pytest.raises(ValueError, match=r"--use_vllm cannot be set here: it is for generating text"):
        moemb_grpo.GrpoOptions(training_args={"use_vllm": True})
    with pytest.raises(ValueError, match=r"--beta cannot be set here: there is no reference model"):
        moemb_grpo.GrpoOptions(training_args={"beta": 0.1})
    assert moemb_grpo.GrpoOptions(training_args={"epsilon_high": 0.3}).training_args == {"epsilon_high": 0.3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="--fp16 is refused on a machine without a CUDA GPU")
def test_fp16_is_refused_on_a_cpu():
    with pytest.raises(ValueError, match=r"--fp16 needs a CUDA GPU, and this machine has none"):
        smoes.SmoesTrainingOptions(training_args={"fp16": True})


def test_help_lists_the_trainer_fields_and_todays_names(capfd):
    result = run_moezoo_in_this_process(capfd, "train", "mote", "--help")
    assert result.returncode == 0
    for flag in ("--bf16", "--lr_scheduler_type", "--max_grad_norm", "--report_to", "--torch_compile", "--config",
                 "--steps MAX_STEPS", "--lr LEARNING_RATE", "--batch-size", "--resume", "--fsdp N"):
        assert flag in result.stdout, flag
    assert "--output_dir" in result.stdout and os.linesep.join(["", "  --deepspeed CONFIG"]) in result.stdout
