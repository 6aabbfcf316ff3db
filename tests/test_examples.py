"""The papers' recipes in examples/: each YAML file is a `--config` of `moezoo train ARCH` (ARCH: its name's prefix),
run here through the command's entry point on ARCH's tiny model and a few synthetic examples, its steps and batch size
overridden on the command line, so that a key that stops being an option, or a value the command refuses, fails."""

import json
import re
from pathlib import Path

import pytest

from conftest import run_moezoo_in_this_process
from moezoo.cli import TRAINERS

# The tiny model and data of each train command, in the format it reads.
from test_training_arguments import inputs  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))
# What makes a paper's recipe a run of seconds on a tiny model: two steps of two examples.
TINY_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1"]


def command_of(recipe: Path) -> str:
    """The train command a recipe is for: the architecture its file name starts with."""
    (architecture,) = [name for name in TRAINERS if recipe.stem.startswith(f"{name}_")]
    return architecture


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda recipe: recipe.stem)
def test_each_recipe_trains_its_tiny_model(recipe, inputs, tmp_path, capfd):  # noqa: F811
    architecture, out = command_of(recipe), tmp_path / "trained"
    result = run_moezoo_in_this_process(capfd, "train", architecture, *inputs[architecture], "--out", out,
                                        "--config", recipe, *TINY_RUN)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "moezoo.json").read_text())["training"]["steps"] == 2


def test_every_architecture_has_a_recipe_and_the_index_lists_each():
    assert sorted({command_of(recipe) for recipe in RECIPES}) == sorted(TRAINERS)
    links = re.findall(r"\]\(([^)#]+)", (EXAMPLES / "README.md").read_text())
    assert all((EXAMPLES / link).exists() for link in links), links
    assert sorted(link for link in links if link.endswith(".yaml")) == [recipe.name for recipe in RECIPES]
    for recipe in RECIPES:  # the comment at the top names the paper's sections the values come from
        header = recipe.read_text().partition("\n\n")[0].partition("\n#\n")[0]
        assert header.startswith("# ") and re.search(r"paper (§|App\.)", header), recipe.name
