"""SMoES on the zoo's own models: `enable_smoes(model, SmoesSettings(...))` turns the regulariser on for a MoEMB
(`MoEmbForEmbedding`) or OmniMoE-VL (`OmniMoeVlForConditionalGeneration`) model.

The settings go to the model's `config.smoes` (validated there, as when a config is built with them) and each MoE
layer of its language model gets its SMoES buffers (`moezoo.modeling.moe.smoes.host`). A saved folder's config then
rebuilds those buffers, which load with the weights: the model class is the same, its forward in eval is unchanged,
and only a training forward computes the SMoES losses.
"""

from __future__ import annotations

from torch import nn

from ...configuration.smoes_settings import SmoesSettings
from ..moe.smoes.host import SmoesHost


def enable_smoes(model: nn.Module, settings: SmoesSettings | dict | None = None) -> SmoesHost:
    """Put SMoES (default: the paper's settings) on `model`'s language model and return its `SmoesHost`. Refused,
    naming the field, for settings the model cannot run (see `SmoesSettings.check_host` and the model config's
    `smoes`), and on a model that has SMoES already (its bins and buffers exist: build it from a config with other
    settings instead)."""
    text_model = getattr(model.base_model, "language_model", None)
    if not hasattr(text_model, "attach_smoes"):
        raise ValueError(
            f"{type(model).__name__} is not a zoo model with an SMoES host: enable_smoes works on MoEMB and OmniMoE-VL "
            "models (Qwen3.5-MoE has its own class, SmoesQwen3_5MoeForConditionalGeneration)"
        )
    if text_model.smoes is not None:
        raise ValueError(
            f"{type(model).__name__} has SMoES already (config.smoes={model.config.smoes}); its bins and buffers exist, "
            "so build the model from a config with other settings instead"
        )
    config = model.config
    settings = SmoesSettings.from_dict(settings if settings is not None else {}, "enable_smoes(settings)")
    config.smoes = settings.to_dict()
    try:
        config.validate_fields()
    except ValueError:
        config.smoes = None
        raise
    return text_model.attach_smoes(config.smoes_settings())
