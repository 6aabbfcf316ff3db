"""Training OmniMoE-VL with `transformers.Trainer` (spec omnimoe_vl.md §3; paper §5.1 "Progressive optimization").

- Stages (`set_trainable`, spec §3.2): I trains the projector alone; II the language model's MoE blocks (routers and
  experts); III the vision tower's MoE blocks; II and III train the projector too unless told otherwise; IV trains
  everything. Each stage is its own run on its own data: `--stage II --model <Stage I's output>`.
- Objectives (spec §3.1) live in the model: its `loss` holds them all, so any trainer that uses it trains them
  (`OmniMoeVlTrainer`; TRL's `SFTTrainer` with the `OmniMoeVlLoss` mixin, see there). They are the language-model
  loss, the token experts' load balancing of both stacks (`aux_loss`, with `output_router_logits`, which
  `OmniMoeVlLoss` passes) and, in `train()` mode, the route's objectives (`routing_losses`: L_q, L_ent, L_div,
  L_rdiv, L_bal on by default; L_util with `router_utility="grad"`, L_fac with `adapter_factor_reg_coef > 0`).
  `OmniMoeVlLoss` logs each term beside the loss; the curves show them.
- Schedules and exploration count the projector's `routing_step`, which `RoutingStepCallback` advances once per
  optimizer step (not per forward, so gradient accumulation does not speed them up) and which no stage resets: it is a
  buffer saved with the model (spec D11).
- LoRA (`lora_r`, Stages II-IV): one adapter per expert on the fused experts of the stage's MoE blocks
  (`moezoo.training.expert_lora`, what PEFT's `target_parameters` computes) and, in Stage IV, PEFT adapters on the
  attention projections of both stacks; the projector and the token routers, small, train in full beside them
  (`OmniMoeVlLoraModel` keeps them and the expert adapters in its checkpoints); merged at the end.
- Several processes (`moezoo.training.distributed`): DDP, and `--fsdp` / `--ep` through
  `moezoo.training.adapted_sharding`, which shards the model once the stage has set it up (what trains, SMoES, LoRA)
  and keeps the projector's 0-d `fusion_output_scale`, which FSDP2 cannot shard, whole on every process; the
  trainer's checkpoints of such a run are distributed checkpoints (`ShardedCheckpointsMixin`). LoRA shards under
  both: under `--ep` each process adds its own experts' adapters to its shard of the experts.

`train_omnimoe_vl` (`moezoo train omnimoe_vl`) writes the model, its processor, the loss curves and the depth-route
heatmap (mean route weight per depth, per prompt type) to `out`, and a checkpoint beside it every `save_steps` steps,
from which `resume` continues an interrupted run (`moezoo.training.arguments`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from torch import nn
from transformers import Trainer, TrainerCallback, set_seed

from .. import __version__
from ..evaluation.omnimoe_vl import route_entropy
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import model_folder
from ..configuration.smoes_settings import SmoesSettings
from ..modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from ..modeling.omnimoe_vl_projector import ROUTING_OBJECTIVES, OmniMoeVlDepthRouter
from ..processors.images import open_image
from ..modeling.smoes.zoo import enable_smoes
from ..processors.omnimoe_vl import OmniMoeVlProcessor
from ..terminal import console, print_table
from .arguments import (
    TrainerOptions,
    add_trainer_arguments,
    checkpoint_to_resume,
    loss_summary,
    trainer_options,
    training_arguments,
)
from .callbacks import LogAtCheckpointsAndEnd, LogsRoutingStatistics, use_rich_progress, write_tensorboard_into
from .data import TABLE_FORMATS, empty_rows, empty_rows_error, load_table
from .adapted_sharding import load_adapted_for_training, unsharded_copy
from .distributed import check_enough_examples, main_process_output_dir
from .expert_lora import ExpertLoraModel, add_expert_adapters, merge_lora, peft_target_modules
from .evaluation import (
    EvaluatesWhileTraining,
    answer_token_values,
    check_same_format,
    evaluation_panels,
    evaluation_summary,
)
from .plots import plot_log_history
from .precision import add_dtype_argument, load_dtype
from .sharded_checkpoints import ShardedCheckpointsMixin
from .smoes_hosts import (
    LogsSmoesTerms,
    add_smoes_arguments,
    evaluation_routing,
    smoes_panels,
    smoes_settings_from_args,
    write_modality_routing,
)


STAGES = ("I", "II", "III", "IV")
# Spec §3.2 [decision]: the paper's Table 1 (its learning rates) is missing from the text, so these are MoE-LLaVA-style
# defaults, not the paper's values.
STAGE_LEARNING_RATES = {"I": 1e-3, "II": 2e-5, "III": 2e-5, "IV": 1e-5}
PROJECTOR = r"model\.projector\."
LANGUAGE_MOE_BLOCKS = r"model\.language_model\.layers\.\d+\.mlp\.(gate|experts)\."  # `mlp.gate_proj` is dense
VISION_MOE_BLOCKS = r"model\.vision_tower\.encoder\.layers\.\d+\.mlp\.(gate|experts)\."
FUSED_EXPERT_WEIGHTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|up_proj|down_proj)$")
ATTENTION_PROJECTIONS = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj|out_proj)\.weight$")
ROUTERS = re.compile(r"\.mlp\.gate\.weight$")
DEFAULT_PROMPT_TYPE = "all"


# --- what trains (spec §3.2) ----------------------------------------------------------------------------------------


def stage_pattern(stage: str, train_projector: bool = True) -> re.Pattern:
    """The parameter names (of `OmniMoeVlForConditionalGeneration`) that `stage` trains."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if stage == "I" and not train_projector:
        raise ValueError("Stage I trains the projector alone: it cannot leave the projector frozen")
    parts = {"I": [PROJECTOR], "II": [LANGUAGE_MOE_BLOCKS], "III": [VISION_MOE_BLOCKS], "IV": [r""]}[stage]
    if stage in ("II", "III") and train_projector:
        parts.append(PROJECTOR)
    return re.compile("|".join(f"(?:{part})" for part in parts))


def set_trainable(model: OmniMoeVlForConditionalGeneration, stage: str, train_projector: bool = True) -> list[str]:
    """Freeze every parameter but those `stage` trains (spec §3.2; `train_projector` is Stages II-III's option) and
    return their names, sorted."""
    pattern = stage_pattern(stage, train_projector)
    trainable = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(bool(pattern.match(name)))
        if parameter.requires_grad:
            trainable.append(name)
    return sorted(trainable)


def advance_routing_step(model: nn.Module) -> int:
    """One optimizer step more on the routing clock of every depth router in `model` (found through DDP and PEFT
    wrappers); returns the new step."""
    step = None
    for module in model.modules():
        if isinstance(module, OmniMoeVlDepthRouter):
            module.routing_step += 1
            step = int(module.routing_step)
    if step is None:
        raise ValueError("advance_routing_step: the model holds no OmniMoE-VL depth router")
    return step


class RoutingStepCallback(TrainerCallback):
    """Advances `routing_step` once per optimizer step: `on_step_end` runs after `optimizer.step()`, once per step
    whatever the gradient accumulation (spec D11)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            advance_routing_step(model)
        return control


# --- LoRA -----------------------------------------------------------------------------------------------------------


class OmniMoeVlLoraModel(ExpertLoraModel):
    """PEFT's model of `with_lora`, whose checkpoints keep, beside PEFT's adapters, the expert adapters
    (`ExpertLoraModel`), the base parameters trained in full (`trained_in_full`: the stage's projector and token
    routers) and the depth router's exploration state (routing step and usage EMA), so that a resumed run continues
    its schedules."""

    def __init__(self, model, config: LoraConfig, trained_in_full: list[str]):
        super().__init__(model, config)
        self.trained_in_full = trained_in_full

    def trained_base_parameters(self) -> dict[str, nn.Parameter | torch.Tensor]:
        base = self.get_base_model()
        parameters = dict(base.named_parameters())
        router_state = {name: buffer for name, buffer in base.named_buffers() if ".depth_router." in name}
        return {name: parameters[name] for name in self.trained_in_full} | router_state


def with_lora(
    model: OmniMoeVlForConditionalGeneration, stage: str, rank: int, train_projector: bool = True
) -> OmniMoeVlLoraModel:
    """LoRA (alpha = 2 r) on the large weights `stage` trains: the fused experts of its MoE blocks (one adapter per
    expert) and, in Stage IV, the attention projections of both stacks (PEFT; Stages II and III have none). The
    stage's projector and token routers train in full beside the adapters; everything else is frozen."""
    if stage == "I":
        raise ValueError("--lora applies to Stages II-IV: Stage I trains the projector alone, in full")
    stage_names = set_trainable(model, stage, train_projector)
    experts = [name for name in stage_names if FUSED_EXPERT_WEIGHTS.search(name)]
    attention = [name.rpartition(".")[0] for name in stage_names if ATTENTION_PROJECTIONS.search(name)]
    in_full = [name for name in stage_names if name.startswith("model.projector.") or ROUTERS.search(name)]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=peft_target_modules(attention))
    peft_model = OmniMoeVlLoraModel(model, config, in_full)
    add_expert_adapters(model, rank, 2 * rank, weights=experts)
    for name in in_full:  # PEFT froze the whole base model
        model.get_parameter(name).requires_grad_(True)
    return peft_model


# --- data -----------------------------------------------------------------------------------------------------------


def conversation(question: str, answer: str | None = None, system: str | None = None) -> list[dict]:
    """The chat messages of one example: the image first in the user turn (the processor's template), then the
    answer, if any."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


@dataclass
class OmniMoeVlCollator:
    """Examples `{"image", "question", "answer"}` (and an optional `system` message) -> the processor's batch: the
    conversation rendered by the chat template, `pixel_values`, `prompt_mask` (the question: what conditions the
    route) and `labels` on the answer and its `<|im_end|>` only."""

    processor: OmniMoeVlProcessor

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        texts = [
            self.processor.apply_chat_template(conversation(e["question"], e["answer"], e.get("system")))
            for e in examples
        ]
        batch = self.processor(images=[e["image"] for e in examples], text=texts, padding=True, return_labels=True,
                               return_tensors="pt")  # fmt: skip
        return dict(batch)


def load_omnimoe_vl_dataset(source: str | Path | datasets.Dataset) -> datasets.Dataset:
    """
    Image-question-answer examples: a `datasets.Dataset` (of PIL images), or a JSON / JSON Lines / CSV / Parquet file
    whose `image` paths are relative to the file, with the columns `image`, `question` and `answer`, and optionally
    `system` (a system message) and `prompt_type` (a label for the depth heatmap's rows). A row that lacks its image,
    question or answer is reported by number here rather than mid-training.
    """
    if isinstance(source, datasets.Dataset):
        dataset, base = source, None
    else:
        path = Path(source)
        if path.suffix.lower() not in TABLE_FORMATS or not path.is_file():
            raise ValueError(f"{path}: expected a {', '.join(TABLE_FORMATS)} file or a datasets.Dataset")
        dataset, base = load_table(path), path.parent
    missing = [column for column in ("image", "question", "answer") if column not in dataset.column_names]
    if missing:
        raise ValueError(f"The data set needs columns image, question and answer; it lacks {', '.join(missing)} "
                         f"(it has {dataset.column_names})")  # fmt: skip
    for column in ("image", "question", "answer"):
        rows = sorted(empty_rows(dataset, column))
        if rows:
            raise empty_rows_error(source, rows, f"no {column}")
    if base is None:
        return dataset
    return dataset.with_transform(lambda batch: _open_images(batch, base))


def _open_images(batch: dict, base: Path) -> dict:
    images = [image if not isinstance(image, str) else open_image(base / image) for image in batch["image"]]
    return dict(batch) | {"image": images}


def prompt_types(dataset: datasets.Dataset) -> list[str]:
    """Each example's `prompt_type`, or one type for all when the data set has none."""
    if "prompt_type" not in dataset.column_names:
        return [DEFAULT_PROMPT_TYPE] * len(dataset)
    return [str(kind) if kind else DEFAULT_PROMPT_TYPE for kind in dataset["prompt_type"]]


# --- the trainer ----------------------------------------------------------------------------------------------------


class OmniMoeVlLoss(LogsSmoesTerms):
    """
    A `Trainer` mixin (placed before the trainer class) whose loss is the model's own `loss`, which holds the route's
    objectives, with the token routers' logits asked for (their load balancing is part of it, spec D28). It logs
    beside the loss the token balancing (`aux_loss`), the weighted sum of the route's objectives (`routing_loss`),
    each objective unweighted (`routing/<name>`) and the mean route weight of each depth (`depth_route/<stream>`),
    their means since the previous log; with SMoES, its terms too.

    With TRL: `class OmniMoeVlSFTTrainer(OmniMoeVlLoss, SFTTrainer)`. `SFTTrainer`'s own loss scores the backbone's
    hidden states through a fused LM head and never calls the model's forward, so the route would train on the
    language-model loss alone (and TRL's balancing loss expects router logits at every position, where the model's
    are those of the real tokens).

    The loss of a micro-batch is its own mean (not a share of the whole accumulated batch's sum, as transformers does
    for models that take `num_items_in_batch`), and the Trainer divides it by the accumulation steps: the auxiliary
    terms, one per micro-batch, keep their weights under gradient accumulation.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, output_router_logits=True)
        if model.training:
            for name, value in (("aux_loss", outputs.aux_loss), ("routing_loss", outputs.routing_loss)):
                if value is not None:
                    self.record_step_value(name, value)
            for name, value in (outputs.routing_losses or {}).items():
                self.record_step_value(f"routing/{name}", value)
            if outputs.depth_route is not None:
                for depth, weight in enumerate(outputs.depth_route.float().mean(dim=0)):
                    self.record_step_value(f"depth_route/{depth}", weight)
            self.record_smoes_terms([outputs])
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class OmniMoeVlEvaluation(EvaluatesWhileTraining):
    """OmniMoE-VL's metrics while training (`EvaluatesWhileTraining`): beside the loss (which holds the route's
    objectives), `answer_nll`, the answer tokens' mean negative log-likelihood, and `depth_utilisation`, the entropy
    of the mean depth route over the evaluation set relative to its largest value (1: every depth equally used, 0: one
    depth only)."""

    def evaluation_values(self, model, inputs, outputs) -> dict[str, torch.Tensor]:
        return answer_token_values(outputs.logits, inputs["labels"]) | {"depth_route": outputs.depth_route.float()}

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        mean_route = values["depth_route"].mean(dim=0)
        return super().evaluation_metrics(values) | {
            "answer_nll": (values["answer_nll_sum"].sum() / values["answer_tokens"].sum()).item(),
            "depth_utilisation": (route_entropy(mean_route) / math.log(len(mean_route))).item(),
        }


class OmniMoeVlTrainer(OmniMoeVlEvaluation, OmniMoeVlLoss, LogsRoutingStatistics, ShardedCheckpointsMixin, Trainer):
    """`Trainer` with the model's own loss and its terms logged (`OmniMoeVlLoss`), which checkpoints and resumes a
    model sharded with `--fsdp` / `--ep` too (`ShardedCheckpointsMixin`)."""


# --- the depth-route heatmap ----------------------------------------------------------------------------------------


@torch.no_grad()
def mean_depth_routes(
    model: OmniMoeVlForConditionalGeneration, dataset, collator, batch_size: int = 16, num_examples: int = 256
) -> dict[str, torch.Tensor]:
    """The mean route weight of each depth (evaluation mode: content routing, no exploration) over the first
    `num_examples` examples, per prompt type: `{prompt type: (num_streams,)}`."""
    was_training = model.training
    model.eval()
    kinds = prompt_types(dataset)
    totals, counts = defaultdict(float), defaultdict(int)
    device = next(model.parameters()).device
    for start in range(0, min(num_examples, len(dataset)), batch_size):
        indices = list(range(start, min(start + batch_size, num_examples, len(dataset))))
        batch = collator([dataset[i] for i in indices])
        batch.pop("labels")
        routes = model(**{key: value.to(device) for key, value in batch.items()}).depth_route.cpu()
        for index, route in zip(indices, routes):
            totals[kinds[index]] = totals[kinds[index]] + route
            counts[kinds[index]] += 1
    model.train(was_training)
    return {kind: totals[kind] / counts[kind] for kind in sorted(totals)}


def smoes_evaluation_batches(dataset, collator, batch_size: int = 8, num_examples: int = 64):
    """The first `num_examples` examples in batches, for SMoES' routing report."""
    for start in range(0, min(num_examples, len(dataset)), batch_size):
        yield collator([dataset[i] for i in range(start, min(start + batch_size, num_examples, len(dataset)))])


def image_token_modality(model: OmniMoeVlForConditionalGeneration):
    """A batch's (B, L) hard modality (vision at the image placeholders, SMoES' label on this model) and validity."""
    return lambda batch: (
        (batch["input_ids"] == model.config.image_token_id).long(), batch["attention_mask"].bool()
    )


def plot_depth_routes(routes: dict[str, torch.Tensor], path: str | Path, title: str | None = None) -> Path:
    """A heatmap of mean route weights: a row per prompt type, a column per depth (stream)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = torch.stack(list(routes.values())).numpy()
    fig, axis = plt.subplots(figsize=(max(4.5, 1.5 + 0.6 * grid.shape[1]), 1.6 + 0.4 * grid.shape[0]))
    image = axis.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(grid.max()), 1e-6))
    axis.set_xticks(range(grid.shape[1]))
    axis.set_xlabel("depth (stream)")
    axis.set_yticks(range(grid.shape[0]), list(routes))
    axis.set_ylabel("prompt type")
    fig.colorbar(image, ax=axis, label="mean route weight")
    if title:
        axis.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the command ----------------------------------------------------------------------------------------------------


@dataclass
class OmniMoeVlTrainingOptions(TrainerOptions):
    eval_metrics = ("loss", "answer_nll", "depth_utilisation")

    stage: str = "I"
    learning_rate: float | None = None  # None: the stage's default (STAGE_LEARNING_RATES, not the paper's values)
    train_projector: bool = True  # Stages II-III: the projector trains too (spec D19)
    lora_r: int = 0  # Stages II-IV: LoRA of this rank on the stage's experts (and attention in IV), merged at the end
    router_utility_coef: float = 0.0  # > 0: add L_util with this weight (the paper's 0.35; one more backward a step)
    smoes: SmoesSettings | None = None  # SMoES on the language experts (`--smoes`), saved in the model's config
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: the folder's


def load_omnimoe_vl_model(
    model_dir: str | Path, options: OmniMoeVlTrainingOptions | None = None, adapt=None
) -> tuple[nn.Module, OmniMoeVlProcessor]:
    """The model of an OmniMoE-VL folder, `adapt(model)` if given (the model to train: a PEFT model wrapping it, or
    the model), and its processor. Under `--fsdp` / `--ep` the model is sharded after `adapt`
    (`moezoo.training.adapted_sharding`): FSDP2 cannot shard the projector's 0-d `fusion_output_scale`, which stays
    whole on every process. The weights are loaded in `options.dtype`."""
    options = options or OmniMoeVlTrainingOptions()
    folder, _ = model_folder(model_dir, "`moezoo train omnimoe_vl`", ["omnimoe_vl"])
    model = load_adapted_for_training(OmniMoeVlForConditionalGeneration, folder, adapt, options.fsdp, options.ep,
                                      options.ep_implementation, **load_dtype(options.dtype))  # fmt: skip
    return model, OmniMoeVlProcessor.from_pretrained(folder)


def train_omnimoe_vl(
    model_dir: str | Path,
    data: str | Path | datasets.Dataset,
    out: str | Path,
    options: OmniMoeVlTrainingOptions | None = None,
    overwrite: bool = False,
) -> dict:
    """Train stage `options.stage` of the OmniMoE-VL model in `model_dir` on `data` (see `load_omnimoe_vl_dataset`)
    and save it with its processor, loss curves, depth-route heatmap and a provenance record to `out`. Returns the
    training summary."""
    options = options or OmniMoeVlTrainingOptions()
    stage_pattern(options.stage, options.train_projector)  # a bad stage fails before the loading
    if options.lora_r and options.stage == "I":
        raise ValueError("--lora applies to Stages II-IV: Stage I trains the projector alone, in full")
    if options.router_utility_coef < 0:
        raise ValueError(f"router_utility_coef must be >= 0 (0: no L_util), got {options.router_utility_coef}")
    checkpoint = checkpoint_to_resume(out, options)
    check_same_format(data, options.eval_data)
    dataset = load_omnimoe_vl_dataset(data)
    eval_dataset = None if options.eval_data is None else load_omnimoe_vl_dataset(options.eval_data)
    check_enough_examples(len(dataset), options.batch_size)

    def adapt(model: OmniMoeVlForConditionalGeneration) -> nn.Module:
        """The stage's recipe on the loaded model, before any sharding: SMoES, L_util, what trains, LoRA."""
        if options.smoes is not None:
            enable_smoes(model, options.smoes)
        smoes = model.config.smoes_settings()
        if smoes is not None and options.stage in ("I", "III") and (smoes.smoes_mi_coef or smoes.smoes_bal_coef):
            raise ValueError(
                f"SMoES (config.smoes) trains the language routers, which Stage {options.stage} freezes: train Stage "
                "II or IV with it, or set smoes_mi_coef and smoes_bal_coef to 0"
            )
        if options.router_utility_coef:  # saved with the model: the next stage keeps it
            model.config.router_utility = "grad"
            model.config.router_utility_coef = options.router_utility_coef
        if options.lora_r:
            set_seed(options.seed)  # before the adapters' random initialisation: the Trainer seeds only what follows
            return with_lora(model, options.stage, options.lora_r, options.train_projector)
        set_trainable(model, options.stage, options.train_projector)
        return model

    trained, processor = load_omnimoe_vl_model(model_dir, options, adapt)
    model = trained.get_base_model() if options.lora_r else trained
    smoes = model.config.smoes_settings()
    learning_rate = options.learning_rate or STAGE_LEARNING_RATES[options.stage]
    counts = {"trainable": sum(p.numel() for p in trained.parameters() if p.requires_grad),
              "total": sum(p.numel() for p in trained.parameters())}  # fmt: skip
    collator = OmniMoeVlCollator(processor)

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        trainer = OmniMoeVlTrainer(
            model=trained,
            args=training_arguments(out, options, learning_rate=learning_rate),
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            data_collator=collator,
            callbacks=[RoutingStepCallback(), LogAtCheckpointsAndEnd()],
        )
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if options.fsdp > 1 or options.ep > 1:  # the heatmap and the saving run on one process's whole model
            whole = OmniMoeVlTrainingOptions(dtype=options.dtype)
            trained = unsharded_copy(trained, lambda: load_omnimoe_vl_model(model_dir, whole, adapt)[0])
        model = merge_lora(trained) if options.lora_r else trained
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        panels = {"loss": "loss", "token-expert balancing": "aux_loss", "route objectives (weighted)": "routing_loss"}
        panels |= {name: f"routing/{name}" for name in ROUTING_OBJECTIVES}
        if smoes is not None:
            panels |= smoes_panels(len(model.model.language_model.smoes.states))
        panels |= evaluation_panels(options.eval_metrics, trainer.state.log_history)
        curves = plot_log_history(trainer.state.log_history, panels, staging / "training_curves.png",
                                  title=f"OmniMoE-VL Stage {options.stage}")
        routes = mean_depth_routes(model, dataset, collator)
        heatmap = plot_depth_routes(routes, staging / "depth_routes.png",
                                    title=f"mean route weight per depth, Stage {options.stage}")
        msi = None
        if smoes is not None:
            msi = write_modality_routing(
                evaluation_routing(model, smoes_evaluation_batches(dataset, collator), image_token_modality(model)),
                model.config.text_config.num_experts, model.config.text_config.num_experts_per_tok, staging,
                "OmniMoE-VL language experts: share of each modality's top-k dispatches per MoE layer",
            )  # fmt: skip
        training = {
            "summary": f"Stage {options.stage} for {options.steps} steps, batch {options.batch_size}, lr "
                       f"{learning_rate}" + (f", LoRA r={options.lora_r}" if options.lora_r else ""),
            "stage": options.stage,
            "steps": options.steps,
            "batch_size": options.batch_size,
            "learning_rate": learning_rate,
            **loss_summary(trainer.state.log_history),
            "examples": len(dataset),
            "routing_step": int(model.model.projector.depth_router.routing_step),
            "trainable_parameters": counts["trainable"],
            "frozen_parameters": counts["total"] - counts["trainable"],
            "lora_r": options.lora_r or None,
            **evaluation_summary(trainer, options.eval_metrics),
        }
        if msi is not None:
            training |= {"smoes_step": int(model.model.language_model.smoes.step), "msi": msi}
        provenance = read_provenance(model.name_or_path) | {"training": training, "moezoo_version": __version__}
        write_provenance(staging, provenance)
        console.print(f"wrote {curves.name} and {heatmap.name}")
    return training


def add_train_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help="an OmniMoE-VL folder (moezoo create / convert / train, a previous stage) or Hub id")
    parser.add_argument("--data", required=True,
                        help="JSON / JSON Lines / CSV / Parquet with image, question, answer (and optionally system, "
                             "prompt_type)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", choices=STAGES, default="I",
                        help="I: the projector; II: the language experts and routers (+ projector); III: the vision "
                             "experts and routers (+ projector); IV: everything (spec §3.2)")
    defaults = OmniMoeVlTrainingOptions()
    add_trainer_arguments(parser, defaults, helps={
        "learning_rate": "learning rate (default per stage: I 1e-3, II 2e-5, III 2e-5, IV 1e-5; moezoo's choice, "
                         "not the paper's, whose Table 1 is missing)",
    })  # fmt: skip
    parser.add_argument("--freeze-projector", action="store_true", help="Stages II-III: keep the projector frozen")
    add_dtype_argument(parser)
    parser.add_argument("--lora", dest="lora_r", type=int, default=0, metavar="R",
                        help="Stages II-IV: LoRA of rank R on the stage's experts (and attention in IV), the "
                             "projector and routers in full; merged at the end")
    parser.add_argument("--router-utility", type=float, default=0.0, metavar="WEIGHT",
                        help="add the router utility supervision L_util with this weight (the paper's: 0.35; one more "
                             "backward per step), saved in the model's config")
    add_smoes_arguments(parser)
    parser.add_argument("--overwrite", action="store_true")


def run_train(args) -> int:
    options = OmniMoeVlTrainingOptions(
        **trainer_options(args, OmniMoeVlTrainingOptions), stage=args.stage,
        train_projector=not args.freeze_projector, lora_r=args.lora_r,
        router_utility_coef=args.router_utility, smoes=smoes_settings_from_args(args), dtype=args.dtype,
    )
    training = train_omnimoe_vl(args.model, args.data, args.out, options, overwrite=args.overwrite)
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
