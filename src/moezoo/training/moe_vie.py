"""Training MoE-ViE with `transformers.Trainer` (spec moe_vie.md §4, §8).

- Image-text contrastive training: softmax InfoNCE with the learnable temperature, or SigLIP's sigmoid loss, over
  the global batch (embeddings gathered across processes, each process's loss on its own rows: OpenCLIP's local
  loss). From scratch (`moezoo create`) or from a converted checkpoint.
- Robust video fine-tuning: InfoNCE between video and caption embeddings plus frame-level distillation
  `beta * (1 - cos(student frame, teacher frame))` against a frozen copy of the image model, with the MoE experts,
  routers and text MLPs frozen (`freeze_for_video_finetuning`).

The aux-loss-free balancing update runs once per optimizer step (`RoutingBiasCallback`); the loss curves and the
routing heatmap of the trained model are written as PNG files beside it. With `save_steps`, checkpoints are written
beside the output folder and `resume` continues an interrupted run from them (`moezoo.training.arguments`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig
from torch import nn
from transformers import Trainer, set_seed

from .. import __version__
from ..evaluation.moe_vie import retrieval_metrics
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import model_folder
from ..modeling.moe.statistics import plot_routing_heatmap, record_routing
from ..modeling.moe_vie import CONTRASTIVE_LOSSES, MoeVieModel
from ..processors.moe_vie import MoeVieProcessor
from ..terminal import console, print_table
from .arguments import (
    TrainerOptions,
    add_trainer_arguments,
    checkpoint_to_resume,
    loss_summary,
    trainer_options,
    training_arguments,
)
from .adapted_sharding import load_adapted_for_training, unsharded_copy
from .callbacks import (
    EvaluatesLoss,
    LogAtCheckpointsAndEnd,
    LogsRoutingStatistics,
    RoutingBiasCallback,
    use_rich_progress,
    write_tensorboard_into,
)
from .data import load_image_text_dataset, load_video_text_dataset
from .distributed import all_gather_with_grad, check_enough_examples, main_process_output_dir, world
from .evaluation import (
    EvaluatesWhileTraining,
    check_same_format,
    eval_batch_size,
    evaluation_panels,
    evaluation_summary,
)
from .expert_lora import ExpertLoraModel, add_expert_adapters, merge_lora
from .plots import plot_log_history
from .precision import add_dtype_argument, load_dtype
from .sharded_checkpoints import ShardedCheckpointsMixin


# --- batches ------------------------------------------------------------------------------------------------------


@dataclass
class ImageTextCollator:
    """Examples `{"image", "text"}` -> the processor's tensors; `image_size` overrides the processor's size
    (progressive-resolution training)."""

    processor: MoeVieProcessor
    image_size: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        image_options = {"size": self.image_size} if self.image_size else {}
        batch = self.processor(
            text=[example["text"] for example in examples],
            images=[example["image"] for example in examples],
            return_tensors="pt",
            **image_options,
        )
        return dict(batch)


@dataclass
class VideoTextCollator:
    """Examples `{"frames", "text"}` -> the processor's text and video tensors, `num_frames` frames per video."""

    processor: MoeVieProcessor
    num_frames: int = 8

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.processor(
            text=[example["text"] for example in examples],
            videos=[example["frames"] for example in examples],
            num_frames=self.num_frames,
            return_tensors="pt",
        )
        return dict(batch)


# --- losses -------------------------------------------------------------------------------------------------------


def global_contrastive_loss(model: MoeVieModel, vision_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """The contrastive loss of this process's pairs against the whole batch of every process (equal local batch
    sizes, hence `dataloader_drop_last`); with one process, exactly the model's own loss."""
    rank, _ = world()
    logits_per_text = model.contrastive_logits(all_gather_with_grad(vision_embeds), text_embeds)
    logits_per_vision = model.contrastive_logits(vision_embeds, all_gather_with_grad(text_embeds)).t()
    return CONTRASTIVE_LOSSES[model.config.loss_type](
        logits_per_text, logits_per_vision, label_offset=rank * text_embeds.shape[0]
    )


def frame_distillation_loss(student_frames: torch.Tensor, teacher_frames: torch.Tensor) -> torch.Tensor:
    """`1 - cos(S, T)` averaged over the batch (spec §4)."""
    return (1 - nn.functional.cosine_similarity(student_frames, teacher_frames.to(student_frames.dtype), dim=-1)).mean()


class MoeVieLoss(EvaluatesLoss):
    """
    A `Trainer` mixin (placed before the trainer class) whose loss is MoE-ViE's contrastive loss over the global batch
    (`global_contrastive_loss`: with one process, the model's own loss), plus the router auxiliary loss when the config
    asks for one (MoE-ViE itself uses none: its experts are balanced by the bias update). `evaluate()` reports it as
    `eval_loss` (`EvaluatesLoss`). Subclasses add terms through `extra_loss` (video distillation does).

    Pass `RoutingBiasCallback()` to the trainer too: it runs the experts' aux-loss-free balancing update once per
    optimizer step.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        core = self.accelerator.unwrap_model(model)
        vision_config = core.config.vision_config
        use_aux_loss = vision_config.router_aux_loss_type != "none"
        outputs = model(**inputs, output_router_logits=use_aux_loss)
        vision_embeds = outputs.image_embeds if outputs.image_embeds is not None else outputs.video_embeds
        loss = global_contrastive_loss(core, vision_embeds, outputs.text_embeds)
        if use_aux_loss:
            loss = loss + vision_config.router_aux_loss_coef * core.router_aux_loss(outputs.router_logits)
        loss = loss + self.extra_loss(core, inputs, outputs)
        return (loss, outputs) if return_outputs else loss

    def extra_loss(self, model, inputs, outputs) -> torch.Tensor | float:
        return 0.0


class MoeVieEvaluation(EvaluatesWhileTraining):
    """MoE-ViE's metrics while training (`EvaluatesWhileTraining`): beside the contrastive loss, the recall@1 and
    recall@5 of retrieval over the whole evaluation set, in both directions (`retrieval_image_to_text_recall_at_1`,
    `retrieval_text_to_image_recall_at_5`, ...; `video` for video fine-tuning), each caption the text of its own
    image. The evaluation data are image-text pairs without class labels: no zero-shot classification."""

    RECALL_KS = (1, 5)

    def evaluation_values(self, model, inputs, outputs) -> dict[str, torch.Tensor]:
        modality = "image" if outputs.image_embeds is not None else "video"
        return {f"{modality}_embeds": getattr(outputs, f"{modality}_embeds").float(),
                "text_embeds": outputs.text_embeds.float()}  # fmt: skip

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        modality = "image" if "image_embeds" in values else "video"
        scores = values["text_embeds"] @ values[f"{modality}_embeds"].T  # both L2-normalised: cosine similarities
        ks = [k for k in self.RECALL_KS if k <= len(scores)]
        results = retrieval_metrics(scores, torch.arange(len(scores)), modality, ks)
        return super().evaluation_metrics(values) | {
            f"retrieval_{direction}_{name.replace('@', '_at_')}": value
            for direction in (f"{modality}_to_text", f"text_to_{modality}")
            for name, value in results[direction].items()
        }


class MoeVieTrainer(MoeVieEvaluation, MoeVieLoss, LogsRoutingStatistics, ShardedCheckpointsMixin, Trainer):
    """`Trainer` with MoE-ViE's contrastive loss (`MoeVieLoss`), which checkpoints and resumes a model sharded with
    `--fsdp` / `--ep` too (`ShardedCheckpointsMixin`)."""

    zero3_refusal = (
        "the contrastive loss over the global batch reads the model's logit_scale outside its forward "
        "(`contrastive_logits`), where ZeRO-3 holds that parameter partitioned; train MoE-ViE with --fsdp N or a "
        "DeepSpeed config of ZeRO stage 2 or below"
    )


class VideoDistillationTrainer(MoeVieTrainer):
    """Adds frame-level distillation: one random real frame per video, the student's embedding of it (from the
    video forward, spec §11 item 11) against the frozen teacher's image embedding of the same frame. The unweighted
    distillation term `1 - cos` is logged beside the loss as `distillation_loss`, its mean since the previous log."""

    def __init__(self, *args, teacher: MoeVieModel, distill_weight: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)
        self.distill_weight = distill_weight

    def extra_loss(self, model, inputs, outputs) -> torch.Tensor:
        real = inputs["padding_mask_videos"].bool()
        rows = torch.arange(real.shape[0], device=real.device)
        frames = torch.multinomial(real.float(), 1).squeeze(-1)  # one real frame per video
        frame_mask = inputs.get("video_pixel_attention_mask")
        with torch.no_grad():
            self.teacher.to(outputs.frame_embeds.device)
            teacher_frames = self.teacher.get_image_features(
                pixel_values=inputs["pixel_values_videos"][rows, frames],
                pixel_attention_mask=None if frame_mask is None else frame_mask[rows, frames],
                spatial_shapes=inputs["video_spatial_shapes"],
            ).pooler_output
        distill = frame_distillation_loss(outputs.frame_embeds[rows, frames], teacher_frames)
        self.record_step_value("distillation_loss", distill)
        return self.distill_weight * distill


def freeze_for_video_finetuning(model: MoeVieModel, freeze_vision_dense_mlp: bool = True) -> dict[str, int]:
    """Spec §4: freeze every MoE block of the vision tower (routed and shared experts and the router: its balancing
    bias then stops updating too), the text tower's MLPs and, by default, the vision tower's dense MLPs (block 0).
    Returns the number of frozen and trainable parameters."""
    for layer in model.vision_model.encoder.layers:
        if layer.is_moe or freeze_vision_dense_mlp:
            layer.mlp.requires_grad_(False)
    for layer in model.text_model.encoder.layers:
        layer.mlp.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"frozen": frozen, "trainable": trainable}


# --- the command --------------------------------------------------------------------------------------------------


@dataclass
class MoeVieTrainingOptions(TrainerOptions):
    recipe_fields = {"dataloader_drop_last": "the global contrastive loss needs equal batches on every process"}
    eval_metrics = ("loss", "retrieval_<modality>_to_text_recall_at_<k>", "retrieval_text_to_<modality>_recall_at_<k>")

    batch_size: int = 32
    weight_decay: float = 0.05
    loss_type: str | None = None  # switch the model's contrastive loss (softmax | sigmoid)
    image_size: int | None = None
    video: bool = False
    num_frames: int = 8
    distill_weight: float = 0.5
    freeze_vision_dense_mlp: bool = True
    lora_r: int = 0
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: the folder's


def set_loss_type(model: MoeVieModel, loss_type: str) -> None:
    """Switch between InfoNCE and the sigmoid loss; the sigmoid loss needs its learnable logit bias."""
    if loss_type not in CONTRASTIVE_LOSSES:
        raise ValueError(f"loss type {loss_type!r} is not one of {', '.join(CONTRASTIVE_LOSSES)}")
    model.config.loss_type = loss_type
    if loss_type == "sigmoid" and model.logit_bias is None:
        model.logit_bias = nn.Parameter(torch.tensor([model.config.logit_bias_init_value]))
    elif loss_type == "softmax":
        model.logit_bias = None


def with_lora(model: MoeVieModel, rank: int) -> ExpertLoraModel:
    """LoRA (alpha = 2 r) on the attention projections of both towers' blocks (PEFT) and on the fused experts (one
    adapter per expert, `moezoo.training.expert_lora`: what PEFT's `target_parameters` computes, on both weights of
    the GELU experts too, their biases untouched).

    The blocks are named explicitly: a bare `out_proj` would also match the pooling head's `nn.MultiheadAttention`,
    which reads `out_proj.weight` directly, so an adapter there would be counted as trainable but never used.
    """
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=r".*\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
    )
    peft_model = ExpertLoraModel(model, config)
    add_expert_adapters(model, rank, 2 * rank)
    return peft_model


def train_moe_vie(
    model_dir: str | Path,
    data,
    out: str | Path,
    options: MoeVieTrainingOptions | None = None,
    image_column: str = "image",
    frames_column: str = "frames",
    text_column: str = "text",
    overwrite: bool = False,
) -> dict:
    """Train the model in `model_dir` on `data` (see `moezoo.training.data`) and save it, its processor, the curves
    and the routing heatmap to `out`. Returns the final metrics."""
    options = options or MoeVieTrainingOptions()
    checkpoint = checkpoint_to_resume(out, options)
    folder, _ = model_folder(model_dir, "`moezoo train moe_vie`", ["moe_vie"])
    check_same_format(data, options.eval_data)

    def load_data(source):
        if options.video:
            return load_video_text_dataset(source, frames_column, text_column)
        return load_image_text_dataset(source, image_column, text_column)

    dataset = load_data(data)
    eval_dataset = None if options.eval_data is None else load_data(options.eval_data)
    check_enough_examples(len(dataset), options.batch_size)
    if eval_dataset is not None:  # evaluation batches are dropped when incomplete too (`dataloader_drop_last`)
        check_enough_examples(len(eval_dataset), eval_batch_size(options), "evaluation data set")
    made = {}  # by `adapt`: video fine-tuning's teacher and its count of frozen parameters

    def recipe(model: MoeVieModel) -> nn.Module:
        """The model to train from the loaded one: the loss, what video fine-tuning freezes, the LoRA adapters."""
        if options.loss_type:
            set_loss_type(model, options.loss_type)
        if options.video:
            made["frozen"] = freeze_for_video_finetuning(model, options.freeze_vision_dense_mlp)["frozen"]
        set_seed(options.seed)  # before the LoRA adapters' random initialisation: the Trainer seeds only what follows
        return with_lora(model, options.lora_r) if options.lora_r else model

    def adapt(model: MoeVieModel) -> nn.Module:
        """`recipe`, before any sharding. Video fine-tuning's frozen teacher is copied first: under --fsdp it stays
        whole on every process, outside FSDP2; under --ep its experts are split as the model's are, and every process
        runs it at every step, so its token exchanges match."""
        if options.video:
            made["teacher"] = copy.deepcopy(model)
        return recipe(model)

    # Sharded after loading (`adapted_sharding`): FSDP2 cannot shard the 0-d logit_scale, which stays whole.
    trained = load_adapted_for_training(MoeVieModel, folder, adapt, options.fsdp, options.ep,
                                        options.ep_implementation, **load_dtype(options.dtype))  # fmt: skip
    processor = MoeVieProcessor.from_pretrained(folder)
    if options.video:
        collator = VideoTextCollator(processor, options.num_frames)
    else:
        collator = ImageTextCollator(processor, options.image_size)

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        args = training_arguments(out, options, fixed={"dataloader_drop_last": True})
        trainer_class, extra = MoeVieTrainer, {}
        if options.video:
            trainer_class = VideoDistillationTrainer
            extra = {"teacher": made["teacher"], "distill_weight": options.distill_weight}
        trainer = trainer_class(
            model=trained, args=args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator,
            callbacks=[RoutingBiasCallback(), LogAtCheckpointsAndEnd()], **extra,
        )
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if options.fsdp > 1 or options.ep > 1:  # the heatmap runs the vision tower alone, outside FSDP2's root unit
            trained = unsharded_copy(
                trained, lambda: recipe(MoeVieModel.from_pretrained(folder, **load_dtype(options.dtype))))
        model = merge_lora(trained) if options.lora_r else trained
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        panels = {"training loss": "loss", "frame distillation 1 - cos": "distillation_loss"}
        panels |= evaluation_panels(options.eval_metrics, trainer.state.log_history)
        curves = plot_log_history(trainer.state.log_history, panels, staging / "training_curves.png",
                                  title="MoE-ViE training")
        heatmap = routing_heatmap(model, dataset, collator, staging / "routing_heatmap.png")
        training = {
            "summary": f"{'video fine-tuning with frame distillation' if options.video else 'contrastive training'} "
                       f"for {options.steps} steps, batch {options.batch_size}, loss {model.config.loss_type}",
            "steps": options.steps,
            "batch_size": options.batch_size,
            "learning_rate": options.learning_rate,
            **loss_summary(trainer.state.log_history),
            "examples": len(dataset),
            "lora_r": options.lora_r or None,
            **({"frozen_parameters": made["frozen"]} if options.video else {}),
            **evaluation_summary(trainer, options.eval_metrics),
        }
        write_provenance(staging, read_provenance(folder) | {"training": training, "moezoo_version": __version__})
        console.print(f"wrote {curves.name} and {heatmap.name}")
    return training


@torch.no_grad()
def routing_heatmap(model: MoeVieModel, dataset, collator, path: Path, num_examples: int = 64) -> Path:
    """Tokens per expert per MoE layer of the vision tower over the first examples of `dataset`."""
    model.eval()
    examples = [dataset[i] for i in range(min(num_examples, len(dataset)))]
    batch = collator(examples)
    with record_routing(model.vision_model) as stats:
        if "pixel_values_videos" in batch:
            model.get_video_features(**{k: v for k, v in batch.items() if "video" in k})
        else:
            model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"], batch["spatial_shapes"])
    return plot_routing_heatmap(stats, path, title="vision experts: share of tokens per layer")


def add_train_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a MoE-ViE folder (moezoo create / convert / train)")
    parser.add_argument("--data", required=True,
                        help="image folder with metadata, JSON/CSV/parquet file, webdataset .tar shards, or Hub id")
    parser.add_argument("--out", required=True)
    parser.add_argument("--image-column", default="image")
    parser.add_argument("--frames-column", default="frames")
    parser.add_argument("--text-column", default="text")
    defaults = MoeVieTrainingOptions()
    add_trainer_arguments(parser, defaults)
    add_dtype_argument(parser)
    parser.add_argument("--loss", choices=sorted(CONTRASTIVE_LOSSES), help="switch the model's contrastive loss")
    parser.add_argument("--image-size", type=int, help="resize images to this size (progressive resolution)")
    parser.add_argument("--video", action="store_true",
                        help="robust video fine-tuning: frame distillation, experts and text MLPs frozen")
    parser.add_argument("--num-frames", type=int, default=defaults.num_frames)
    parser.add_argument("--distill-weight", type=float, default=defaults.distill_weight)
    parser.add_argument("--train-vision-dense-mlp", action="store_true",
                        help="with --video, keep the vision tower's dense MLP (block 0) trainable")
    parser.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank, merged at the end")
    parser.add_argument("--overwrite", action="store_true")


def run_train(args) -> int:
    options = MoeVieTrainingOptions(
        **trainer_options(args, MoeVieTrainingOptions), loss_type=args.loss, image_size=args.image_size,
        video=args.video, num_frames=args.num_frames, distill_weight=args.distill_weight,
        freeze_vision_dense_mlp=not args.train_vision_dense_mlp, lora_r=args.lora_r, dtype=args.dtype,
    )
    training = train_moe_vie(args.model, args.data, args.out, options, image_column=args.image_column,
                             frames_column=args.frames_column, text_column=args.text_column,
                             overwrite=args.overwrite)
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
