"""Training MoEMB with `transformers.Trainer` (spec moemb.md §2.3, §7).

- **Loss**: one-directional InfoNCE from queries to targets, `cross_entropy(s * Q T^T, labels)` with the fixed logit
  scale `s` of the config (50), over the global batch: the targets (and optional provided hard negatives, extra
  columns of the logits) of every process are gathered with gradients flowing back to the process that embedded
  them. Optionally, in-batch targets identical to a query's own target are masked out (spec A-14).
- **GradCache** (`--chunk-size`): a contrastive batch larger than memory allows. Chunks are embedded without
  gradients, the loss gives the gradient of every embedding, then each chunk is embedded again with gradients and
  back-propagated from its cached embedding gradient, replaying the random state of its first pass (dropout). The
  parameter gradients equal the full batch's.
- **LoRA** (spec §7.2): PEFT adapters on the attention projections of the full-attention layers, the shared experts,
  the vision blocks and the merger (and the Gated DeltaNet projections with `--lora-target-gdn`); for the routed
  experts low-rank updates of the fused expert weights: one shared by all experts of a layer (`--expert-lora shared`,
  the paper's Megatron reading and the default for native MoE), one per group of consecutive experts (`grouped`), or
  one per expert (`per-expert`, what PEFT's `target_parameters` does, and the default for upcycled and modality
  experts, which must diverge); the `<emb>` embedding row trainable (PEFT `trainable_token_indices`); the router
  frozen unless `--train-router` (or the config trains it). Adapters are merged into the saved model. An unmerged
  adapter (`save_pretrained` of `apply_lora`'s model, the Trainer's checkpoints) holds the expert adapters in
  `expert_lora.safetensors` (and trained routers in `trained_base_parameters.safetensors`) beside PEFT's files:
  reload it with `MoEmbLoraModel.from_pretrained(base, folder)`, as `PeftModel.from_pretrained` would leave the
  experts unadapted.
- **Recipe** (spec §7.1): AdamW (0.9, 0.98), weight decay 0.01, gradient clipping 1.0, 10 warmup steps, cosine decay
  to a tenth of the peak learning rate: 1e-4 (`--recipe stated`, the paper's headline) or 5e-5 (`tuned`, Fig. 6).

Data is MMEB's training format (VLM2Vec): `qry`, `qry_image_path`, `pos_text`, `pos_image_path` and optionally
`neg_text`, `neg_image_path`, in a JSON / JSON Lines / CSV / Parquet file, a folder of them (one task each), or a
`datasets.Dataset`; image paths are relative to `--image-root` (default: the data's folder). Validation data
(`--eval_data`, same format) gets the training loss `eval_loss`, hit@1 and recall@5 (`MoEmbEvaluation`) every
`--eval_steps` steps (default: `--logging_steps`). The loss curves and the routing heatmap of the trained model
(tokens per expert per layer, by modality) are written as PNG files. With `--save-steps`, checkpoints are written
beside the output folder and `--resume` continues an interrupted run from them (`moezoo.training.arguments`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, set_seed
from trl import GRPOConfig

from .. import __version__
from ..configuration.moemb import TOKEN_MODALITIES
from ..configuration.smoes_settings import SmoesSettings
from ..evaluation.moemb import hit_at_1, ranking
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import model_folder
from ..modeling.moe.precision import scaled_similarities
from ..modeling.moe.router import TopKRouter
from ..modeling.moe.statistics import plot_routing_heatmap, record_routing
from ..modeling.moemb import MoEmbForEmbedding
from ..modeling.smoes.zoo import enable_smoes
from ..processors.moemb import MoEmbProcessor
from ..terminal import console, print_table
from .arguments import (
    TrainerOptions,
    add_trainer_arguments,
    checkpoint_to_resume,
    loss_summary,
    trainer_options,
    training_arguments,
)
from . import deepspeed_zero
from .adapted_sharding import load_adapted_for_training, unsharded_copy, with_every_trainable_parameter
from .callbacks import (
    EvaluatesLoss,
    LogAtCheckpointsAndEnd,
    LogsRoutingStatistics,
    use_rich_progress,
    write_tensorboard_into,
)
from .distributed import (
    all_gather_with_grad,
    check_enough_examples,
    main_process_output_dir,
    world,
)
from .evaluation import EvaluatesWhileTraining, check_same_format, evaluation_panels, evaluation_summary
from .expert_lora import ExpertLoraModel, add_expert_adapters, merge_lora
from .moemb_adaptive import AdaptiveRecipeOptions, GateTraining, add_recipe_arguments, recipe_options, recipe_trainer
from .moemb_data import SIDES, load_mmeb_dataset, target_key
from .moemb_grpo import GRPO_FIELD_HELPS, add_grpo_arguments, run_grpo
from .plots import plot_log_history
from .precision import add_dtype_argument, load_dtype
from .sharded_checkpoints import ShardedCheckpointsMixin
from .smoes_hosts import (
    LogsSmoesTerms,
    add_smoes_arguments,
    evaluation_routing,
    smoes_panels,
    smoes_settings_from_args,
    token_type_modality,
    write_modality_routing,
)

RECIPES = {"stated": 1e-4, "tuned": 5e-5}
EXPERT_LORA_MODES = ("shared", "grouped", "per-expert", "none")


# --- data ---------------------------------------------------------------------------------------------------------


@dataclass
class MoEmbCollator:
    """Examples -> `{"query": [chunk batches], "target": [...], ["negative": [...]], "target_keys"}`: each side
    processed in chunks of `chunk_size` inputs (one chunk without GradCache)."""

    processor: MoEmbProcessor
    chunk_size: int | None = None
    max_length: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        size = self.chunk_size or len(examples)
        batch = {}
        for side in SIDES:
            if side in examples[0]:
                items = [example[side] for example in examples]
                batch[side] = [
                    self.processor(items[start : start + size], max_length=self.max_length)
                    for start in range(0, len(items), size)
                ]
        batch["target_keys"] = torch.tensor([target_key(example["target"]) for example in examples])
        return batch


# --- loss ---------------------------------------------------------------------------------------------------------


def info_nce_loss(
    queries: torch.Tensor,
    targets: torch.Tensor,
    logit_scale: float,
    negatives: torch.Tensor | None = None,
    target_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-directional InfoNCE of this process's queries over the targets (then the negatives) of all processes.

    Query `i` of process `r` has its label at `r * B + i` (equal local batch sizes `B`). The gathered embeddings
    carry gradients back to the process that computed them, summed over processes, so with DDP's gradient averaging
    the update equals a single process's on the concatenated batch. `target_keys` masks every other target equal to
    the query's own (false negatives).
    """
    rank, _ = world()
    labels = rank * queries.shape[0] + torch.arange(queries.shape[0], device=queries.device)
    logits = scaled_similarities(queries, all_gather_with_grad(targets), logit_scale)  # fp32 under autocast too
    if target_keys is not None:
        keys = all_gather_with_grad(target_keys)
        duplicates = keys[labels][:, None] == keys[None, :]
        duplicates[torch.arange(len(labels)), labels] = False
        logits = logits.masked_fill(duplicates, float("-inf"))
    if negatives is not None:
        logits = torch.cat([logits, scaled_similarities(queries, all_gather_with_grad(negatives), logit_scale)], dim=1)
    return F.cross_entropy(logits, labels)


def embed_chunks(model, chunks: list, outputs: list | None = None) -> torch.Tensor:
    """The chunks' embeddings, concatenated; `outputs` collects the chunks' model outputs (their SMoES terms)."""
    chunk_outputs = [model(**chunk) for chunk in chunks]
    if outputs is not None:
        outputs.extend(chunk_outputs)
    return torch.cat([output.embeddings for output in chunk_outputs])


class RandomState:
    """The CPU (and current CUDA device) random state, to replay a forward's dropout masks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def replay(self):
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def cached_contrastive_backward(
    model,
    inputs: dict,
    loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    no_sync: Callable[[], object] = nullcontext,
) -> torch.Tensor:
    """GradCache (Gao et al. 2021) over the chunks of `inputs` (see `MoEmbCollator`): accumulates into the parameters
    the gradients of `loss_fn({side: embeddings})` on the whole batch, holding one chunk's activations at a time.
    `no_sync` wraps every chunk's backward but the last (DDP's gradient all-reduce). Returns the loss."""
    device = next(model.parameters()).device
    sides = [side for side in SIDES if side in inputs]
    states = {}
    with torch.no_grad():
        cached = {}
        for side in sides:
            chunk_embeddings = []
            for index, chunk in enumerate(inputs[side]):
                states[side, index] = RandomState(device)
                chunk_embeddings.append(model(**chunk).embeddings)
            cached[side] = torch.cat(chunk_embeddings).requires_grad_()
    loss = loss_fn(cached)
    backward(loss)  # gradients of the cached embeddings only: they are leaves

    last = (sides[-1], len(inputs[sides[-1]]) - 1)
    for side in sides:
        start = 0
        for index, chunk in enumerate(inputs[side]):
            with states[side, index].replay(), (nullcontext() if (side, index) == last else no_sync()):
                embeddings = model(**chunk).embeddings
                gradient = cached[side].grad[start : start + len(embeddings)]
                # Under FSDP2 each chunk's backward reduces its gradients, which accumulate over the chunks; the
                # root unit's parameters need one on every process, images or not (`with_every_trainable_parameter`).
                backward(with_every_trainable_parameter((embeddings * gradient).sum(), model))
            start += len(embeddings)
    return loss.detach()


class MoEmbLoss(EvaluatesLoss, LogsSmoesTerms):
    """
    A `Trainer` mixin (placed before the trainer class) whose loss is global-batch InfoNCE (`info_nce_loss`) over the
    sides of `MoEmbCollator`'s batches, at `logit_scale` (default: the model's `config.logit_scale`), optionally with
    in-batch duplicates of a query's target masked out (`mask_duplicate_targets`). With SMoES (`config.smoes`), the
    SMoES losses of every training forward are added, and their terms logged. `evaluate()` reports the InfoNCE loss
    as `eval_loss` (`EvaluatesLoss`): give it batches of the training size, as InfoNCE depends on the number of
    in-batch negatives.
    """

    def __init__(self, *args, logit_scale: float | None = None, mask_duplicate_targets: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if logit_scale is None:
            logit_scale = self.accelerator.unwrap_model(self.model).config.logit_scale
        self.logit_scale = logit_scale
        self.mask_duplicate_targets = mask_duplicate_targets

    def contrastive_loss(self, embeddings: dict[str, torch.Tensor], inputs: dict) -> torch.Tensor:
        return info_nce_loss(
            embeddings["query"], embeddings["target"], self.logit_scale, embeddings.get("negative"),
            inputs["target_keys"] if self.mask_duplicate_targets else None,
        )  # fmt: skip

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = []
        embeddings = {side: embed_chunks(model, inputs[side], outputs) for side in SIDES if side in inputs}
        loss = with_every_trainable_parameter(self.contrastive_loss(embeddings, inputs), model)
        smoes_loss = self.record_smoes_terms(outputs) if model.training else None
        if smoes_loss is not None:
            loss = loss + smoes_loss
        return (loss, embeddings) if return_outputs else loss


class MoEmbEvaluation(EvaluatesWhileTraining):
    """MoEMB's metrics while training (`EvaluatesWhileTraining`): beside the InfoNCE loss, each evaluation query ranks
    the targets of the whole evaluation set (those equal to its own target are relevant), giving `hit_at_1` (the top
    target is relevant) and `recall_at_5` (a relevant target is among the top 5)."""

    RECALL_K = 5

    def evaluation_values(self, model, inputs, outputs) -> dict[str, torch.Tensor]:
        return {"query": outputs["query"].float(), "target": outputs["target"].float(),
                "target_keys": inputs["target_keys"]}  # fmt: skip

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        scores = values["query"] @ values["target"].T
        relevance = (values["target_keys"][:, None] == values["target_keys"][None, :]).long()
        top = ranking(scores, relevance)[:, : self.RECALL_K]
        return super().evaluation_metrics(values) | {
            "hit_at_1": hit_at_1(scores, relevance).mean().item(),
            f"recall_at_{self.RECALL_K}": relevance.gather(-1, top).amax(-1).float().mean().item(),
        }


class MoEmbTrainer(MoEmbEvaluation, MoEmbLoss, LogsRoutingStatistics, ShardedCheckpointsMixin, Trainer):
    """`Trainer` with MoEMB's InfoNCE (`MoEmbLoss`) and GradCache (`gradcache`, when the collator makes several chunks
    per side), which checkpoints and resumes a model sharded with `--fsdp` / `--ep` too (`ShardedCheckpointsMixin`)."""

    zero3_refusal = deepspeed_zero.SKIPPED_MODULES.format(module="vision tower", inputs="an image")

    def __init__(self, *args, gradcache: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradcache = gradcache

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.gradcache:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        steps = self.current_gradient_accumulation_steps
        with self.counting_routing(model):
            loss = cached_contrastive_backward(
                model, inputs, lambda embeddings: self.contrastive_loss(embeddings, inputs) / steps,
                backward=self.accelerator.backward, no_sync=lambda: self.accelerator.no_sync(model),
            )  # fmt: skip
        return loss


# --- LoRA ---------------------------------------------------------------------------------------------------------


# Spec §7.2 (verified with peft 0.21): a regex, since a bare "proj" would also match the vision Conv3d
# patch_embed.proj.
LORA_TARGETS = (
    r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj){gdn})"
    r"|.*visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc(1|2))|.*visual\.merger\.linear_fc(1|2)"
)
GDN_LORA_TARGETS = r"|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"


@dataclass
class LoraOptions:
    rank: int = 64
    alpha: int = 128
    dropout: float = 0.05  # on the nn.Linear adapters; the expert adapters act on weights, without dropout
    experts: str | None = None  # one of EXPERT_LORA_MODES; None: "shared" for native MoE, else "per-expert"
    expert_groups: int = 1  # "grouped": adapters per layer, each shared by num_experts / expert_groups experts
    target_gdn: bool = False  # also the Gated DeltaNet projections (the paper's A10B count)
    train_router: bool | None = None  # None: the config's router_trainable


class MoEmbLoraModel(ExpertLoraModel):
    """PEFT's model of `apply_lora`, saving and loading the expert adapters (`ExpertLoraModel`) and the trained
    routers too. The routers, when they train (`--train-router`), are kept as `PeftModelWithTrainedBase` keeps
    parameters trained in full."""

    def trained_base_parameters(self) -> dict[str, nn.Parameter]:
        return {
            f"{module_name}.{name}": parameter
            for module_name, module in self.get_base_model().named_modules()
            if isinstance(module, TopKRouter)
            for name, parameter in module.named_parameters()
            if parameter.requires_grad
        }


def expert_lora_mode(config, options: LoraOptions) -> str:
    """The routed experts' adapters: as asked, else shared for native MoE and per expert for upcycled and modality
    experts, which start as copies of one FFN and can only diverge with adapters of their own (spec A-11)."""
    return options.experts or ("shared" if config.moe_variant == "native" else "per-expert")


def apply_lora(model: MoEmbForEmbedding, options: LoraOptions) -> MoEmbLoraModel:
    """The PEFT model of spec §7.2's recipe (see the module docstring); only adapters, the `<emb>` row and, when
    trained, the routers take gradients."""
    config = model.config
    experts = expert_lora_mode(config, options)
    if experts not in EXPERT_LORA_MODES:
        raise ValueError(f"expert LoRA must be one of {', '.join(EXPERT_LORA_MODES)}, got {experts!r}")
    if config.moe_variant != "native" and experts in ("shared", "grouped"):
        raise ValueError(
            f"{config.moe_variant} experts are copies of one dense FFN and need adapters of their own to diverge: "
            "use --expert-lora per-expert (spec A-11)"
        )
    lora_config = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=LORA_TARGETS.format(gdn=GDN_LORA_TARGETS if options.target_gdn else ""),
        trainable_token_indices={"embed_tokens": [config.emb_token_id]} if config.pooling == "emb_token" else None,
    )
    peft_model = MoEmbLoraModel(model, lora_config)
    if experts != "none":
        groups = {"shared": 1, "grouped": options.expert_groups, "per-expert": config.text_config.num_experts}[experts]
        add_expert_adapters(peft_model, options.rank, options.alpha, groups)
    train_router = config.router_trainable if options.train_router is None else options.train_router
    for module in peft_model.modules():
        if isinstance(module, TopKRouter):
            module.requires_grad_(train_router)
    return peft_model


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --- the command --------------------------------------------------------------------------------------------------


@dataclass
class MoEmbTrainingOptions(TrainerOptions):
    recipe_fields = {
        "dataloader_drop_last": "the labels of the gathered logits assume equal local batches",
        "ddp_static_graph": "queries and targets are two forwards before one backward, which DDP allows only with a "
                            "static graph",
        "per_device_eval_batch_size": "validation batches are as large as the training ones: InfoNCE depends on "
                                      "the number of in-batch negatives",
    }
    eval_metrics = ("loss", "hit_at_1", "recall_at_5")

    batch_size: int = 32  # per process; the negatives pool is the global batch
    recipe: str = "stated"
    learning_rate: float | None = None  # default: the recipe's
    weight_decay: float = 0.01
    warmup_steps: int = 10
    chunk_size: int | None = None  # GradCache chunk size; None embeds the batch at once
    max_length: int | None = None  # default: the processor's (8192)
    negatives: bool = False
    mask_duplicate_targets: bool = False
    lora: LoraOptions = field(default_factory=LoraOptions)
    bf16: bool = False
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: bf16's
    smoes: SmoesSettings | None = None  # SMoES on the experts (`--smoes`; trains the routers), saved in the config
    adaptive: AdaptiveRecipeOptions | None = None  # trained efficiency gates (`moezoo.training.moemb_adaptive`)


def train_moemb(
    model_dir: str | Path,
    data,
    out: str | Path,
    options: MoEmbTrainingOptions | None = None,
    image_root: str | Path | None = None,
    overwrite: bool = False,
) -> dict:
    """LoRA-train the MoEMB model in `model_dir` on `data` (MMEB's training format, see `load_mmeb_dataset`) and save
    the merged model, its processor, the loss curves and the routing heatmap to `out`. With `options.eval_data` (the
    same format), the validation metrics (`MoEmbEvaluation`) are measured every `eval_steps` steps (default:
    `logging_steps`), on batches of the training size. Returns the training record (also written to the provenance file)."""
    options = options or MoEmbTrainingOptions()
    if options.recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {options.recipe!r}")
    checkpoint = checkpoint_to_resume(out, options)
    folder, _ = model_folder(model_dir, "`moezoo train moemb`", ["moemb"])
    check_same_format(data, options.eval_data)
    dataset = load_mmeb_dataset(data, image_root, options.negatives)
    eval_dataset = None if options.eval_data is None else load_mmeb_dataset(options.eval_data, image_root,
                                                                             options.negatives)  # fmt: skip
    for name, examples in (("data set", dataset), ("evaluation data set", eval_dataset)):
        if examples is not None:
            check_enough_examples(len(examples), options.batch_size, name)
    if options.chunk_size is not None and not 0 < options.chunk_size < options.batch_size:
        raise ValueError(f"--chunk-size must lie between 1 and the batch size {options.batch_size}, got "
                         f"{options.chunk_size}")  # fmt: skip
    if options.smoes is not None and options.chunk_size is not None:
        raise ValueError("--smoes counts every training forward, and GradCache (--chunk-size) runs each one twice: "
                         "train without --chunk-size")  # fmt: skip

    gates = None if options.adaptive is None else GateTraining(options.adaptive)
    if gates is not None and options.chunk_size is not None:
        raise ValueError("--adaptive-recipe adds its gates' budget and distillation terms to each forward's loss, "
                         "which GradCache (--chunk-size) does not back-propagate: train without "
                         "--chunk-size")  # fmt: skip

    def with_smoes(model: MoEmbForEmbedding) -> MoEmbForEmbedding:
        if options.smoes is not None:
            if options.lora.train_router is not False:  # the SMoES losses train the routers
                model.config.router_trainable = True
            enable_smoes(model, options.smoes)
        return model

    def with_lora(model: MoEmbForEmbedding) -> MoEmbLoraModel:
        if model.config.pooling == "emb_token" and model.config.emb_token_id is None:
            raise ValueError(f"{model_dir} has no emb_token_id in its config: convert or create it with moezoo first")
        with_smoes(model)
        # Under --ep the experts of `model` are split already, and a copy of them would dispatch its tokens to the
        # originals (the token exchange is a closure over them): the distillation teacher is loaded whole instead.
        teacher = None
        if gates is not None and gates.recipe.distill and options.ep > 1:
            teacher = with_smoes(MoEmbForEmbedding.from_pretrained(folder, dtype=model.dtype))
        # Before the adapters' random initialisation: the Trainer seeds only what comes after it.
        set_seed(options.seed)
        if gates is not None:
            gates.add_gates(model, teacher)
        peft_model = apply_lora(model, options.lora)
        return peft_model if gates is None else gates.set_trainable(peft_model)

    # Under --fsdp / --ep the adapters are attached before the model is sharded (`adapted_sharding`). The layer-skip
    # gates decide before their block's forward, where FSDP2 has not gathered their layer: they stay whole.
    dtype = load_dtype(options.dtype) or {"dtype": torch.bfloat16 if options.bf16 else torch.float32}
    load = partial(load_adapted_for_training, MoEmbForEmbedding, folder, with_lora, root_held=("model.visual",),
                   kept_whole=("skip_gate",), **dtype)  # fmt: skip
    peft_model = load(options.fsdp, options.ep, options.ep_implementation)
    model = peft_model.get_base_model()
    processor = MoEmbProcessor.from_pretrained(folder)
    trainable = count_trainable(peft_model)
    learning_rate = options.learning_rate or RECIPES[options.recipe]

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        args = training_arguments(
            out,
            options,
            fixed=dict(  # why: MoEmbTrainingOptions.recipe_fields
                dataloader_drop_last=True,
                # The same parameters are used at every step, as DDP's static graph needs (fused experts are one
                # tensor per layer).
                ddp_static_graph=True,
                per_device_eval_batch_size=options.batch_size,
            ),
            learning_rate=learning_rate,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1},
            adam_beta1=0.9,
            adam_beta2=0.98,
            max_grad_norm=1.0,
            bf16=options.bf16,
        )
        collator = MoEmbCollator(processor, options.chunk_size, options.max_length)
        trainer_class, recipe = (MoEmbTrainer, {}) if gates is None else (recipe_trainer(MoEmbTrainer),
                                                                          {"gate_training": gates})  # fmt: skip
        trainer = trainer_class(
            model=peft_model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator,
            callbacks=[LogAtCheckpointsAndEnd()],
            logit_scale=model.config.logit_scale, mask_duplicate_targets=options.mask_duplicate_targets,
            gradcache=options.chunk_size is not None, **recipe,
        )  # fmt: skip
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if options.fsdp > 1 or options.ep > 1:
            peft_model = unsharded_copy(peft_model, load)
        model = merge_lora(peft_model)
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        logs = trainer.state.log_history
        panels = {"InfoNCE loss": "loss", "learning rate": "learning_rate"}
        panels |= evaluation_panels(options.eval_metrics, logs)
        smoes = model.config.smoes_settings()
        if smoes is not None:
            panels |= {"SMoES loss (weighted)": "smoes_loss"} | smoes_panels(model.config.text_config.num_hidden_layers)
        curves = plot_log_history(logs, panels, staging / "training_curves.png", title="MoEMB training")
        heatmap = routing_heatmap(model, dataset, collator, staging / "routing_heatmap.png")
        msi = None
        if smoes is not None:
            examples = [dataset[i] for i in range(min(64, len(dataset)))]
            chunks = [chunk for side in ("query", "target") for chunk in collator(examples)[side]]
            modality = token_type_modality(smoes.smoes_vision_token_types)
            text = model.config.text_config
            msi = write_modality_routing(
                evaluation_routing(model, chunks, modality), text.num_experts, text.num_experts_per_tok, staging,
                "MoEMB experts with SMoES: share of each modality's top-k dispatches per layer",
            )  # fmt: skip
        lora = options.lora
        training = {
            "summary": f"contrastive LoRA training (InfoNCE, logit scale {model.config.logit_scale}) for "
                       f"{options.steps} steps, batch {options.batch_size}, {options.recipe} recipe",
            "steps": options.steps,
            "batch_size": options.batch_size,
            "learning_rate": learning_rate,
            **loss_summary(logs),
            "examples": len(dataset),
            "lora": f"r={lora.rank}, alpha={lora.alpha}, experts: {expert_lora_mode(model.config, lora)}"
                    + (f" ({lora.expert_groups} groups)" if lora.experts == "grouped" else "")
                    + (", Gated DeltaNet" if lora.target_gdn else ""),
            "trainable_parameters": trainable,
            "gradcache_chunk_size": options.chunk_size,
        }
        if msi is not None:
            training |= {"smoes_step": int(model.model.language_model.smoes.step), "msi": msi}
        if gates is not None:
            training |= gates.finish(logs, staging)
        training |= evaluation_summary(trainer, options.eval_metrics)
        write_provenance(staging, read_provenance(folder) | {"training": training, "moezoo_version": __version__})
        console.print(f"wrote {curves.name} and {heatmap.name}")
    return training


@torch.no_grad()
def routing_heatmap(model: MoEmbForEmbedding, dataset, collator: MoEmbCollator, path: Path,
                    num_examples: int = 64) -> Path:  # fmt: skip
    """Tokens per expert per layer of the text model, by token modality (those present), over the queries and
    targets of the first examples of `dataset`."""
    model.eval()
    examples = [dataset[i] for i in range(min(num_examples, len(dataset)))]
    chunks = [chunk.to(model.device) for side in ("query", "target") for chunk in collator(examples)[side]]
    present = torch.unique(torch.cat([chunk["mm_token_type_ids"].flatten() for chunk in chunks]))
    group_of_modality = torch.zeros(len(TOKEN_MODALITIES), dtype=torch.long, device=model.device)
    group_of_modality[present] = torch.arange(len(present), device=model.device)
    with record_routing(model, group_names=[TOKEN_MODALITIES[int(m)] for m in present]) as stats:
        for chunk in chunks:
            stats.set_groups(group_of_modality[chunk["mm_token_type_ids"]])  # padding is text (0), always present
            model(**chunk, adaptive={})  # full compute: the counts must cover every token
    return plot_routing_heatmap(stats, path, title="MoEMB experts: share of each modality's tokens per layer")


def add_train_arguments(parser) -> None:
    defaults, lora = MoEmbTrainingOptions(), LoraOptions()
    parser.add_argument("--model", required=True, help="a MoEMB folder (moezoo convert / create / train)")
    parser.add_argument("--data", required=True,
                        help="MMEB training data: a JSON/JSONL/CSV/Parquet file with qry, qry_image_path, pos_text, "
                             "pos_image_path (and neg_text, neg_image_path), or a folder of such files, one per task")
    parser.add_argument("--out", required=True)
    parser.add_argument("--image-root", help="folder the image paths are relative to (default: the data's folder)")
    # GRPOConfig's fields: a TrainingArguments' and GRPO's (--grpo; without it, MoEmbTrainingOptions refuses them).
    add_trainer_arguments(parser, defaults, arguments_class=GRPOConfig, helps={
        "per_device_train_batch_size": "pairs per process; all processes' targets are every query's negatives "
                                       f"(default here: {defaults.batch_size})",
        "learning_rate": "peak learning rate (default: the recipe's)",
        "bf16": "load the weights in bfloat16 and train under bf16 autocast",
    } | GRPO_FIELD_HELPS)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=defaults.recipe,
                        help="stated: peak LR 1e-4 (the paper's headline); tuned: 5e-5 (its Fig. 6)")
    parser.add_argument("--chunk-size", type=int,
                        help="GradCache: embed the batch in chunks of this many inputs (same gradients, less memory)")
    parser.add_argument("--max-length", type=int, help="longest input in tokens (default: the processor's)")
    parser.add_argument("--negatives", action="store_true", help="use neg_text / neg_image_path as hard negatives")
    parser.add_argument("--mask-duplicate-targets", action="store_true",
                        help="do not count in-batch targets identical to a query's own target as negatives")
    parser.add_argument("--lora-r", type=int, default=lora.rank)
    parser.add_argument("--lora-alpha", type=int, default=lora.alpha)
    parser.add_argument("--lora-dropout", type=float, default=lora.dropout)
    parser.add_argument("--expert-lora", choices=EXPERT_LORA_MODES,
                        help="routed experts: one adapter per layer (shared; default for native MoE), per group of "
                             "experts, per expert (default for upcycled and modality experts), or none")
    parser.add_argument("--expert-lora-groups", type=int, default=lora.expert_groups,
                        help="with --expert-lora grouped: adapters per layer, each for consecutive experts")
    parser.add_argument("--lora-target-gdn", action="store_true",
                        help="also adapt the Gated DeltaNet projections (the paper's A10B recipe)")
    router = parser.add_mutually_exclusive_group()
    router.add_argument("--train-router", dest="train_router", action="store_true", default=None)
    router.add_argument("--freeze-router", dest="train_router", action="store_false",
                        help="(default: the config's router_trainable, frozen for native MoE)")
    add_dtype_argument(parser, default="float32, bfloat16 with --bf16")
    add_smoes_arguments(parser)
    parser.add_argument("--overwrite", action="store_true")
    add_grpo_arguments(parser)
    add_recipe_arguments(parser)


def run_train(args) -> int:
    if args.grpo:
        return run_grpo(args)
    options = MoEmbTrainingOptions(
        **trainer_options(args, MoEmbTrainingOptions), recipe=args.recipe, chunk_size=args.chunk_size,
        max_length=args.max_length, negatives=args.negatives, mask_duplicate_targets=args.mask_duplicate_targets,
        lora=LoraOptions(rank=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, experts=args.expert_lora,
                         expert_groups=args.expert_lora_groups, target_gdn=args.lora_target_gdn,
                         train_router=args.train_router),
        smoes=smoes_settings_from_args(args),
        adaptive=recipe_options(args),
        dtype=args.dtype,
    )  # fmt: skip
    training = train_moemb(args.model, args.data, args.out, options, image_root=args.image_root,
                           overwrite=args.overwrite)
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
