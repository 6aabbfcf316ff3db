"""SMoES in the zoo's own trainers: `moezoo train moemb --smoes` and `moezoo train omnimoe_vl --smoes` put the SMoES
regulariser on the model's language experts (`moezoo.modeling.smoes.enable_smoes`) before training.

- `add_smoes_arguments` / `smoes_settings_from_args`: the `--smoes` option group both commands share (the settings
  not given keep `SmoesSettings`' defaults, the paper's values);
- `LogsSmoesTerms`: a `Trainer` mixin that logs, beside the loss, the SMoES terms of each step's training forwards
  (`smoes_bal_loss`, `smoes_mi_loss`, `smoes/mi_layer_<l>` for the l-th MoE layer), as `moezoo train smoes` does;
- `write_modality_routing`: after training, each MoE layer's MSI (`smoes_msi.json`) and the per-modality routing
  heatmap (`routing_by_modality.png`), as `moezoo train smoes` writes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from ..configuration.smoes_settings import SmoesSettings
from ..modeling.moe.smoes.bins import BINNING_TYPES
from ..modeling.moe.smoes.regularizer import per_token_rows
from ..modeling.moe.smoes.scores import SCORE_TYPES, hard_modality
from ..modeling.moe.statistics import plot_routing_heatmap
from .callbacks import LogsStepMeans
from .smoes import modality_routing


# The settings the command line sets: (option, type or choices, metavar, help); each is the `SmoesSettings` field of
# its name.
SMOES_OPTIONS = (
    ("--smoes-num-bins", int, "N", "bins per MoE layer (must divide the experts)"),
    ("--smoes-score-type", SCORE_TYPES, None, "the soft modality score"),
    ("--smoes-mi-coef", float, "ALPHA", "alpha_MI, weight of the negative inter-bin mutual information"),
    ("--smoes-bal-coef", float, "ALPHA", "alpha_bal, weight of the bin-level balance loss"),
    ("--smoes-binning", BINNING_TYPES, None, "adaptive bins or fixed contiguous ones (an ablation)"),
    ("--smoes-ep-devices", int, "D", "expert-parallel devices the bins are placed on (must divide the bins)"),
    ("--smoes-mi-warmup-steps", int, "N", "linear warm-up of alpha_MI over this many training forwards"),
)


def add_smoes_arguments(parser) -> None:
    defaults = SmoesSettings()
    group = parser.add_argument_group("SMoES", "the SMoES routing regulariser on the language experts (docs/smoes.md)")
    group.add_argument("--smoes", action="store_true",
                       help="train the language experts' routers with SMoES' bin-level balance and inter-bin MI losses "
                            "(in place of their load balancing, where the model has one); the model is saved with "
                            "its SMoES settings and buffers")  # fmt: skip
    for option, kind, metavar, help_text in SMOES_OPTIONS:
        default = getattr(defaults, option[2:].replace("-", "_"))
        if isinstance(kind, tuple):
            group.add_argument(option, choices=kind, help=f"{help_text} (default {default})")
        else:
            group.add_argument(option, type=kind, metavar=metavar, help=f"{help_text} (default {default})")


def smoes_settings_from_args(args) -> SmoesSettings | None:
    """The settings of `--smoes` and its options (None without `--smoes`; an option without it is refused)."""
    fields = [option[2:].replace("-", "_") for option, *_ in SMOES_OPTIONS]
    given = {field: getattr(args, field) for field in fields if getattr(args, field) is not None}
    if not args.smoes:
        if given:
            options = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{options} set SMoES up: add --smoes")
        return None
    return SmoesSettings(**given)


class LogsSmoesTerms(LogsStepMeans):
    """A `Trainer` mixin (placed before the trainer class) for models whose training forwards return SMoES terms:
    `record_smoes_terms(outputs)` returns the sum of their weighted SMoES losses (`aux_loss`; None without SMoES) and
    records it (`smoes_loss`) with, as means over those forwards, the bin-level balance loss (`smoes_bal_loss`), minus
    the inter-bin MI (`smoes_mi_loss`) and each MoE layer's MI in nats (`smoes/mi_layer_<l>`)."""

    def record_smoes_terms(self, outputs: Sequence) -> torch.Tensor | None:
        outputs = [output for output in outputs if getattr(output, "smoes_mi", None) is not None]
        if not outputs:
            return None
        for name in ("smoes_bal_loss", "smoes_mi_loss"):
            self.record_step_value(name, torch.stack([getattr(output, name) for output in outputs]).mean())
        for layer, information in enumerate(torch.stack([output.smoes_mi for output in outputs]).mean(dim=0)):
            self.record_step_value(f"smoes/mi_layer_{layer}", information)
        loss = sum(output.aux_loss for output in outputs)
        self.record_step_value("smoes_loss", loss)
        return loss


def smoes_panels(num_moe_layers: int) -> dict[str, str]:
    """The training-curve panels of the SMoES terms (`moezoo.training.plots.plot_log_history`)."""
    panels = {"bin balance": "smoes_bal_loss", "- inter-bin MI": "smoes_mi_loss"}
    return panels | {f"MI MoE layer {layer}": f"smoes/mi_layer_{layer}" for layer in range(num_moe_layers)}


@torch.no_grad()
def write_modality_routing(
    batches: Iterable[tuple[Sequence[torch.Tensor], torch.LongTensor, torch.Tensor]],
    num_experts: int,
    top_k: int,
    folder: Path,
    title: str,
) -> float:
    """From `(router logits per MoE layer, (B, T) hard modality, (B, T) validity)` of evaluation batches (logits of
    all tokens, or of the valid ones as the core's blocks return them): write each MoE layer's MSI and their mean to
    `folder/smoes_msi.json`, the per-modality routing heatmap to `folder/routing_by_modality.png`, and return the
    mean MSI."""
    selections, modalities, valids = [], [], []
    for router_logits, modality, valid in batches:
        selections.append([per_token_rows(logits, valid).topk(top_k, dim=-1).indices for logits in router_logits])
        modalities.append(modality)
        valids.append(valid)
    stats, msi = modality_routing(selections, modalities, valids, num_experts)
    plot_routing_heatmap(stats, folder / "routing_by_modality.png", title=title)
    mean = round(sum(msi) / len(msi), 4)
    (folder / "smoes_msi.json").write_text(json.dumps({"msi_per_layer": msi, "msi": mean}, indent=2) + "\n")
    return mean


def token_type_modality(vision_token_types: Sequence[int]) -> Callable[[dict], tuple[torch.LongTensor, torch.Tensor]]:
    """A batch's hard modality from its `mm_token_type_ids` and its validity from its `attention_mask`."""
    return lambda batch: (hard_modality(batch["mm_token_type_ids"], vision_token_types), batch["attention_mask"].bool())


@torch.no_grad()
def evaluation_routing(
    model, batches: Iterable[dict], token_modality: Callable[[dict], tuple[torch.LongTensor, torch.Tensor]]
) -> list[tuple[Sequence[torch.Tensor], torch.LongTensor, torch.Tensor]]:
    """In eval mode, each batch's router logits with its tokens' hard modality and validity (`token_modality(batch)`),
    for `write_modality_routing`."""
    was_training = model.training
    model.eval()
    routing = []
    for batch in batches:
        batch = {key: value.to(model.device) for key, value in batch.items() if key != "labels"}
        routing.append((model(**batch, output_router_logits=True).router_logits, *token_modality(batch)))
    model.train(was_training)
    return routing
