"""What every `moezoo train` command shares: its Trainer options on the command line, the `TrainingArguments` they
become, the checkpoints folder that lets an interrupted run resume (with the PEFT model whose checkpoints keep the
parameters trained beside the adapters), and the loss summary of a run's logs."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, get_type_hints

import torch
from peft import PeftModel
from rich.markup import escape
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import HfArgumentParser, TrainingArguments
from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.hf_argparser import string_to_bool
from transformers.trainer_utils import get_last_checkpoint

from ..hub.folders import atomic_output_dir
from ..modeling.moe import expert_parallel  # noqa: F401 (registers moezoo's "dedup" EP implementation)
from ..terminal import error_console
from . import deepspeed_zero
from .evaluation import check_evaluation_options, evaluation_arguments


def checkpoints_dir(out: str | Path) -> Path:
    """Where a run writing `out` keeps its Trainer checkpoints: `<out>.checkpoints`, beside `out` rather than in the
    staging folder of `atomic_output_dir`, which a failed run deletes."""
    out = Path(out)
    return out.with_name(f"{out.name}.checkpoints")


def checkpoint_to_resume(out: str | Path, options) -> str | None:
    """
    Checks `options.save_steps` and `options.resume` against the checkpoints folder of `out`, before the (long)
    loading of model and data, and returns the latest checkpoint to resume from (None for a fresh run).

    A fresh run refuses a folder that holds checkpoints: they belong to an interrupted run that `--resume` continues,
    and new checkpoints mixed into them would make `--resume` pick the wrong one.
    """
    if options.save_steps < 0:
        raise ValueError(f"save_steps must be 0 (no checkpoints) or a number of steps, got {options.save_steps}")
    folder = checkpoints_dir(out)
    last = get_last_checkpoint(folder) if folder.is_dir() else None
    if options.resume and last is None:
        raise FileNotFoundError(
            f"--resume found no checkpoint in {folder}: only a run started with --save-steps N writes checkpoints "
            "there (one every N optimizer steps)"
        )
    if not options.resume and last is not None:
        raise FileExistsError(
            f"{folder} holds the checkpoints of an earlier run of --out {out}: continue it with --resume, or delete "
            "that folder to start again"
        )
    return last


@contextmanager
def training_output_dir(out: str | Path, overwrite: bool = False):
    """
    `atomic_output_dir` for a training run, which also looks after the checkpoints folder (`checkpoints_dir`): it is
    removed once `out` is complete, and kept when the run fails or is interrupted and left a checkpoint, with a
    message saying how to resume.
    """
    checkpoints = checkpoints_dir(out)
    try:
        with atomic_output_dir(out, overwrite=overwrite) as staging:
            yield staging
    except BaseException:  # KeyboardInterrupt too: that is how a long run is usually stopped
        last = get_last_checkpoint(checkpoints) if checkpoints.is_dir() else None
        if last is None:
            # Nothing to resume from, at most the empty folder the Trainer creates even when it saves no checkpoint.
            shutil.rmtree(checkpoints, ignore_errors=True)
        else:
            error_console.print(escape(  # the paths are the user's: "[...]" in them is not markup
                f"training stopped; its checkpoints are kept in {checkpoints}: run the same command again with "
                f"--resume (Python: resume=True) to continue from {Path(last).name}"
            ), soft_wrap=True)  # not wrapped at 80 columns when piped: the paths stay whole for copy-paste
        raise
    shutil.rmtree(checkpoints, ignore_errors=True)


def training_arguments(out: str | Path, options, fixed: dict | None = None, **defaults) -> TrainingArguments:
    """
    The Trainer arguments (`options.arguments_class`) of a run writing `out`, from a command's options: the zoo's
    (`options.steps`, `batch_size`, `learning_rate`, ... and a checkpoint in `checkpoints_dir(out)` every `save_steps`
    optimizer steps, none for 0, only the latest kept, all resuming needs; every data column kept for the collators;
    the GPU when there is one; the DeepSpeed config `deepspeed` names, `deepspeed_zero.training_config`), then the
    recipe's `defaults` (a cosine schedule and no reporting unless given), then the user's `options.training_args`,
    then what the recipe `fixed` itself (declared in its options' `recipe_fields`, so never among the user's).
    """
    return options.arguments_class(**trainer_arguments(out, options, fixed, **defaults))


def trainer_arguments(out: str | Path, options, fixed: dict | None = None, **defaults) -> dict:
    """`training_arguments` as keyword arguments."""
    if options.save_steps:
        checkpoints = dict(save_strategy="steps", save_steps=options.save_steps, save_total_limit=1)
    else:
        checkpoints = dict(save_strategy="no")
    arguments = dict(
        output_dir=str(checkpoints_dir(out)),
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        activation_checkpointing=options.gradient_checkpointing,
        learning_rate=options.learning_rate,
        weight_decay=options.weight_decay,
        warmup_steps=options.warmup_steps,
        logging_steps=min(options.logging_steps, options.steps),
        **checkpoints,
        seed=options.seed,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    if options.deepspeed is not None:
        arguments["deepspeed"] = deepspeed_zero.training_config(options.deepspeed)
    user = dict(options.training_args)
    if "report_to" in user:
        user["report_to"] = trackers(user["report_to"])
    recipe = dict(lr_scheduler_type="cosine", report_to="none") | evaluation_arguments(options) | defaults
    return arguments | recipe | user | (fixed or {})


class PeftModelWithTrainedBase(PeftModel):
    """
    A PEFT model whose recipe also trains some parameters of the base model in full, beside the adapters (MoTE's
    experts, MoEMB's routers with `--train-router`); subclasses name them in `trained_base_parameters`. PEFT's adapter
    files hold the adapters only, so the Trainer's checkpoints would lose those parameters and a resumed run would
    silently restart them from the base model: `save_pretrained` writes them to `trained_base_parameters.safetensors`
    beside PEFT's files, and `load_adapter` (what the Trainer's `resume_from_checkpoint` and `from_pretrained` call)
    copies them back into the base model.
    """

    TRAINED_BASE_FILE = "trained_base_parameters.safetensors"

    def trained_base_parameters(self) -> dict[str, nn.Parameter | torch.Tensor]:
        """The parameters of `self.get_base_model()` trained in full, by name: none unless a subclass names them. A
        subclass may name buffers too: training state that the base model keeps (OmniMoE-VL's routing step)."""
        return {}

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs) -> None:
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        tensors = {name: parameter.detach().contiguous() for name, parameter in self.trained_base_parameters().items()}
        if tensors and is_main_process:
            save_file(tensors, str(Path(save_directory) / self.TRAINED_BASE_FILE))

    def load_adapter(self, model_id, adapter_name: str, is_trainable: bool = False, **kwargs):
        result = super().load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        path = Path(model_id) / self.TRAINED_BASE_FILE
        if path.is_file():
            base = self.get_base_model()
            parameters = dict(base.named_parameters()) | dict(base.named_buffers())
            with torch.no_grad():
                for name, tensor in load_file(str(path)).items():
                    if name not in parameters:
                        raise ValueError(f"{path} holds {name}, which is no parameter of this model")
                    parameters[name].copy_(tensor)
        return result


def loss_summary(log_history: list[dict]) -> dict[str, float]:
    """
    The first and last logged training losses (each a mean over its logging window) and the mean over the run, from
    `trainer.state.log_history`, which a resumed run restores from its checkpoint: the summary covers the whole run.
    With `LogAtCheckpointsAndEnd` the windows cover every step, so the mean is exactly the mean loss per step.
    """
    logs = [log for log in log_history if "loss" in log]
    window_ends = [log["step"] for log in logs]
    window_lengths = [end - start for start, end in zip([0, *window_ends], window_ends)]
    total = sum(log["loss"] * length for log, length in zip(logs, window_lengths))
    return {
        "initial_loss": round(logs[0]["loss"], 4),
        "final_loss": round(logs[-1]["loss"], 4),
        "mean_loss": round(total / window_ends[-1], 4),
    }


# --- the Trainer's arguments on the command line -------------------------------------------------------------------

# TrainingArguments fields that moezoo sets on every train command, and why: a value given for one is refused.
ZOO_FIELDS = {
    "output_dir": "the Trainer's checkpoints go to OUT.checkpoints, beside --out, where the model is saved",
    "resume_from_checkpoint": "--resume continues from the latest checkpoint in OUT.checkpoints",
    "save_strategy": "--save_steps N writes a checkpoint every N steps to OUT.checkpoints (0: none)",
    "save_total_limit": "only the latest checkpoint is kept, all --resume needs",
    "num_train_epochs": "runs are counted in optimizer steps: --max_steps (--steps)",
    "remove_unused_columns": "the zoo's collators read every column of the data",
    "use_cpu": "training runs on the GPU when there is one, on the CPU otherwise",
    "fsdp": "shard with the zoo's --fsdp N / --ep N (transformers' native FSDP2)",
    "fsdp_config": "shard with the zoo's --fsdp N / --ep N (transformers' native FSDP2)",
    "deepspeed": "name a DeepSpeed config file or preset with the zoo's --deepspeed",
    "hub_strategy": "--push_to_hub pushes the trained model once, when the run ends; the Trainer's checkpoints are "
                    "not pushed (they stay in OUT.checkpoints for --resume)",
    "hub_always_push": "--push_to_hub pushes the trained model once, when the run ends, and waits for that push",
}
# TrainingArguments fields that are not flags: the zoo's own flags of the same name mean something else.
NOT_FLAGS = ("fsdp", "deepspeed")
# TrainingArguments fields that an options dataclass holds under another name.
RENAMED = {"max_steps": "steps", "per_device_train_batch_size": "batch_size", "num_generations": "rollouts"}
# TrainingArguments fields about pushing to the Hub: the train command's own (`moezoo.training.push` takes them off its
# options before the recipe's options are made, which refuse them), as the Trainer would push its checkpoints, without
# the model's code.
PUSH_FIELDS = ("push_to_hub", "hub_model_id", "hub_token", "hub_private_repo", "hub_revision")
# Today's flags that name a field of the Trainer's arguments otherwise: aliases. (The fields' dashed spellings, like
# --weight-decay or --save-steps, are flags of HfArgumentParser's own.)
ALIASES = {"--steps": "max_steps", "--batch-size": "per_device_train_batch_size", "--lr": "learning_rate"}


def trackers(report_to: str | list[str]) -> list[str]:
    """`report_to` as a list: a comma-separated string on the command line (`--report_to tensorboard,trackio`)."""
    return report_to.split(",") if isinstance(report_to, str) else list(report_to)


def mirrored_fields(options_class) -> dict[str, str]:
    """The fields of `options_class.arguments_class` that `options_class` holds itself (`max_steps` as `steps`,
    `learning_rate`, ...): Trainer argument name -> option name."""
    options = {field.name for field in dataclasses.fields(options_class)}
    return {
        name: RENAMED.get(name, name)
        for name in (field.name for field in dataclasses.fields(options_class.arguments_class) if field.init)
        if RENAMED.get(name, name) in options and name not in NOT_FLAGS
    }


def check_training_args(options) -> None:
    """
    Refuses, in one line naming the flag, each Trainer argument of `options.training_args` that the recipe cannot
    honour: one moezoo sets itself (`ZOO_FIELDS`) or the recipe does (`recipe_fields`), one that is not a field of its
    arguments class, and the combinations that would fail or mislead only once the model is loaded.
    """
    cls = type(options)
    valid = {field.name for field in dataclasses.fields(cls.arguments_class) if field.init}
    mirrored = mirrored_fields(cls)
    for name in options.training_args:
        if name in mirrored:
            raise ValueError(f"--{name}: it is {cls.__name__}.{mirrored[name]}, not one of its training_args")
        reason = cls.recipe_fields.get(name, ZOO_FIELDS.get(name))
        if reason is not None:
            raise ValueError(f"--{name} cannot be set here: {reason}")
        if name not in valid:
            close = difflib.get_close_matches(name, sorted(valid), n=1)
            raise ValueError(f"--{name} is not one of {cls.arguments_class.__name__}'s fields"
                             + (f" (did you mean --{close[0]}?)" if close else ""))  # fmt: skip
    given = {name: getattr(options, option) for name, option in mirrored.items()} | options.training_args
    if given.get("bf16") and given.get("fp16"):
        raise ValueError("--bf16 and --fp16 exclude each other: choose one mixed precision")
    if given.get("fp16") and not torch.cuda.is_available():
        raise ValueError("--fp16 needs a CUDA GPU, and this machine has none: --bf16 runs on the CPU too")
    check_evaluation_options(options)
    pushing = [name for name in PUSH_FIELDS if name in options.training_args]
    if pushing:
        raise ValueError(f"--{pushing[0]} is the train command's (the Trainer would push its checkpoints, without the "
                         "model's code): in Python, push the folder the run wrote with moezoo.training.push."
                         "push_trained_folder, or with `moezoo export` and `moezoo push`")  # fmt: skip
    if "report_to" in given:
        check_trackers(trackers(given["report_to"]))


# What `pip install` takes for the trackers whose package is not named as the tracker is: tensorboard writes through
# tensorboardX, which the `train` extra brings (transformers falls back to it when the larger `tensorboard` is absent).
TRACKER_PACKAGES = {"tensorboard": "'moezoo[train]'", "azure_ml": "azureml-core"}


def check_trackers(names: list[str]) -> None:
    """Refuses a `--report_to` name that transformers does not know, or whose package is not installed (naming the pip
    command that installs it)."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    known = ["all", "none", *INTEGRATION_TO_CALLBACK]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(f"--report_to {name}: not a tracker transformers knows"
                             + (f" (did you mean {close[0]}?)" if close else f" ({', '.join(known)})"))  # fmt: skip
    available = get_available_reporting_integrations()
    missing = [name for name in names if name not in ("all", "none", *available)]
    if missing:
        packages = " ".join(TRACKER_PACKAGES.get(name, name) for name in missing)
        raise ValueError(f"--report_to {','.join(missing)}: not installed here, `pip install {packages}` installs it "
                         f"(installed trackers: {', '.join(available) or 'none'})")  # fmt: skip


@dataclass
class TrainerOptions:
    """The options every train command takes (`add_trainer_arguments`); each architecture's options dataclass extends
    it, redeclaring the defaults it changes. `training_args` holds any other field of `arguments_class` by name (the
    command line's `--bf16`, `--lr_scheduler_type`, `--max_grad_norm`, `--report_to`, ...), checked when the options
    are made, before anything is loaded (`check_training_args`)."""

    # The Trainer arguments the recipe builds (`training_arguments`), and the fields of them it sets itself, with why.
    arguments_class: ClassVar[type] = TrainingArguments
    recipe_fields: ClassVar[dict[str, str]] = {}
    # The metrics its evaluation computes (`moezoo.training.evaluation`), without their `eval_` prefix; none: the
    # recipe does not evaluate while training.
    eval_metrics: ClassVar[tuple[str, ...]] = ()

    steps: int = 200
    batch_size: int = 8
    learning_rate: float | None = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    seed: int = 0
    logging_steps: int = 10
    save_steps: int = 0  # a checkpoint every this many optimizer steps (0: none), for `resume`
    resume: bool = False  # continue from the latest checkpoint of an earlier run with the same `out`
    fsdp: int = 1  # FSDP2 over this many processes (the launch's), see `moezoo.training.distributed`
    ep: int = 1  # expert parallelism over this many processes
    ep_implementation: str = "auto"  # how tokens reach the experts under `ep` (transformers' EPImplementationInterface)
    deepspeed: str | None = None  # DeepSpeed ZeRO: a preset name or config file, see `moezoo.training.deepspeed_zero`
    training_args: dict[str, Any] = field(default_factory=dict)  # other Trainer arguments by name
    eval_data: Any = None  # evaluation data in the format of the training data (`moezoo.training.evaluation`)

    def __post_init__(self):
        deepspeed_zero.check_deepspeed(self.deepspeed, self.fsdp, self.ep)
        check_training_args(self)


def add_trainer_arguments(
    parser: argparse.ArgumentParser, defaults, helps: dict[str, str] | None = None, arguments_class=None
) -> None:
    """
    The options every train command takes: each field of `arguments_class` (default: that of `defaults`, an options
    dataclass) as a flag of its own name, parsed as transformers' `HfArgumentParser` parses it (`--bf16`,
    `--learning_rate`, `--lr_scheduler_type`, ...; the defaults of those the options hold are `defaults`'), today's
    flag names as aliases, `--config FILE` (`parse_train_arguments`), and the zoo's own: `--resume`, `--fsdp`, `--ep`,
    `--ep-implementation`, `--deepspeed`. `helps` gives some fields a help text (keyed by field name).
    """
    arguments_class = arguments_class or defaults.arguments_class
    helps = {
        "save_steps": "write a Trainer checkpoint to OUT.checkpoints every SAVE_STEPS optimizer steps (0: none); it "
                      "is deleted once OUT is written, and kept when the run fails or is interrupted, for --resume",
        "push_to_hub": "once OUT is written, export it as `moezoo export` does (remote code, model card with this "
                       "command's options and final metrics) and push it to --hub_model_id (default: YOUR_NAME/the "
                       "name of OUT); HF_HUB_OFFLINE and the token are checked before anything is loaded",
        "hub_model_id": "with --push_to_hub: the repo to push to, ORG/NAME (NAME alone: under your user name)",
        "hub_token": "with --push_to_hub: a Hub token (default: `hf auth login`'s, or HF_TOKEN)",
        "hub_private_repo": "with --push_to_hub: create the repo private",
        "hub_revision": "with --push_to_hub: push to this branch (created if needed)",
    } | (helps or {})  # fmt: skip
    mirrored = mirrored_fields(type(defaults))
    group = parser.add_argument_group(
        f"the Trainer's arguments (transformers' {arguments_class.__name__}, one flag per field; not given, the "
        "Trainer's default, or this command's where it says so)"
    )
    group.add_argument("--config", metavar="FILE",
                       help="a YAML or JSON file of options by name (learning_rate: 1e-4, lora_r: 8, ...); the "
                            "command line's flags override it")  # fmt: skip
    hints = get_type_hints(arguments_class)
    names = []
    for declared in dataclasses.fields(arguments_class):
        name = declared.name
        if not declared.init or name in NOT_FLAGS:
            continue
        flag = copy.copy(declared)  # HfArgumentParser rewrites its type: not the class's own field
        flag.type = hints[name]
        help_text = helps.get(name, flag.metadata.get("help", ""))
        if name in mirrored and name not in helps:
            help_text += f" (default here: {getattr(defaults, mirrored[name])})"
        refused = type(defaults).recipe_fields.get(name, ZOO_FIELDS.get(name))
        if refused is not None:
            help_text = f"not set here: {refused}"
        flag.metadata = MappingProxyType(dict(flag.metadata) | {"help": help_text.replace("%", "%%")})
        HfArgumentParser._parse_dataclass_field(group, flag)
        names.append(name)
    for alias, name in ALIASES.items():
        group.add_argument(alias, dest=name, type=int if name != "learning_rate" else float,
                           help=f"--{name}")  # fmt: skip
    for action in parser._actions:  # a field given, on the command line or in --config, is in the namespace
        if action.dest in names:
            action.default = argparse.SUPPRESS
            if action.type is string_to_bool and action.nargs is None:  # `bool | None` fields: `--bf16` alone too
                action.nargs, action.const = "?", True
    # The usage line argparse prints before an error would otherwise list every field; and among so many flags, one
    # cut short (`--learning_rat`) is a typo more often than a choice, which argparse would take for the flag it starts.
    parser.usage = "%(prog)s --model MODEL --data DATA --out OUT [option ...] (see --help)"
    parser.allow_abbrev = False
    parser.set_defaults(trainer_fields=frozenset(names))
    parser.add_argument("--eval_data", "--eval-data", metavar="FILE",
                        help="evaluation data in the format of --data: this command's metrics on it are logged as "
                             "eval_<name> every --eval_steps steps (default: --logging_steps)")  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run of this command (same options and --out) from its latest "
                             "checkpoint in OUT.checkpoints")  # fmt: skip
    parser.add_argument("--fsdp", type=int, default=defaults.fsdp, metavar="N",
                        help="shard parameters, gradients and optimizer state over N processes with FSDP2 (N: the "
                             "number of processes of the launch); without it a distributed launch runs "
                             "DDP")  # fmt: skip
    parser.add_argument("--ep", type=int, default=defaults.ep, metavar="N",
                        help="expert parallelism: each of N processes holds a contiguous range of every MoE layer's "
                             "routed experts, tokens reach them by all-to-all (implies --fsdp WORLD_SIZE)")  # fmt: skip
    parser.add_argument("--ep-implementation", default=defaults.ep_implementation,
                        choices=EPImplementationInterface().valid_keys(),
                        help="with --ep: how tokens reach the experts, a name registered in transformers' "
                             "EPImplementationInterface (dedup: moezoo's, one copy of a token per rank that holds "
                             "any of its experts; all_to_all: one per (token, expert) pair; auto: all_to_all while "
                             "training)")  # fmt: skip
    parser.add_argument("--deepspeed", default=defaults.deepspeed, metavar="CONFIG",
                        help="train with DeepSpeed ZeRO on the processes of the launch: a DeepSpeed config file "
                             f"(JSON) or a preset ({', '.join(deepspeed_zero.PRESETS)}: ZeRO-3, parameters, gradients "
                             "and optimizer state sharded); not with --fsdp / --ep; needs "
                             f"`{deepspeed_zero.INSTALL}`")  # fmt: skip


def trainer_options(args: argparse.Namespace, options_class=TrainerOptions) -> dict:
    """The options of `add_trainer_arguments` as keyword arguments of `options_class` (a subclass of `TrainerOptions`):
    the Trainer arguments given (on the command line or in `--config`) that it holds, the others as its
    `training_args`, and the zoo's own."""
    given = {name: getattr(args, name) for name in args.trainer_fields if hasattr(args, name)}
    mirrored = mirrored_fields(options_class)
    return {mirrored[name]: value for name, value in given.items() if name in mirrored} | dict(
        training_args={name: value for name, value in given.items() if name not in mirrored},
        resume=args.resume, fsdp=args.fsdp, ep=args.ep, ep_implementation=args.ep_implementation,
        deepspeed=args.deepspeed, eval_data=args.eval_data,
    )  # fmt: skip


def parse_train_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """
    `parser.parse_args(argv)` for a train command, with `--config FILE` (YAML or JSON: a mapping of options by flag or
    field name) read first, as if its options came before `argv`'s on the command line: argparse checks their types
    and choices, and a flag given on the command line overrides the file's value.
    """
    config = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    config.add_argument("--config")
    path = config.parse_known_args(argv)[0].config
    if path is None:
        return parser.parse_args(argv)
    return parser.parse_args(config_flags(parser, read_config(path), path) + argv)


def read_config(path: str | Path) -> dict:
    """The mapping of a YAML or JSON config file (YAML reads JSON too)."""
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not YAML or JSON: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must hold a mapping of options by name, like `learning_rate: 1e-4`")
    return config


def config_flags(parser: argparse.ArgumentParser, config: dict, path) -> list[str]:
    """The command-line flags that say what `config` does, each key a flag's name without its dashes or the field it
    sets (`learning_rate`, `lr`, `lora-r`, `lora_r`); an unknown key is refused with the closest known one."""
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--config"):
                actions.setdefault(option[2:], []).append(action)
                actions.setdefault(action.dest, []).append(action)
    flags = []
    for key, value in config.items():
        if key not in actions:
            close = difflib.get_close_matches(str(key), sorted(actions), n=1)
            raise ValueError(f"--config {path}: unknown key {key!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))  # fmt: skip
        if value is None:
            continue
        switches = [action for action in actions[key] if action.nargs == 0]
        named = [action for action in switches if f"--{key}" in action.option_strings]
        if named and isinstance(value, bool):  # a switch by its flag's name (`freeze-router: true`): given if true
            flags += [f"--{key}"] if value else []
            continue
        if switches:  # store_true / store_false by their field: the one whose value is the file's, none for the default
            chosen = [action for action in switches if action.const == value]
            if chosen:
                flags.append(chosen[0].option_strings[0])
            elif value != switches[0].default:
                raise ValueError(f"--config {path}: {key} is true or false, got {value!r}")
            continue
        flag, many = actions[key][0].option_strings[0], actions[key][0].nargs in ("+", "*")
        if isinstance(value, list):  # `report_to: [tensorboard, trackio]` is `--report_to tensorboard,trackio`
            flags += [flag, *map(str, value)] if many else [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return flags
