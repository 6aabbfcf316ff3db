"""Model cards: one Jinja template per architecture in the repository's `model_cards/`, rendered at export.

The YAML metadata is built here (huggingface_hub's `ModelCardData`), the prose comes from the template. A template
receives:
    card_data        the YAML block (without the --- fences)
    repo_id          where the model will live (a Hub id, or the folder path before a push)
    architecture     the architecture's model_type (one template may serve several, e.g. MoTE's)
    title            the architecture's name
    provenance       the folder's moezoo.json: source, base_model, converter, max_abs_diff, training, ...
    parameters       {"total": int, "active": int}
    moezoo_version
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from huggingface_hub import ModelCard, ModelCardData

from .. import __version__
from ..registry import Architecture


def model_cards_dir() -> Path:
    """The templates' folder: `moezoo/model_cards`, a link to the repository's `model_cards/` in the source tree and
    a copy of it in an installed wheel."""
    folder = Path(__file__).resolve().parents[1] / "model_cards"
    if not folder.is_dir():
        raise FileNotFoundError(f"model card templates not found at {folder}; reinstall moezoo")
    return folder


def template_path(architecture: Architecture) -> Path:
    path = Path(architecture.model_card)
    return path if path.is_absolute() else model_cards_dir() / path


def card_metadata(architecture: Architecture, provenance: dict) -> ModelCardData:
    tags = ["mixture-of-experts", "moezoo", architecture.name, *architecture.tags]
    training = provenance.get("training") or {}
    return ModelCardData(
        library_name="transformers",
        pipeline_tag=architecture.pipeline_tag,
        tags=list(dict.fromkeys(tags)),
        license=provenance.get("license") or "other",
        base_model=provenance.get("base_model"),
        datasets=training.get("datasets"),
    )


def render_model_card(
    architecture: Architecture, provenance: dict, parameters: dict, repo_id: str
) -> ModelCard:
    template = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_path(architecture).parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    ).get_template(template_path(architecture).name)
    text = template.render(
        card_data=card_metadata(architecture, provenance).to_yaml(),
        repo_id=repo_id,
        architecture=architecture.name,
        title=architecture.title,
        provenance=provenance,
        parameters=parameters,
        moezoo_version=__version__,
    )
    return ModelCard(text)
