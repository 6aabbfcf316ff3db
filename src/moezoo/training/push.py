"""
`moezoo train ARCH --push_to_hub`: once the run has written `--out`, the folder is exported as `moezoo export` exports
it (flat layout, remote code, model card) and pushed as `moezoo push` pushes it.

The Trainer itself never pushes: its `push_to_hub` uploads its checkpoints, without the model's code, at every save.
So the Trainer's Hub fields are the train command's own: `take_push_options` takes them off the parsed command line
before the recipe builds its options (which refuse them, `PUSH_FIELDS`), and checks at once what would otherwise fail
only after hours of training: `HF_HUB_OFFLINE`, the token, and the Hub's answer to it (`whoami`). The model card
records the command's options that are not left at their defaults and, from the run's summary in `moezoo.json`, its
final metrics.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..hub.export import export_folder
from ..hub.push import push_folder
from ..hub.sources import transport_errors
from .arguments import PUSH_FIELDS, config_flags

# Options that say where a run reads and writes on this machine, not how it trains: left out of the model card.
LOCAL_OPTIONS = ("model", "data", "out", "eval_data", "image_root", "config", "overwrite", "resume")


@dataclass(frozen=True)
class HubPush:
    """Where and how to push a trained folder (`take_push_options` makes it from a train command's options; in
    Python, e.g. `push_trained_folder("trained", HubPush("my-org/my-model"))`)."""

    repo_id: str
    token: str | None = None  # None: `hf auth login`'s, or HF_TOKEN
    private: bool | None = None  # None: the Hub's default (public, unless the organisation says private)
    revision: str | None = None  # a branch, created if needed
    command: str | None = None  # the command that trained the model, with its non-default options, for the card


def take_push_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> HubPush | None:
    """
    Removes the Hub fields (`PUSH_FIELDS`) from `args`, the parsed options of a train command, and returns where to
    push its trained folder, or None without `--push_to_hub`. Checked here, before anything is loaded:
    `HF_HUB_OFFLINE`, the token (`--hub_token`, else `hf auth login`'s or `HF_TOKEN`), the Hub's answer to it, and
    `--hub_model_id` (default: `USER/NAME`, NAME being `--out`'s folder name, as transformers defaults to its output
    folder's).
    """
    given = {name: vars(args).pop(name) for name in PUSH_FIELDS if name in vars(args)}
    if not given.get("push_to_hub"):
        needless = [name for name in given if name != "push_to_hub"]
        if needless:
            raise ValueError(f"--{needless[0]} is for --push_to_hub, which is not given")
        return None
    if constants.HF_HUB_OFFLINE:
        raise ValueError("--push_to_hub: HF_HUB_OFFLINE is set, so the trained model could not be pushed; unset it, "
                         "or train without --push_to_hub and push later with `moezoo export` and "
                         "`moezoo push`")  # fmt: skip
    token = given.get("hub_token") or get_token()
    if token is None:
        raise ValueError("--push_to_hub needs a Hub token: log in with `hf auth login`, or set HF_TOKEN (or give "
                         "--hub_token)")  # fmt: skip
    user = hub_user(token)
    repo_id = given.get("hub_model_id") or Path(args.out).resolve().name
    if "/" not in repo_id:  # what the Hub does with a bare name, said before training rather than found after
        repo_id = f"{user}/{repo_id}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"--hub_model_id {repo_id}: not a Hub repo id ({error})") from None
    return HubPush(repo_id=repo_id, token=token, private=given.get("hub_private_repo"),
                   revision=given.get("hub_revision"), command=training_command(parser, args))  # fmt: skip


def hub_user(token: str) -> str:
    """The name of the Hub user whose `token` it is, asking the Hub (`HF_ENDPOINT`) once; a token that cannot write
    is refused, as the push at the end would be."""
    try:
        account = HfApi(token=token).whoami()
    except HfHubHTTPError as error:
        raise ValueError(f"--push_to_hub: the Hub at {constants.ENDPOINT} refused the token ({error}); log in again "
                         "with `hf auth login`, or set HF_TOKEN") from None  # fmt: skip
    except transport_errors() as error:
        raise ConnectionError(f"--push_to_hub: cannot reach the Hub at {constants.ENDPOINT} ({type(error).__name__}: "
                              f"{error}); check the network and HF_ENDPOINT, or train without --push_to_hub and push "
                              "later with `moezoo export` and `moezoo push`") from None  # fmt: skip
    if account.get("auth", {}).get("accessToken", {}).get("role") == "read":
        raise ValueError(f"--push_to_hub: the token of {account['name']} is read-only; create a write token at "
                         "https://huggingface.co/settings/tokens")  # fmt: skip
    return account["name"]


def training_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """`moezoo train ARCH` with the options of `args` that are not left at their defaults (the Trainer's fields given
    on the command line or in `--config`, the recipe's own that differ from theirs), the local paths left out."""
    non_default = {}
    for action in parser._actions:
        name = action.dest
        if name in non_default or name in LOCAL_OPTIONS or not hasattr(args, name):
            continue
        value = getattr(args, name)
        if action.default is argparse.SUPPRESS or value != action.default:
            non_default[name] = value
    return f"{parser.prog} {shlex.join(config_flags(parser, non_default, 'the command line'))}"


def push_trained_folder(out: str | Path, push: HubPush) -> str:
    """Exports the trained folder `out` into a scratch folder beside it, with the training command (if known) in its
    card and `moezoo.json`, pushes that, and returns the commit URL. `out` stays as the run wrote it."""
    out = Path(out)
    training = None if push.command is None else {"command": push.command}
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.hub-", dir=out.parent) as scratch:
        exported = export_folder(out, Path(scratch) / out.name, repo_id=push.repo_id, training=training)
        try:
            return push_folder(exported, push.repo_id, private=push.private, revision=push.revision, token=push.token)
        except ConnectionError as error:
            raise ConnectionError(f"{error}; the trained model is in {out}: push it later with `moezoo export {out} "
                                  f"--out EXPORTED` and `moezoo push EXPORTED {push.repo_id}`") from error  # fmt: skip
