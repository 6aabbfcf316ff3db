"""The zoo's catalogue: architectures, presets and converters, kept as data.

Each architecture family contributes one module under `moezoo/presets/` with three pieces of data, in the manner of
timm's pretrained configs and open_clip's model configs:

    ARCHITECTURES = [Architecture(...)]   # its classes, Auto classes, processor, model card (one per model_type)
    PRESETS = [Preset(...), ...]          # named configs with their base checkpoints and converter
    CONVERTERS = [Converter(...), ...]    # source formats it can be converted from

Classes and functions are named as "module:attribute" strings and imported only when used, so listing presets
never imports a model file. `import moezoo` registers every architecture with transformers' Auto classes.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str  # the top-level config's model_type
    title: str  # how people write it: "MoE-ViE"
    config: str  # "module:ConfigClass"
    # Auto class name -> "module:Class"; the first entry is what `create` and `convert` build.
    models: Mapping[str, str]
    processor: str | None = None  # "module:ProcessorClass"
    # Text-only architectures ship a tokenizer instead of a processor ("module:TokenizerClass", e.g. AutoTokenizer).
    tokenizer: str | None = None
    # Other Auto classes the processor's parts serve, e.g. {"AutoImageProcessor": "module:Class"}.
    processor_parts: Mapping[str, str] = field(default_factory=dict)
    # "module:function(config) -> processor (or tokenizer)" that builds one offline (tiny tokenizers etc.).
    make_processor: str | None = None
    pipeline_tag: str = "feature-extraction"
    model_card: str = ""  # template file name in model_cards/
    tags: tuple[str, ...] = ()
    # Sub-config model_types that must be registered with AutoConfig too (vision/text towers).
    sub_configs: Mapping[str, str] = field(default_factory=dict)
    # The AutoModel class of a sub-config whose model serves alone, as transformers maps `glm_ocr_text` to
    # GlmOcrTextModel: sub-config model_type -> "module:Class".
    sub_models: Mapping[str, str] = field(default_factory=dict)
    # The submodules the paper's parameter counts cover, if not the whole model (MoE-ViE counts its vision tower
    # with its projection).
    paper_counted_modules: tuple[str, ...] = ()
    # The paper's name when one paper yields several architectures (MoTE: videollm_mote, glm_ocr_mote, llama_mote):
    # `moezoo convert --to FAMILY` then picks the member from the source.
    family: str | None = None

    def model_class(self, auto_class: str | None = None):
        """The class serving `auto_class` (default: the primary model class)."""
        return resolve(self.models[auto_class or next(iter(self.models))])

    def config_class(self):
        return resolve(self.config)


@dataclass(frozen=True)
class ParameterClaim:
    """The parameter counts a paper states for a preset's model, where they differ from the counts of the model built
    from the paper's stated configuration: `moezoo list` prints them beside the counted totals, with the counts of
    `parts`, the readings that come closest to the claim."""

    total: int
    active: int
    source: str  # where the paper states it: "Table 2"
    # label -> the submodules counted together, e.g. {"language model": ("model.language_model", "lm_head")}
    parts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    name: str
    architecture: str
    config: Mapping[str, Any]  # keyword arguments of the architecture's config class
    description: str = ""
    base_checkpoints: tuple[str, ...] = ()  # Hub ids the preset is converted from, if any
    converter: str | None = None  # name of the Converter that produces it
    license: str | None = None  # inherited from the base checkpoint
    variant: str | None = None  # converter variant, when the architecture has several designs
    paper_claim: ParameterClaim | None = None  # the paper's own count, when the counted one differs


@dataclass(frozen=True)
class Converter:
    name: str
    architecture: str
    # What it converts from: config model_types ("siglip2") or file formats ("openclip-moe-vie").
    sources: tuple[str, ...]
    function: str  # "module:function(source: Path, options: dict) -> ConversionResult"
    description: str = ""
    variants: tuple[str, ...] = ()
    # "module:function(parser)" adding the converter's own command-line options.
    add_arguments: str | None = None
    # "module:function(source: Path, **options) -> moezoo.conversion.cost.PlannedOutput": the output's config and the
    # checkpoints read, from configs and headers alone (`moezoo convert --dry-run`, the disk-space check).
    plan: str | None = None


ARCHITECTURES: dict[str, Architecture] = {}
PRESETS: dict[str, Preset] = {}
CONVERTERS: dict[str, Converter] = {}
# The architectures of moezoo's own catalogue modules (not those added through MOEZOO_EXTRA_PRESETS).
ZOO_ARCHITECTURES: list[str] = []

# One module per architecture under moezoo/presets/, added as each architecture lands.
PRESET_MODULES: tuple[str, ...] = ("moe_vie", "moemb", "mote", "omnimoe_vl", "smoes")
# Modules of architectures outside moezoo (a comma-separated list of importable modules with the same three
# attributes), loaded after moezoo's own: how a project adds its architectures to the `moezoo` command.
EXTRA_PRESET_MODULES_ENV = "MOEZOO_EXTRA_PRESETS"


def resolve(path: str):
    """Import "module:attribute"."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def register(architectures: Architecture | list[Architecture], presets=(), converters=()) -> None:
    """Add architectures with their presets and converters to the catalogue (tests register toy ones)."""
    for architecture in [architectures] if isinstance(architectures, Architecture) else architectures:
        ARCHITECTURES[architecture.name] = architecture
    for preset in presets:
        if preset.architecture not in ARCHITECTURES:
            raise ValueError(f"preset {preset.name!r} names unknown architecture {preset.architecture!r}")
        PRESETS[preset.name] = preset
    for converter in converters:
        CONVERTERS[converter.name] = converter


def load_catalogue() -> None:
    for name in PRESET_MODULES:
        module = importlib.import_module(f"moezoo.presets.{name}")
        register(module.ARCHITECTURES, module.PRESETS, module.CONVERTERS)
        ZOO_ARCHITECTURES.extend(architecture.name for architecture in module.ARCHITECTURES)
    extra = [name.strip() for name in os.environ.get(EXTRA_PRESET_MODULES_ENV, "").split(",") if name.strip()]
    for module_name in extra:
        # A broken extension must not make `import moezoo` (and with it every command) fail: it is left out, said.
        try:
            module = importlib.import_module(module_name)
            register(module.ARCHITECTURES, module.PRESETS, getattr(module, "CONVERTERS", ()))
        except (ImportError, AttributeError, ValueError) as error:
            warnings.warn(
                f"{EXTRA_PRESET_MODULES_ENV} names {module_name!r}, which was left out: {type(error).__name__}: "
                f"{error}. It must be an importable module with ARCHITECTURES and PRESETS (and optionally "
                f"CONVERTERS); fix it or remove it from {EXTRA_PRESET_MODULES_ENV}",
                stacklevel=2,
            )


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES)) or "none registered"
        raise KeyError(f"unknown architecture {name!r}; moezoo knows: {known}")
    return ARCHITECTURES[name]


def architectures_named(name: str) -> list[Architecture]:
    """The architecture `name`, or every member of the family `name` (e.g. `mote`)."""
    if name in ARCHITECTURES:
        return [ARCHITECTURES[name]]
    members = [architecture for architecture in ARCHITECTURES.values() if architecture.family == name]
    if not members:
        families = sorted({a.family for a in ARCHITECTURES.values() if a.family})
        raise KeyError(
            f"unknown architecture {name!r}; moezoo knows: {', '.join(sorted(ARCHITECTURES)) or 'none registered'}"
            + (f" (and the families {', '.join(families)})" if families else "")
        )
    return members


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS)) or "none registered"
        raise KeyError(f"unknown preset {name!r}; `moezoo list` shows the presets ({known})")
    return PRESETS[name]


def register_auto_classes(architecture: Architecture) -> None:
    """Make transformers' Auto classes resolve the architecture to moezoo's classes (no remote code needed)."""
    import transformers
    from transformers import AutoConfig

    config_class = architecture.config_class()
    _register_config(AutoConfig, architecture.name, config_class)
    for model_type, sub_config_path in architecture.sub_configs.items():
        _register_config(AutoConfig, model_type, resolve(sub_config_path))
    for model_type, class_path in architecture.sub_models.items():
        sub_config_class = resolve(architecture.sub_configs[model_type])
        transformers.AutoModel.register(sub_config_class, resolve(class_path), exist_ok=True)
    for auto_name, class_path in architecture.models.items():
        getattr(transformers, auto_name).register(config_class, resolve(class_path), exist_ok=True)
    if architecture.processor:
        transformers.AutoProcessor.register(config_class, resolve(architecture.processor), exist_ok=True)
    for auto_name, class_path in architecture.processor_parts.items():
        part = resolve(class_path)
        if auto_name == "AutoImageProcessor":  # moezoo's image processors run on the PIL backend (no torchvision)
            transformers.AutoImageProcessor.register(config_class, image_processor_classes={"pil": part}, exist_ok=True)
        elif auto_name == "AutoTokenizer":
            transformers.AutoTokenizer.register(config_class, tokenizer_class=part, exist_ok=True)
        else:
            getattr(transformers, auto_name).register(config_class, part, exist_ok=True)


def _register_config(auto_config, model_type: str, config_class) -> None:
    try:
        auto_config.register(model_type, config_class, exist_ok=True)
    except ValueError as error:  # the config class declares another model_type: a bug in the entry
        raise ValueError(f"cannot register {config_class.__name__} as {model_type!r}: {error}") from error
