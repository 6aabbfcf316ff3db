"""Training an SMoES model with `transformers.Trainer` (spec smoes.md §6: a stage-2-style fine-tuning of a Qwen3.5-MoE
or Qwen3-VL-MoE VLM with SMoES on).

- The objective lives in the model: in a training forward its `loss` is the language-model loss plus
  `smoes_bal_coef * smoes_bal_loss + alpha_MI * smoes_mi_loss`, which replace the base load-balancing loss.
  `SmoesLoss` logs each term beside the loss, and the mutual information of every MoE layer (`smoes/mi_layer_<l>`).
- What trains: the language model and its routers, the vision tower frozen (spec §6). With `lora_r`, PEFT adapters
  on the attention projections and one adapter per expert on the fused experts (`moezoo.training.expert_lora`, what
  PEFT's `target_parameters` computes), the routers in full beside them (the SMoES losses act through the routers
  only); the adapters are merged at the end. Frozen routers with a non-zero SMoES coefficient are refused before
  training starts.
- Several processes (`moezoo.training.distributed`): DDP, and `--fsdp` / `--ep` through
  `moezoo.training.adapted_sharding`, which shards the model once what trains and the LoRA adapters are set; the
  trainer's checkpoints of such a run are distributed checkpoints (`ShardedCheckpointsMixin`). LoRA shards under
  both: under `--ep` each process adds its own experts' adapters to its shard of the experts.
- The SMoES buffers (Gaussian statistics, dispatch counts, bins, `smoes_step`) advance once per training forward,
  in the model (spec §2.6, §2.8: with gradient accumulation, once per micro-batch); they are part of every
  checkpoint, so `resume` continues with them.

Data: image-caption pairs (`moezoo.training.data.load_image_text_dataset`: JSON Lines with `image` and `text`, an
image folder, ...). Each example becomes `<|vision_start|><|image_pad|>...<|vision_end|>` + caption, with labels on
the caption: two modalities per sequence. `train_smoes` (`moezoo train smoes`) writes the model, its processor, the
loss curves, the per-modality routing heatmap and the MSI of every MoE layer (spec §2.7) to `out`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Trainer, set_seed

from .. import __version__
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import model_folder
from ..modeling.moe.smoes.metrics import dispatch_specialisation_index, modality_specialisation_index
from ..modeling.moe.smoes.regularizer import check_routers_trainable, per_token_rows
from ..modeling.moe.smoes.scores import hard_modality
from ..modeling.moe.statistics import RoutingStatistics, plot_routing_heatmap
from ..modeling.smoes.common import SmoesForConditionalGenerationMixin
from ..processors.smoes import SmoesQwen3_5MoeProcessor
from ..registry import architectures_named, get_architecture
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
from .data import load_image_text_dataset
from .adapted_sharding import load_adapted_for_training, unsharded_copy
from .distributed import check_enough_examples, main_process_output_dir
from .evaluation import (
    EvaluatesWhileTraining,
    answer_token_values,
    check_same_format,
    evaluation_panels,
    evaluation_summary,
)
from .expert_lora import ExpertLoraModel, add_expert_adapters, merge_lora
from .plots import plot_log_history
from .precision import add_dtype_argument, load_dtype
from .sharded_checkpoints import ShardedCheckpointsMixin


VISION_TOWER = "model.visual."
ROUTER = ".mlp.gate.weight"
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
MODALITIES = ("text", "vision")
IGNORE_INDEX = -100


# --- what trains ----------------------------------------------------------------------------------------------------


def router_weights(model: SmoesForConditionalGenerationMixin) -> dict[str, nn.Parameter]:
    return {name: parameter for name, parameter in model.named_parameters() if name.endswith(ROUTER)}


def set_trainable(model: SmoesForConditionalGenerationMixin, freeze_routers: bool = False) -> list[str]:
    """Train the language model (routers included unless `freeze_routers`), freeze the vision tower; refuse frozen
    routers while an SMoES coefficient is non-zero. Returns the trainable parameters' names."""
    trainable = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not name.startswith(VISION_TOWER) and not (freeze_routers and name.endswith(ROUTER)))
        if parameter.requires_grad:
            trainable.append(name)
    check_routers_trainable(model.config.text_config, router_weights(model))
    return trainable


class SmoesLoraModel(ExpertLoraModel):
    """PEFT's model of `with_lora`, whose checkpoints keep the expert adapters (`ExpertLoraModel`), the routers
    (trained in full unless frozen) and the SMoES buffers beside PEFT's adapters: PEFT's adapter files hold none of
    them, and a resumed run would restart them from the base model."""

    SMOES_BUFFERS_FILE = "smoes_buffers.safetensors"

    def __init__(self, model, config: LoraConfig, train_routers: bool):
        super().__init__(model, config)
        self.train_routers = train_routers

    def trained_base_parameters(self) -> dict[str, nn.Parameter]:
        return router_weights(self.get_base_model()) if self.train_routers else {}

    def smoes_buffers(self) -> dict[str, torch.Tensor]:
        """Each MoE layer's `mlp.smoes.*` buffers and the language model's `smoes_step`, by name."""
        return {
            name: buffer for name, buffer in self.get_base_model().named_buffers()
            if ".mlp.smoes." in name or name.endswith(".smoes_step")
        }  # fmt: skip

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs) -> None:
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            tensors = {name: buffer.contiguous() for name, buffer in self.smoes_buffers().items()}
            save_file(tensors, str(Path(save_directory) / self.SMOES_BUFFERS_FILE))

    def load_adapter(self, model_id, adapter_name: str, is_trainable: bool = False, **kwargs):
        result = super().load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        path = Path(model_id) / self.SMOES_BUFFERS_FILE
        if path.is_file():
            buffers = self.smoes_buffers()
            with torch.no_grad():
                for name, tensor in load_file(str(path)).items():
                    buffers[name].copy_(tensor)
        return result


def with_lora(
    model: SmoesForConditionalGenerationMixin, rank: int, freeze_routers: bool = False
) -> SmoesLoraModel:
    """LoRA (alpha = 2 r) on the language model's attention projections (PEFT) and fused experts (one adapter per
    expert); the routers train in full beside the adapters (unless `freeze_routers`); everything else is frozen."""
    trainable = set_trainable(model, freeze_routers)
    experts = [name for name in trainable if name.endswith(FUSED_EXPERTS)]
    attention = sorted({
        name.rpartition(".")[0] for name in trainable
        if ".self_attn." in name and name.rpartition(".")[0].endswith(ATTENTION_PROJECTIONS)
    })  # fmt: skip
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=attention)
    peft_model = SmoesLoraModel(model, config, train_routers=not freeze_routers)
    add_expert_adapters(model, rank, 2 * rank, weights=experts)
    for parameter in peft_model.trained_base_parameters().values():  # PEFT froze the base model
        parameter.requires_grad_(True)
    return peft_model


# --- data -----------------------------------------------------------------------------------------------------------


@dataclass
class SmoesCollator:
    """Image-caption examples `{"image", "text"}` -> the processor's batch, each sequence the image's placeholders
    then the caption, `labels` on the caption only (the vision tokens and padding are -100)."""

    processor: SmoesQwen3_5MoeProcessor

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        image = self.processor.vision_start_token + self.processor.image_token + self.processor.vision_end_token
        batch = self.processor(images=[e["image"] for e in examples], text=[image + e["text"] for e in examples],
                               padding=True, return_tensors="pt")  # fmt: skip
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        vision_markers = torch.tensor([self.processor.image_token_id, self.processor.vision_start_token_id,
                                       self.processor.vision_end_token_id])  # fmt: skip
        batch["labels"] = labels.masked_fill(torch.isin(batch["input_ids"], vision_markers), IGNORE_INDEX)
        return dict(batch)


# --- the trainer ----------------------------------------------------------------------------------------------------


class SmoesLoss(LogsRoutingStatistics):
    """
    A `Trainer` mixin (placed before the trainer class) whose loss is the model's own, which holds the SMoES terms. It
    logs beside the loss the weighted SMoES loss (`aux_loss`), the bin-level balance loss (`smoes_bal_loss`), minus the
    inter-bin mutual information (`smoes_mi_loss`) and each MoE layer's mutual information in nats
    (`smoes/mi_layer_<l>`), their means since the previous log, and the load of the experts (`LogsRoutingStatistics`)
    from the top-k of the router logits.

    The loss of a micro-batch is its own mean (the SMoES terms are per micro-batch), and the Trainer divides it by the
    accumulation steps.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if model.training and outputs.smoes_mi is not None:
            for name in ("aux_loss", "smoes_bal_loss", "smoes_mi_loss"):
                self.record_step_value(name, getattr(outputs, name))
            for layer, information in enumerate(outputs.smoes_mi):
                self.record_step_value(f"smoes/mi_layer_{layer}", information)
            text_config = self.accelerator.unwrap_model(model).config.text_config
            # Every row, padding included: the host's transformers blocks route padding tokens to experts too.
            for layer, logits in enumerate(outputs.router_logits):
                chosen = logits.topk(text_config.num_experts_per_tok, dim=-1).indices
                self.count_assignments(f"layer {layer}", torch.bincount(chosen.flatten(), minlength=logits.shape[-1]))
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class SmoesEvaluation(EvaluatesWhileTraining):
    """SMoES's metrics while training (`EvaluatesWhileTraining`): the loss, which in eval mode is the captions' mean
    negative log-likelihood per token (the model computes its SMoES terms only while training), and `msi`, the
    modality specialisation index (spec §2.7) of every MoE layer's top-k dispatches over the whole evaluation set,
    averaged over layers as the paper reports it."""

    def evaluation_step(self, model, inputs: dict) -> dict[str, torch.Tensor]:
        """The captions' token losses and, per example, each MoE layer's top-k dispatches by modality and expert
        `(num_layers, NUM_MODALITIES, num_experts)`, from one forward with the router logits."""
        text_config = self.accelerator.unwrap_model(model).config.text_config
        features = {key: value for key, value in inputs.items() if key != "labels"}
        outputs = model(**features, output_router_logits=True)
        valid = inputs["attention_mask"].bool()
        modality = hard_modality(inputs["mm_token_type_ids"], text_config.smoes_vision_token_types)
        by_modality = nn.functional.one_hot(modality, len(MODALITIES)).masked_fill(~valid[..., None], 0)
        dispatches = []
        for logits in outputs.router_logits:
            top_k = per_token_rows(logits, valid).topk(text_config.num_experts_per_tok, dim=-1).indices  # (B, T, k)
            chosen = nn.functional.one_hot(top_k, text_config.num_experts).sum(dim=-2)  # (B, T, E)
            dispatches.append(torch.einsum("btm,bte->bme", by_modality, chosen))
        return answer_token_values(outputs.logits, inputs["labels"]) | {"dispatches": torch.stack(dispatches, dim=1)}

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        per_layer = [dispatch_specialisation_index(layer) for layer in values["dispatches"].sum(dim=0)]
        return {
            "loss": (values["answer_nll_sum"].sum() / values["answer_tokens"].sum()).item(),
            "msi": sum(per_layer) / len(per_layer),
        }


class SmoesTrainer(SmoesEvaluation, SmoesLoss, ShardedCheckpointsMixin, Trainer):
    """`Trainer` with the model's own loss and its SMoES terms logged (`SmoesLoss`), which checkpoints and resumes a
    model sharded with `--fsdp` / `--ep` too (`ShardedCheckpointsMixin`)."""


# --- routing by modality: heatmap and MSI ---------------------------------------------------------------------------


@torch.no_grad()
def routing_by_modality(
    model: SmoesForConditionalGenerationMixin, dataset, collator: SmoesCollator, batch_size: int = 8,
    num_examples: int = 64,
) -> tuple[RoutingStatistics, list[float]]:
    """In eval mode, over the first `num_examples` examples: the top-k dispatches of each MoE layer by hard modality
    (text, vision) and each layer's MSI (spec §2.7) over all of them."""
    was_training = model.training
    model.eval()
    text_config = model.config.text_config
    top_k, num_experts = text_config.num_experts_per_tok, text_config.num_experts
    selections, modalities, valids = [], [], []
    for start in range(0, min(num_examples, len(dataset)), batch_size):
        batch = collator([dataset[i] for i in range(start, min(start + batch_size, num_examples, len(dataset)))])
        batch.pop("labels")
        batch = {key: value.to(model.device) for key, value in batch.items()}
        router_logits = model(**batch, output_router_logits=True).router_logits  # per layer (B*T, E)
        shape = batch["input_ids"].shape
        selections.append([logits.topk(top_k, dim=-1).indices.view(*shape, top_k) for logits in router_logits])
        modalities.append(hard_modality(batch["mm_token_type_ids"], text_config.smoes_vision_token_types))
        valids.append(batch["attention_mask"].bool())
    model.train(was_training)
    return modality_routing(selections, modalities, valids, num_experts)


def modality_routing(
    selections: list[list[torch.LongTensor]], modalities: list[torch.LongTensor], valids: list[torch.Tensor],
    num_experts: int,
) -> tuple[RoutingStatistics, list[float]]:
    """Per MoE layer, the top-k dispatches by hard modality and the MSI, from batches of routing: `selections[b][l]`
    is layer l's (B, T, k) selection on batch b, `modalities[b]` and `valids[b]` its (B, T) labels and mask."""
    top_k = selections[0][0].size(-1)
    stats = RoutingStatistics({}, group_names=MODALITIES)
    msi = []
    for layer in range(len(selections[0])):
        counts = torch.zeros(len(MODALITIES), num_experts, dtype=torch.long)
        for selection, modality, valid in zip(selections, modalities, valids):
            chosen, labels = selection[layer][valid], modality[valid]  # (N, k), (N,)
            cells = labels.repeat_interleave(top_k) * num_experts + chosen.reshape(-1)
            counts += torch.bincount(cells, minlength=len(MODALITIES) * num_experts).view(len(MODALITIES), -1).cpu()
        stats.counts[f"layer {layer}"] = counts
        # Batches differ in length: their tokens are concatenated as one (N, 1) "batch".
        selected = torch.cat([selection[layer].flatten(0, 1) for selection in selections])[:, None]
        modality = torch.cat([labels.flatten() for labels in modalities])[:, None]
        valid = torch.cat([mask.flatten() for mask in valids])[:, None]
        msi.append(round(modality_specialisation_index(selected, modality, valid, num_experts), 4))
    return stats, msi


# --- the command ----------------------------------------------------------------------------------------------------


@dataclass
class SmoesTrainingOptions(TrainerOptions):
    eval_metrics = ("loss", "msi")

    learning_rate: float = 2e-5  # spec §6: the LLaVA-1.5 stage-2 value (the paper gives none)
    lora_r: int = 0  # LoRA of this rank on attention and experts (routers in full), merged at the end; 0: full
    freeze_routers: bool = False  # only with both SMoES coefficients 0 (statistics-only runs)
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: the folder's


def load_smoes_model(
    model_dir: str | Path, options: SmoesTrainingOptions | None = None, adapt=None
) -> tuple[nn.Module, SmoesQwen3_5MoeProcessor]:
    """The model of an SMoES folder, `adapt(model)` if given (the model to train: a PEFT model wrapping it, or the
    model), and its processor. Under `--fsdp` / `--ep` (`--ep-implementation`) the model is sharded after `adapt`
    (`moezoo.training.adapted_sharding`), what `adapt` added included. The weights are loaded in `options.dtype`."""
    options = options or SmoesTrainingOptions()
    hosts = [architecture.name for architecture in architectures_named("smoes")]
    folder, model_type = model_folder(model_dir, "`moezoo train smoes`", hosts)
    model = load_adapted_for_training(get_architecture(model_type).model_class(), folder, adapt, options.fsdp,
                                      options.ep, options.ep_implementation, **load_dtype(options.dtype))  # fmt: skip
    return model, SmoesQwen3_5MoeProcessor.from_pretrained(folder)


def train_smoes(
    model_dir: str | Path,
    data: str | Path | datasets.Dataset,
    out: str | Path,
    options: SmoesTrainingOptions | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the SMoES model in `model_dir` on the image-caption pairs `data` and save it with its processor, the
    loss curves (`training_curves.png`), the per-modality routing heatmap (`routing_by_modality.png`), each MoE
    layer's MSI (`smoes_msi.json`) and a provenance record to `out`. Returns the training summary."""
    options = options or SmoesTrainingOptions()
    checkpoint = checkpoint_to_resume(out, options)
    check_same_format(data, options.eval_data)
    dataset = load_image_text_dataset(data)
    eval_dataset = None if options.eval_data is None else load_image_text_dataset(options.eval_data)
    check_enough_examples(len(dataset), options.batch_size)

    def adapt(model: SmoesForConditionalGenerationMixin) -> nn.Module:
        """What trains, and the LoRA adapters, on the loaded model (before any sharding)."""
        if options.lora_r:
            set_seed(options.seed)  # before the adapters' random initialisation: the Trainer seeds only what follows
            return with_lora(model, options.lora_r, options.freeze_routers)
        set_trainable(model, options.freeze_routers)
        return model

    trained, processor = load_smoes_model(model_dir, options, adapt)
    model = trained.get_base_model() if options.lora_r else trained
    counts = {"trainable": sum(p.numel() for p in trained.parameters() if p.requires_grad),
              "total": sum(p.numel() for p in trained.parameters())}  # fmt: skip
    collator = SmoesCollator(processor)

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        trainer = SmoesTrainer(
            model=trained,
            args=training_arguments(out, options, learning_rate=options.learning_rate),
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            data_collator=collator,
            callbacks=[LogAtCheckpointsAndEnd()],
        )
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if options.fsdp > 1 or options.ep > 1:  # the heatmap and the saving run on one process's whole model
            whole = SmoesTrainingOptions(dtype=options.dtype)
            trained = unsharded_copy(trained, lambda: load_smoes_model(model_dir, whole, adapt)[0])
        model = merge_lora(trained) if options.lora_r else trained
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        text_config = model.config.text_config
        panels = {"loss": "loss", "SMoES loss (weighted)": "aux_loss", "bin balance": "smoes_bal_loss",
                  "- inter-bin MI": "smoes_mi_loss"}  # fmt: skip
        panels |= {f"MI layer {layer}": f"smoes/mi_layer_{layer}" for layer in range(text_config.num_hidden_layers)}
        panels |= evaluation_panels(options.eval_metrics, trainer.state.log_history)
        curves = plot_log_history(trainer.state.log_history, panels, staging / "training_curves.png",
                                  title="SMoES fine-tuning")  # fmt: skip
        stats, msi = routing_by_modality(model, dataset, collator)
        heatmap = plot_routing_heatmap(stats, staging / "routing_by_modality.png",
                                       title="SMoES experts: share of each modality's top-k dispatches per layer")
        (staging / "smoes_msi.json").write_text(
            json.dumps({"msi_per_layer": msi, "msi": round(sum(msi) / len(msi), 4)}, indent=2) + "\n"
        )
        training = {
            "summary": f"{options.steps} steps, batch {options.batch_size}, lr {options.learning_rate}"
                       + (f", LoRA r={options.lora_r}" if options.lora_r else ""),
            "steps": options.steps,
            "batch_size": options.batch_size,
            "learning_rate": options.learning_rate,
            **loss_summary(trainer.state.log_history),
            "examples": len(dataset),
            "smoes_step": int(model.model.language_model.smoes_step),
            "msi": round(sum(msi) / len(msi), 4),
            "trainable_parameters": counts["trainable"],
            "frozen_parameters": counts["total"] - counts["trainable"],
            "lora_r": options.lora_r or None,
            **evaluation_summary(trainer, options.eval_metrics),
        }
        provenance = read_provenance(model.name_or_path) | {"training": training, "moezoo_version": __version__}
        write_provenance(staging, provenance)
        console.print(f"wrote {curves.name}, {heatmap.name} and smoes_msi.json")
    return training


def add_train_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="an SMoES folder (moezoo create / convert / train) or Hub id")
    parser.add_argument("--data", required=True,
                        help="image-caption pairs: JSON Lines / JSON / CSV / Parquet with image (a path relative to "
                             "the file) and text, or an image folder with metadata.jsonl")
    parser.add_argument("--out", required=True)
    defaults = SmoesTrainingOptions()
    add_trainer_arguments(parser, defaults,
                          helps={"learning_rate": "learning rate (default 2e-5, LLaVA-1.5's stage 2)"})  # fmt: skip
    parser.add_argument("--lora", dest="lora_r", type=int, default=0, metavar="R",
                        help="LoRA of rank R on attention and experts, the routers in full; merged at the end")
    parser.add_argument("--freeze-routers", action="store_true",
                        help="keep the routers frozen: only with smoes_bal_coef and smoes_mi_coef 0 in the config")
    add_dtype_argument(parser)
    parser.add_argument("--overwrite", action="store_true")


def run_train(args) -> int:
    options = SmoesTrainingOptions(**trainer_options(args, SmoesTrainingOptions), lora_r=args.lora_r,
                                   freeze_routers=args.freeze_routers, dtype=args.dtype)
    training = train_smoes(args.model, args.data, args.out, options, overwrite=args.overwrite)
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
