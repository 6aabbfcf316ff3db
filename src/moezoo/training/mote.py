"""Training MoTE with `transformers.Trainer` (spec mote.md §3, §7).

- Joint multi-task training: every example carries its task, which is its route (`task_ids`); the loss is the LM
  loss on the answer and its end-of-turn token (spec §3.1). Only the selected expert and the shared expert of each
  example get gradients; the vision tower stays frozen; the rest of the decoder trains in full or, as in the paper,
  through LoRA on attention (`lora_r`), merged at the end.
- Expert addition (spec §3.3): a new expert, copied from an existing one, the shared expert or the dense base, trains
  alone on its task; every other parameter is frozen, so every other route stays bit-identical.
- Expert training (`train_experts`, spec §7.4): existing experts train alone on their tasks, as GLM-OCR-MoTE's `kie`
  does; everything else, the shared expert included, is frozen, so the other routes (`ocr`: GLM-OCR) stay
  bit-identical.
- Batches come from `MoteBucketBatchSampler` (spec §7.3): one route per step on every process, buckets drawn in
  proportion to their unseen examples.

Experts that an optimizer step did not use have `grad is None`: Trainer zeroes gradients with `set_to_none=True`, and
AdamW skips such parameters, so neither momentum nor weight decay moves them. Under DDP they are unused parameters,
so `MoteTrainer` turns on `ddp_find_unused_parameters` unless told otherwise. (DeepSpeed ZeRO's flat gradient buffers
hold zeros instead: unselected experts then drift during joint training, never during expert addition, where they
are outside the optimizer.)

`train_mote` (`moezoo train mote`) writes a checkpoint beside its output folder every `save_steps` steps, from which
`resume` continues an interrupted run (`moezoo.training.arguments`).

TRL works too: `SFTTrainer` prepares prompt-completion data as usual, and `TaskIdsCollator` around its collator
carries each example's route to the model (pass `remove_unused_columns=False`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from peft import LoraConfig
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Trainer, TrainingArguments, set_seed

from .. import __version__
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import MODEL_FILES, locate, model_folder
from ..modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from ..modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from ..processors.mote import IGNORE_INDEX, GlmOcrMoteProcessor, VideoLlmMoteProcessor
from ..terminal import console, print_table
from .arguments import (
    TrainerOptions,
    PeftModelWithTrainedBase,
    add_trainer_arguments,
    checkpoint_to_resume,
    loss_summary,
    trainer_options,
    training_arguments,
)
from .callbacks import LogAtCheckpointsAndEnd, LogsStepMeans, use_rich_progress, write_tensorboard_into
from ..processors.images import open_image
from .data import TABLE_FORMATS, empty_rows, empty_rows_error, frame_paths, load_table
from .adapted_sharding import load_adapted_for_training, unsharded_copy
from .distributed import load_for_training, main_process_output_dir
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

# What their dense base models load as, for experts initialised from the dense FFNs.
DENSE_BASE_CLASSES = {"videollm_mote": AutoModelForCausalLM, "glm_ocr_mote": AutoModelForImageTextToText}
# The architectures `moezoo train mote` trains: model_type -> (model class, processor class).
TRAINABLE = {
    "videollm_mote": (VideoLlmMoteForConditionalGeneration, VideoLlmMoteProcessor),
    "glm_ocr_mote": (GlmOcrMoteForConditionalGeneration, GlmOcrMoteProcessor),
}
# Frozen in every MoTE recipe (spec §7.1): VideoLLM-MoTE's SigLIP, GLM-OCR's CogViT and merger.
VISION_MODULES = ("model.vision_tower", "model.visual")
# LoRA on the decoder's attention only, never the vision tower's (spec §7.1).
ATTENTION_LORA_TARGETS = r"model\.(language_model\.)?layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
# What joint training trains besides LoRA (spec §7.1): the experts, the shared experts and the projector.
JOINT_TRAINABLE = ("mlp.experts.", "mlp.shared_expert.", "multi_modal_projector.")


# --- the bucketed rank-aligned sampler (spec §7.3, paper A.3) -------------------------------------------------------


class MoteBucketBatchSampler(Sampler[list[int]]):
    r"""
    Batches of a single route each, with every process on the same route at every step.

    At the start of an epoch the examples are grouped by route and every bucket is shuffled. Each step draws a bucket
    with probability proportional to its examples not yet drawn this epoch, then a global group of
    `batch_size * num_replicas` examples from it; process `k` trains on `group[k * batch_size : (k + 1) * batch_size]`.
    A bucket with fewer unseen examples than a group is topped up from a reshuffled copy of itself, with examples not
    already in the group while there are any. The epoch ends when every example has been drawn, after
    `sum_m ceil(n_m / group)` steps, so large buckets are not under-sampled nor small ones recycled. All processes
    seed their generator with `seed + epoch`, so they make the same draws without communicating.

    With `rank=None` every step yields its `num_replicas` local batches in rank order: accelerate's `BatchSamplerShard`
    (what `Trainer` wraps a batch sampler in) hands batch `i` to process `i % num_replicas`, which is exactly that. With
    `rank=k` it yields process `k`'s batches only, for a data loader that is not sharded again.

    Args:
        route_ids: The route (`task_ids` value) of every example of the data set.
        batch_size: Examples per process and step.
        num_replicas: Number of data-parallel processes.
        rank: The process to yield batches for, or None for all (see above).
        seed: Seeds the shuffles and draws, with the epoch (`set_epoch`).
    """

    def __init__(
        self, route_ids: Sequence[int], batch_size: int, num_replicas: int = 1, rank: int | None = None, seed: int = 0
    ):
        if len(route_ids) == 0:
            raise ValueError("MoteBucketBatchSampler needs at least one example.")
        if batch_size < 1 or num_replicas < 1:
            raise ValueError(f"batch_size and num_replicas must be positive, got {batch_size} and {num_replicas}.")
        if rank is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}.")
        routes = torch.as_tensor(list(route_ids))
        self.buckets = {int(route): (routes == route).nonzero().squeeze(1) for route in routes.unique()}
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.drop_last = False  # read by accelerate; every batch is full

    @property
    def group_size(self) -> int:
        return self.batch_size * self.num_replicas

    @property
    def num_steps(self) -> int:
        """Steps per epoch: `sum_m ceil(n_m / group_size)`."""
        return sum(math.ceil(len(bucket) / self.group_size) for bucket in self.buckets.values())

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_steps * (self.num_replicas if self.rank is None else 1)

    def __iter__(self):
        for group in self.groups():
            ranks = range(self.num_replicas) if self.rank is None else [self.rank]
            for rank in ranks:
                yield group[rank * self.batch_size : (rank + 1) * self.batch_size]

    def groups(self):
        """The global group of every step of the current epoch (the same on every process)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        routes = list(self.buckets)
        orders = {
            route: bucket[torch.randperm(len(bucket), generator=generator)] for route, bucket in self.buckets.items()
        }
        drawn = dict.fromkeys(routes, 0)
        for _ in range(self.num_steps):
            fresh = torch.tensor([len(orders[route]) - drawn[route] for route in routes], dtype=torch.float)
            route = routes[int(torch.multinomial(fresh, 1, generator=generator))]
            group = orders[route][drawn[route] : drawn[route] + self.group_size].tolist()
            drawn[route] += len(group)
            while len(group) < self.group_size:
                bucket = self.buckets[route]
                reshuffled = bucket[torch.randperm(len(bucket), generator=generator)].tolist()
                taken = set(group)
                # A bucket smaller than a group cannot fill it without repeating examples.
                unused = [index for index in reshuffled if index not in taken] or reshuffled
                group += unused[: self.group_size - len(group)]
            yield group


def route_id(task: str, expert_names: Sequence[str]) -> int:
    """The route id of task `task`: its index among the model's experts."""
    if task not in expert_names:
        raise ValueError(
            f"Task {task!r} is not an expert of the model ({list(expert_names)}): give each example a task named "
            "after an expert, or an int `task_ids`."
        )
    return list(expert_names).index(task)


def dataset_route_ids(dataset, expert_names: Sequence[str]) -> list[int]:
    """The route of every example: its `task_ids` column, or its `task` column (names) mapped to route ids."""
    columns = dataset.column_names
    if "task_ids" in columns:
        return [int(route) for route in dataset["task_ids"]]
    if "task" not in columns:
        raise ValueError(f"The data set needs a `task` (name) or `task_ids` column to route examples; it has {columns}")
    return [route_id(task, expert_names) for task in dataset["task"]]


# --- batches --------------------------------------------------------------------------------------------------------


@dataclass
class MoteCollator:
    """
    Examples `{"task", "prompt", "answer"}` plus `"frames"` (VideoLLM-MoTE) or `"image"` (GLM-OCR-MoTE) -> a training
    batch: the rendered prompt with its media, then the answer and the end-of-turn token, which alone are supervised
    (`labels` is -100 elsewhere); `task_ids` from the task names. Sequences are padded on the right.

    A VideoLLM-MoTE example with `"responses"` (`[{"frame": k, "text": ...}, ...]`) instead of an answer is a live
    stream (Ego4D narration): the responses follow their frames and silent frames learn `silence_token` (see
    `VideoLlmMoteProcessor.encode_stream`).
    """

    processor: VideoLlmMoteProcessor | GlmOcrMoteProcessor
    silence_token: str = "eos"  # the model's `stream_silence_token`

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(example) for example in examples]
        length = max(len(features["input_ids"]) for features in encoded)
        tokenizer = self.processor.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        padding = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
        batch = {
            key: torch.tensor([features[key] + [value] * (length - len(features[key])) for features in encoded])
            for key, value in padding.items()
            if key in encoded[0]
        }
        for key in encoded[0].keys() - padding.keys():
            batch[key] = torch.from_numpy(np.concatenate([features[key] for features in encoded]))
        return batch

    def encode(self, example: dict) -> dict:
        """One example's token lists (prompt + answer) and media arrays."""
        if example.get("responses") is not None:
            return self.encode_stream(example)
        text = [self.processor.render_prompt(example["prompt"])]
        if "frames" in example:
            media = {"videos": [example["frames"]], "video_fps": example.get("video_fps")}
        elif "image" in example:
            media = {"images": [example["image"]]}
        else:
            raise ValueError(f"An example needs `frames` (a video) or an `image`; it has {sorted(example)}.")
        inputs = self.processor(text=text, task=example["task"], return_tensors="np", **media)
        prompt = inputs.pop("input_ids")[0].tolist()
        answer = self.processor.answer_ids([example["answer"]])[0]
        features = {key: value for key, value in inputs.items() if key != "attention_mask"}
        features["input_ids"] = prompt + answer
        features["attention_mask"] = [1] * len(features["input_ids"])
        features["labels"] = [IGNORE_INDEX] * len(prompt) + answer
        if "mm_token_type_ids" in features:
            features["mm_token_type_ids"] = features["mm_token_type_ids"][0].tolist() + [0] * len(answer)
        return features

    def encode_stream(self, example: dict) -> dict:
        if not isinstance(self.processor, VideoLlmMoteProcessor) or "frames" not in example:
            raise ValueError("An example with `responses` is a live video stream: it needs `frames` and VideoLLM-MoTE.")
        responses = {int(response["frame"]): response["text"] for response in example["responses"]}
        inputs = self.processor.encode_stream(
            example["frames"], responses, example["prompt"], task=example["task"], silence_token=self.silence_token,
            video_fps=example.get("video_fps"), return_tensors="np",
        )  # fmt: skip
        token_lists = ("input_ids", "attention_mask", "labels")
        return {key: value[0].tolist() if key in token_lists else value for key, value in inputs.items()}


@dataclass
class TaskIdsCollator:
    """
    Wraps any collator (TRL's, `DataCollatorWithPadding`, ...) so that each example's route reaches the model: its
    `task_ids` (an int) or `task` (a name, mapped through `expert_names`) becomes the batch's `task_ids`.
    """

    collator: Callable[[list[dict]], dict]
    expert_names: Sequence[str] = ()

    def __call__(self, examples: list[dict]) -> dict:
        routes = [
            int(example["task_ids"]) if "task_ids" in example else route_id(example.get("task"), self.expert_names)
            for example in examples
        ]
        removed = ("task", "task_ids")
        batch = self.collator([{k: v for k, v in example.items() if k not in removed} for example in examples])
        batch["task_ids"] = torch.tensor(routes, dtype=torch.long)
        return batch


# --- the trainer ----------------------------------------------------------------------------------------------------


class MoteEvaluation(EvaluatesWhileTraining):
    """MoTE's metrics while training (`EvaluatesWhileTraining`): beside the loss, each route's loss
    (`route_<expert>_loss`: the answer tokens' mean negative log-likelihood on the examples of that route's task) and
    `task_accuracy`, the share of answer tokens predicted right (greedy, given the answer so far), over every task."""

    def evaluation_values(self, model, inputs, outputs) -> dict[str, torch.Tensor]:
        values = answer_token_values(outputs.logits, inputs["labels"])
        if "task_ids" in inputs:  # a dense baseline, without experts, has no routes
            values["route"] = inputs["task_ids"]
        return values

    def evaluation_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics = {"task_accuracy": (values["answer_correct"].sum() / values["answer_tokens"].sum()).item()}
        for route in values["route"].unique().tolist() if "route" in values else []:
            on_route = values["route"] == route
            metrics[f"route_{self.expert_names[route]}_loss"] = (
                values["answer_nll_sum"][on_route].sum() / values["answer_tokens"][on_route].sum()
            ).item()
        return super().evaluation_metrics(values) | metrics


class MoteTrainer(MoteEvaluation, LogsStepMeans, ShardedCheckpointsMixin, Trainer):
    """
    `Trainer` with route-homogeneous, rank-aligned batches (`MoteBucketBatchSampler`) and DDP that allows the unused
    experts. The training data set needs a `task` or `task_ids` column. Beside the loss, the loss of each route trained
    since the previous log is logged as `loss/<expert name>` (the batches of a step all take one route).
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *more, **kwargs):
        if args is not None and args.ddp_find_unused_parameters is None:
            # Unselected experts take no part in a step; DDP must expect that (spec §3.2).
            args.ddp_find_unused_parameters = True
        super().__init__(model, args, *more, **kwargs)

    @property
    def expert_names(self) -> list[str]:
        return self.accelerator.unwrap_model(self.model).config.get_text_config().mote_expert_names

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("MoteTrainer: training requires a train_dataset.")
        expert_names = self.expert_names
        # A dense baseline (no experts) has one path: one bucket.
        routes = dataset_route_ids(self.train_dataset, expert_names) if expert_names else [0] * len(self.train_dataset)
        dataset, collator = self.train_dataset, self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        sampler = MoteBucketBatchSampler(
            routes, self._train_batch_size, num_replicas=self.args.world_size, seed=self.args.seed
        )
        loader = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )  # fmt: skip
        return self.accelerator.prepare(loader)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        task_ids = inputs.get("task_ids")
        if model.training and task_ids is not None:
            loss = result[0] if return_outputs else result
            self.record_step_value(f"loss/{self.expert_names[int(task_ids[0])]}", loss)
        return result


# --- what trains ----------------------------------------------------------------------------------------------------


def freeze_vision(model) -> None:
    """Freeze the vision tower (and GLM-OCR's merger, which lives in it): frozen in every MoTE recipe."""
    for name, module in model.named_modules():
        if name in VISION_MODULES:
            module.requires_grad_(False)


class MoteLoraModel(PeftModelWithTrainedBase):
    """PEFT's model of `with_attention_lora`, whose checkpoints keep the parameters joint training trains in full."""

    def trained_base_parameters(self) -> dict[str, nn.Parameter]:
        return {
            name: parameter
            for name, parameter in self.get_base_model().named_parameters()
            if any(part in name for part in JOINT_TRAINABLE)
        }


def with_attention_lora(model, rank: int) -> MoteLoraModel:
    """The paper's joint recipe (spec §7.1): LoRA (alpha = 2 r) on the decoder's attention; the experts, the shared
    experts and the projector train in full; everything else is frozen."""
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTENTION_LORA_TARGETS)
    peft_model = MoteLoraModel(model, config)
    for parameter in peft_model.trained_base_parameters().values():
        parameter.requires_grad_(True)
    return peft_model


def trainable_parameters(model) -> dict[str, int]:
    parameters = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    return {"trainable": trainable, "frozen": sum(p.numel() for p in parameters) - trainable}


# --- the command ----------------------------------------------------------------------------------------------------


@dataclass
class MoteTrainingOptions(TrainerOptions):
    eval_metrics = ("loss", "route_<expert>_loss", "task_accuracy")

    steps: int = 300
    batch_size: int = 16
    lora_r: int = 0  # 0: the decoder trains in full (for models trained from scratch); else LoRA on attention
    tasks: tuple[str, ...] = ()  # train on these tasks only (default: every task of the data)
    train_experts: tuple[str, ...] = ()  # train only these existing experts, on their tasks (instead of `tasks`)
    add_expert: str | None = None  # expert addition: the new expert's name ...
    # ... what it starts as: an expert's name, "shared" (after joint training; a fresh conversion's shared expert
    # outputs zero) or "dense" (the FFNs of the dense base model)
    init_from: str = "shared"
    base_model: str | None = None  # ... with "dense": that model's folder or Hub id (default: `mote_base_model`)
    description: str | None = None  # ... and its description for the route selector
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: the folder's


def load_mote_model(model_dir: str | Path, fsdp: int = 1, ep: int = 1, ep_implementation: str = "auto",
                    adapt=None, dtype: str | None = None):
    """The model and processor of a VideoLLM-MoTE or GLM-OCR-MoTE folder, the model sharded as `--fsdp` / `--ep`
    ask (see `moezoo.training.distributed`); with `adapt`, `adapt(model)` (LoRA, a new expert), applied before the
    sharding (`moezoo.training.adapted_sharding`); the weights loaded in `dtype` (`moezoo.training.precision`)."""
    folder, model_type = model_folder(
        model_dir, "`moezoo train mote`", TRAINABLE,
        other_types="train the text-only Llama-MoTE with TRL's SFTTrainer and TaskIdsCollator",
    )
    model_class, processor_class = TRAINABLE[model_type]
    if adapt is None:  # checkpoints of sharded runs are MoteTrainer's (`ShardedCheckpointsMixin`): no save_steps
        model = load_for_training(model_class, folder, fsdp, ep, ep_implementation=ep_implementation,
                                  **load_dtype(dtype))
    else:
        model = load_adapted_for_training(model_class, folder, adapt, fsdp, ep, ep_implementation, **load_dtype(dtype))
    return model, processor_class.from_pretrained(folder)


def load_dense_base(model, path: str | Path | None = None):
    """The dense model a MoTE model was converted from (`path`, default its `mote_base_model`), for new experts
    initialised from the dense FFNs (spec §3.3)."""
    path = path or model.config.get_text_config().mote_base_model
    if path is None:
        raise ValueError(
            "init_from='dense' copies the FFNs of the dense base model, and this model records none "
            "(mote_base_model): give its folder or Hub id (`--base-model`)"
        )
    folder = locate(path, "the dense base model", "give --base-model (base_model=) a local folder", MODEL_FILES)
    return DENSE_BASE_CLASSES[model.config.model_type].from_pretrained(folder)


def load_mote_dataset(source: str | Path | datasets.Dataset, tasks: Sequence[str] = ()) -> datasets.Dataset:
    """
    Examples with `task`, `prompt`, `answer` (or `responses`, for live streams; see `MoteCollator`) and `frames`
    (a list of images or image paths, or a folder of frames) or `image`, of `tasks` only if given: a
    `datasets.Dataset`, or a JSON / JSON Lines / CSV / Parquet file whose media paths are relative to the file. A row
    with neither an answer nor responses, or without its media, is reported by number here rather than mid-training.
    """
    if isinstance(source, datasets.Dataset):
        dataset, base = source, None
    else:
        path = Path(source)
        if path.suffix.lower() not in TABLE_FORMATS or not path.is_file():
            raise ValueError(f"{path}: expected a {', '.join(TABLE_FORMATS)} file or a datasets.Dataset")
        dataset, base = load_table(path), path.parent
    columns = set(dataset.column_names)
    if not {"task", "prompt"} <= columns or not {"answer", "responses"} & columns or not {"frames", "image"} & columns:
        raise ValueError(
            f"The data set needs columns task, prompt, answer (or responses, for streams) and frames (videos) or "
            f"image; it has {dataset.column_names}."
        )
    _require_targets_and_media(dataset, source)
    if tasks:
        dataset = dataset.filter(lambda task: task in tasks, input_columns="task")
        if len(dataset) == 0:
            raise ValueError(f"The data set has no example of the tasks {list(tasks)}.")
    return dataset if base is None else dataset.with_transform(lambda batch: _open_media(batch, base))


def _require_targets_and_media(dataset: datasets.Dataset, source) -> None:
    """Every row needs an answer or responses (a file may mix offline examples and streams, leaving the other column
    empty) and its frames or image: otherwise the collator fails deep in tokenisation, naming no row."""
    def lacking(column) -> set[int]:
        return empty_rows(dataset, column) if column in dataset.column_names else set(range(len(dataset)))

    for what, first, second in (("neither an answer nor responses", "answer", "responses"),
                                ("neither frames nor an image", "frames", "image")):  # fmt: skip
        rows = lacking(first) & lacking(second)
        if rows:
            raise empty_rows_error(source, sorted(rows), what)


def _open_media(batch: dict, base: Path) -> dict:
    batch = dict(batch)
    if "frames" in batch:
        batch["frames"] = [[open_image(path) for path in frame_paths(frames, base)] for frames in batch["frames"]]
    if "image" in batch:
        batch["image"] = [image if not isinstance(image, str) else open_image(base / image) for image in batch["image"]]
    return batch


def train_mote(
    model_dir: str | Path,
    data: str | Path | datasets.Dataset,
    out: str | Path,
    options: MoteTrainingOptions | None = None,
    overwrite: bool = False,
    dense_source=None,
) -> dict:
    """
    Train the MoTE model in `model_dir` on `data` (see `load_mote_dataset`) and save it with its processor, its loss
    curves (overall and per route) and a provenance record to `out`. Joint training by default; with
    `options.add_expert`, expert addition on that task's examples only; with `options.train_experts`, those experts
    alone on their tasks' examples. Returns the training summary.

    `dense_source` is the loaded dense base model, for `init_from="dense"` (default: loaded from
    `options.base_model` or the model's `mote_base_model`).
    """
    options = options or MoteTrainingOptions()
    if options.train_experts and (options.add_expert or options.lora_r):
        raise ValueError(
            "train_experts trains those experts alone, with everything else frozen; it does not combine with "
            "add_expert or lora_r"
        )
    if options.add_expert and options.lora_r:
        raise ValueError(
            f"add_expert trains the new expert {options.add_expert!r} alone, with everything else frozen, so there is "
            "no attention to put LoRA on: drop lora_r (--lora-r), or train jointly without add_expert"
        )
    if options.ep > 1:
        raise ValueError(
            f"--ep {options.ep}: MoTE's task experts are whole FFNs chosen per example, and every process trains the "
            "same route at each step (the rank-aligned sampler), so experts placed on processes would send the whole "
            "global batch to the one process holding that route's expert while the others wait; shard them with "
            f"--fsdp {options.ep} instead, which also holds 1/{options.ep} of every expert per process"
        )
    checkpoint = checkpoint_to_resume(out, options)
    check_same_format(data, options.eval_data)

    def with_lora(model) -> MoteLoraModel:
        freeze_vision(model)
        set_seed(options.seed)  # before the adapters' random initialisation: the Trainer seeds only what follows
        return with_attention_lora(model, options.lora_r)

    def with_new_expert(model):
        """Expert addition (spec §3.3): the new expert in every MoTE layer, everything else frozen."""
        nonlocal dense_source  # loaded once: the unsharded copy of a sharded run adds the expert again
        if options.init_from == "dense" and dense_source is None:
            dense_source = load_dense_base(model, options.base_model)
        model.add_expert(options.add_expert, options.init_from, dense_source, options.description)
        model.freeze_for_expert_addition(options.add_expert)
        return model

    # What a recipe adds after loading (LoRA, a new expert) is there before the model is sharded under --fsdp
    # (`adapted_sharding`), so that FSDP2 shards it with its layer; each step trains one route on every process
    # (`MoteBucketBatchSampler`), so every process runs, gathers and reduces the same units.
    adapt = with_new_expert if options.add_expert else with_lora if options.lora_r else None
    load = partial(load_mote_model, model_dir, adapt=adapt, dtype=options.dtype)
    trained, processor = load(options.fsdp, options.ep, options.ep_implementation)
    model = trained.get_base_model() if isinstance(trained, MoteLoraModel) else trained
    if options.train_experts:  # before reading the data, so that a misspelt expert fails naming the experts
        model.freeze_all_but_experts(list(options.train_experts))
    # Expert addition and expert training train on their experts' tasks only (spec §3.3, §7.4).
    tasks = (options.add_expert,) if options.add_expert else options.train_experts or options.tasks
    dataset = load_mote_dataset(data, tasks)
    eval_dataset = None if options.eval_data is None else load_mote_dataset(options.eval_data, tasks)
    text_config = model.config.get_text_config()
    if options.add_expert:
        recipe = f"expert addition of {options.add_expert!r} (from {options.init_from!r})"
    elif options.train_experts:
        trained, recipe = model, f"experts {', '.join(options.train_experts)} only"
    else:
        freeze_vision(model)
        recipe = f"joint, LoRA r={options.lora_r}" if options.lora_r else "joint, full decoder"
    processor.expert_names = list(text_config.mote_expert_names)
    counts = trainable_parameters(trained)

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        trainer = MoteTrainer(
            model=trained,
            args=training_arguments(out, options),
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            data_collator=MoteCollator(processor, getattr(model.config, "stream_silence_token", "eos")),
            callbacks=[LogAtCheckpointsAndEnd()],
        )
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if adapt is not None and options.fsdp > 1:  # sharded after adapting: gathered into an unsharded copy
            trained = unsharded_copy(trained, lambda: load()[0])
        # LoRA: merged into the attention weights
        model = trained.merge_and_unload() if isinstance(trained, MoteLoraModel) else trained
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        names = text_config.mote_expert_names
        panels = {"loss (all routes)": "loss"} | {f"loss of route {name!r}": f"loss/{name}" for name in names}
        panels |= evaluation_panels(options.eval_metrics, trainer.state.log_history)
        plot = plot_log_history(trainer.state.log_history, panels, staging / "training_curves.png",
                                title=f"MoTE training: {recipe}")
        training = {
            "summary": f"{recipe} for {options.steps} steps, batch {options.batch_size}",
            "steps": options.steps,
            "batch_size": options.batch_size,
            "learning_rate": options.learning_rate,
            **loss_summary(trainer.state.log_history),
            "examples": len(dataset),
            "examples_per_task": dict(sorted(Counter(dataset["task"]).items())),
            "experts": list(names),
            "trainable_parameters": counts["trainable"],
            "frozen_parameters": counts["frozen"],
            "lora_r": options.lora_r or None,
            **evaluation_summary(trainer, options.eval_metrics),
        }
        # model.name_or_path: the folder the model was read from (a Hub model's in the Hub cache)
        provenance = read_provenance(model.name_or_path) | {"training": training, "moezoo_version": __version__}
        write_provenance(staging, provenance)
        console.print(f"wrote {plot.name}")
    return training


def add_train_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a VideoLLM-MoTE or GLM-OCR-MoTE folder (convert / train)")
    parser.add_argument("--data", required=True,
                        help="JSON / JSON Lines / CSV / Parquet with task, prompt, answer (or responses) and frames or "
                             "image")
    parser.add_argument("--out", required=True)
    defaults = MoteTrainingOptions()
    add_trainer_arguments(parser, defaults)
    add_dtype_argument(parser)
    parser.add_argument("--lora-r", type=int, default=0,
                        help="joint training with LoRA of this rank on attention (the paper's recipe), merged at the "
                             "end; 0 trains the decoder in full")
    parser.add_argument("--task", dest="tasks", nargs="+", default=(), help="train on these tasks only")
    parser.add_argument("--train-experts", nargs="+", default=(), metavar="NAME",
                        help="train only these existing experts, on the data's examples of their tasks; everything "
                             "else (the shared expert included) stays frozen, so the other routes do not change")
    parser.add_argument("--add-expert", default=None, metavar="NAME",
                        help="expert addition: add expert NAME and train only it, on the data's NAME examples")
    parser.add_argument("--init-from", default=defaults.init_from,
                        help="with --add-expert: an existing expert's name, 'shared' (default; the trained shared "
                             "expert) or 'dense' (the base model's FFNs)")
    parser.add_argument("--base-model", default=None,
                        help="with --init-from dense: the dense model's folder or Hub id (default: the one the model "
                             "was converted from)")
    parser.add_argument("--description", default=None, help="with --add-expert: its description for route selection")
    parser.add_argument("--overwrite", action="store_true")


def run_train(args) -> int:
    options = MoteTrainingOptions(
        **trainer_options(args, MoteTrainingOptions), lora_r=args.lora_r, tasks=tuple(args.tasks),
        train_experts=tuple(args.train_experts), add_expert=args.add_expert, init_from=args.init_from,
        base_model=args.base_model, description=args.description,
        dtype=args.dtype,
    )
    training = train_mote(args.model, args.data, args.out, options, overwrite=args.overwrite)
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
