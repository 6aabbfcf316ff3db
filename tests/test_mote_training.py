"""Tests for MoTE training (spec mote.md §3, §7, §9 items 6 and 8): the bucketed rank-aligned sampler, the
collators, `MoteTrainer` (gradients of unselected experts stay None), the learning test on a synthetic multi-task
set, expert addition, TRL's SFTTrainer, `moezoo train mote`, the synthetic procedure videos, and `moezoo bench mote`
(active compute flat in the number of stored experts)."""

import argparse
import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset
from PIL import Image
from transformers import (
    AutoImageProcessor,
    GlmOcrConfig,
    GlmOcrForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    Trainer,
    TrainingArguments,
)

from moezoo.bench.mote import add_bench_arguments, run_bench
from moezoo.configuration.mote import (
    TINY_GLM_OCR,
    TINY_LLAMA,
    TINY_SIGLIP_VISION,
    TINY_VIDEOLLM_MOTE,
    VideoLlmMoteConfig,
)
from moezoo.conversion.mote_glm_ocr import convert_glm_ocr_to_mote, synthetic_inputs
from moezoo.conversion.mote_llama import convert_llama_to_mote
from moezoo.modeling.mote.glm_ocr import GlmOcrMoteForConditionalGeneration
from moezoo.modeling.mote.video_llm import VideoLlmMoteForConditionalGeneration
from moezoo.processors.build_mote import (
    build_word_level_tokenizer,
    make_glm_ocr_mote_processor,
    make_videollm_mote_processor,
)
from moezoo.processors.mote import (
    GlmOcrMoteProcessor,
    VideoLlmMoteFrameProcessor,
    VideoLlmMoteProcessor,
    kie_prompt,
    task_prompt,
)
from moezoo.training.mote import (
    MoteBucketBatchSampler,
    MoteCollator,
    MoteTrainer,
    MoteTrainingOptions,
    TaskIdsCollator,
    add_train_arguments,
    load_dense_base,
    run_train,
    train_mote,
)
from moezoo.training.mote_synthetic import PROCEDURES, ProcedureVideos


@pytest.fixture(scope="module", autouse=True)
def frame_processor_registered():
    """What `import moezoo` does once VideoLLM-MoTE's catalogue entry lists its frame processor as a processor part:
    `AutoImageProcessor` (which loads a processor's image processor) then knows the class by name."""
    AutoImageProcessor.register(VideoLlmMoteConfig, image_processor_classes={"pil": VideoLlmMoteFrameProcessor},
                                exist_ok=True)


def quiet_arguments(tmp_path, **changes) -> TrainingArguments:
    return TrainingArguments(
        **dict(output_dir=str(tmp_path / "checkpoints"), report_to="none", save_strategy="no", use_cpu=True,
               disable_tqdm=True, logging_steps=1000) | changes
    )


# ---------------------------------------------------------------------------------------------------------- sampler

# Buckets of 37, 12 and 5 examples, interleaved.
ROUTES = [0] * 37 + [1] * 12 + [2] * 5
ROUTES = [ROUTES[i] for i in torch.randperm(len(ROUTES), generator=torch.Generator().manual_seed(0)).tolist()]


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_every_rank_draws_from_the_same_bucket_at_every_step(num_replicas):
    samplers = [MoteBucketBatchSampler(ROUTES, 2, num_replicas, rank, seed=3) for rank in range(num_replicas)]
    steps = list(zip(*samplers))
    group = 2 * num_replicas
    assert len(steps) == sum(-(-n // group) for n in (37, 12, 5)) == len(samplers[0])
    for batches in steps:
        assert len({ROUTES[i] for batch in batches for i in batch}) == 1
        indices = [i for batch in batches for i in batch]
        assert len(indices) == group
        if ROUTES[indices[0]] != 2 or group <= 5:  # only a bucket smaller than a group must repeat examples
            assert len(set(indices)) == group


def test_every_example_appears_once_per_epoch_apart_from_top_ups():
    sampler = MoteBucketBatchSampler(ROUTES, 4, 2, rank=None, seed=1)
    seen = Counter(i for batch in sampler for i in batch)
    assert set(seen) == set(range(len(ROUTES)))
    # Each bucket's last group is topped up: 37 -> 40 draws, 12 -> 16, 5 -> 8 (a group of 8).
    for route, draws in ((0, 40), (1, 16), (2, 8)):
        assert sum(n for i, n in seen.items() if ROUTES[i] == route) == draws
    repeated = [i for i, n in seen.items() if n > 1]
    assert all(n <= 2 for n in seen.values()) and len(repeated) == 3 + 4 + 3


def test_unsharded_iteration_yields_each_ranks_batch_in_rank_order_as_accelerate_shards_it():
    everything = MoteBucketBatchSampler(ROUTES, 3, 2, rank=None, seed=5)
    for rank in range(2):
        own = list(MoteBucketBatchSampler(ROUTES, 3, 2, rank=rank, seed=5))
        assert list(everything)[rank::2] == own
        # What Trainer's data loader gets on process `rank` after accelerate shards the batch sampler.
        assert list(BatchSamplerShard(everything, num_processes=2, process_index=rank)) == own


def test_batches_are_deterministic_per_seed_and_epoch():
    sampler = MoteBucketBatchSampler(ROUTES, 4, seed=7)
    first = list(sampler)
    assert list(MoteBucketBatchSampler(ROUTES, 4, seed=7)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(MoteBucketBatchSampler(ROUTES, 4, seed=8)) != first


def test_buckets_are_drawn_in_proportion_to_their_unseen_examples():
    # The first step's bucket, over many seeds, follows the bucket sizes 37 : 12 : 5 (not 1 : 1 : 1).
    firsts = Counter(ROUTES[next(iter(MoteBucketBatchSampler(ROUTES, 4, seed=seed)))[0]] for seed in range(600))
    np.testing.assert_allclose([firsts[r] / 600 for r in range(3)], [37 / 54, 12 / 54, 5 / 54], atol=0.05)


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one example"):
        MoteBucketBatchSampler([], 4)
    with pytest.raises(ValueError, match="rank must be in"):
        MoteBucketBatchSampler(ROUTES, 4, num_replicas=2, rank=2)


# ------------------------------------------------------------------------------------------------------- collators


@pytest.fixture(scope="module")
def procedure_videos():
    return ProcedureVideos()


@pytest.fixture(scope="module")
def processor(procedure_videos):
    config = VideoLlmMoteConfig(**TINY_VIDEOLLM_MOTE)
    return make_videollm_mote_processor(config, words=procedure_videos.words)


def test_collator_supervises_the_answer_and_end_of_turn_only(processor, procedure_videos):
    generator = torch.Generator().manual_seed(0)
    examples = [procedure_videos.example("step", "make tea", 0, generator),
                procedure_videos.example("proc", "bake pie", 0, generator)]
    batch = MoteCollator(processor)(examples)
    tokens = processor.tokenizer
    assert batch["task_ids"].tolist() == [processor.expert_names.index("step"), processor.expert_names.index("proc")]
    assert batch["video_num_frames"].tolist() == [4, 4] and batch["pixel_values_videos"].shape == (8, 3, 32, 32)
    for row, example in enumerate(examples):
        supervised = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert supervised == processor.answer_ids([example["answer"]])[0]
        assert supervised[-1] == tokens.eos_token_id
        length = int(batch["attention_mask"][row].sum())
        # The labels are the input ids where supervised: the answer follows the generation prompt directly.
        assert batch["input_ids"][row, length - len(supervised) : length].tolist() == supervised
        prompt = processor(text=processor.render_prompt(example["prompt"]), videos=[example["frames"]])
        assert batch["input_ids"][row, : length - len(supervised)].tolist() == prompt["input_ids"][0]
    shorter = int(batch["attention_mask"].sum(1).argmin())
    assert (batch["input_ids"][shorter][batch["attention_mask"][shorter] == 0] == tokens.pad_token_id).all()


def test_task_ids_collator_carries_routes_through_any_collator():
    collator = TaskIdsCollator(lambda rows: {"x": torch.tensor([row["x"] for row in rows])}, expert_names=["a", "b"])
    batch = collator([{"x": 1, "task": "b"}, {"x": 2, "task_ids": 0}])
    assert batch["task_ids"].tolist() == [1, 0] and batch["x"].tolist() == [1, 2]
    with pytest.raises(ValueError, match="Task 'c' is not an expert"):
        collator([{"x": 1, "task": "c"}])


# ------------------------------------------------------------------------------------------------- the learning test

NUM_VALUES, BOS, SEP = 8, 1, 3


def permutation_task(task: int, shift: int = 3) -> list[int]:
    """Task t maps x to roll(arange(8), shift * t)[x] (spec §9 item 6)."""
    return torch.roll(torch.arange(NUM_VALUES), shift * task).tolist()


def permutation_rows(tasks: dict[int, list[int]], copies: int) -> Dataset:
    """`[BOS, 10 + x, SEP, 20 + task(x)]` for every x and task, `copies` times. The prompt is the same for every
    task: only the route tells the tasks apart."""
    rows = {"input_ids": [], "labels": [], "task_ids": []}
    for route, mapping in tasks.items():
        for x in range(NUM_VALUES):
            rows["input_ids"] += [[BOS, 10 + x, SEP, 20 + mapping[x]]] * copies
            rows["labels"] += [[-100, -100, -100, 20 + mapping[x]]] * copies
            rows["task_ids"] += [route] * copies
    return Dataset.from_dict(rows)


@torch.no_grad()
def accuracy(model, tasks: dict[int, list[int]], routes: dict[int, int] | None = None) -> dict[int, float]:
    """Greedy accuracy of the answer token per task; `routes` maps a task to the route it is run on."""
    model.eval()
    inputs = torch.tensor([[BOS, 10 + x, SEP] for x in range(NUM_VALUES)])
    results = {}
    for task, mapping in tasks.items():
        extra = {} if routes is None else {"task_ids": torch.full((NUM_VALUES,), routes[task])}
        predicted = model(input_ids=inputs, **extra).logits[:, -1].argmax(-1)
        results[task] = (predicted == torch.tensor(mapping) + 20).float().mean().item()
    return results


def logged_route_losses(trainer) -> set[str]:
    """The per-route losses `MoteTrainer` logged beside the loss."""
    return {key for log in trainer.state.log_history for key in log if key.startswith("loss/")}


@pytest.fixture(scope="module")
def dense_and_mote(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA | dict(vocab_size=32, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    LlamaForCausalLM(config).save_pretrained(folder)
    mote, _ = convert_llama_to_mote(folder, experts=["t0", "t1", "t2"], verify=False)
    return LlamaForCausalLM.from_pretrained(folder), mote


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_task_experts_learn_what_one_dense_model_cannot_and_a_new_expert_leaves_them_bit_identical(
    dense_and_mote, tmp_path, precision
):
    """Also with every training forward under bf16 autocast (the Trainer's `--bf16`; `test_mixed_precision`); the
    bit-identity checks compare fp32 forwards, outside autocast, as before."""
    dense, mote = (copy.deepcopy(model) for model in dense_and_mote)  # each precision trains from the same start
    tasks = {t: permutation_task(t) for t in range(3)}
    data = permutation_rows(tasks, copies=16)
    arguments = dict(max_steps=150, per_device_train_batch_size=32, learning_rate=1e-2, weight_decay=0.0,
                     lr_scheduler_type="constant", seed=0, logging_steps=50, bf16=precision == "bf16")
    dense_data = data.remove_columns("task_ids")
    Trainer(model=dense, args=quiet_arguments(tmp_path, **arguments), train_dataset=dense_data).train()
    trainer = MoteTrainer(model=mote, args=quiet_arguments(tmp_path, **arguments), train_dataset=data)
    trainer.train()
    assert trainer.args.ddp_find_unused_parameters is True
    assert logged_route_losses(trainer) == {"loss/t0", "loss/t1", "loss/t2"}

    mote_accuracy, dense_accuracy = accuracy(mote, tasks, routes={0: 0, 1: 1, 2: 2}), accuracy(dense, tasks)
    # Measured: MoTE 1.0 on every task; the dense model, given identical prompts, at most one task's mapping.
    assert min(mote_accuracy.values()) >= 0.95, mote_accuracy
    assert sum(dense_accuracy.values()) / 3 <= 0.45, dense_accuracy

    # Expert addition: a fourth task (roll by 1) on a new expert copied from t0; only the new expert trains.
    probe = torch.tensor([[BOS, 10 + x, SEP] for x in range(NUM_VALUES)])
    before_logits = {r: mote(input_ids=probe, task_ids=torch.full((8,), r)).logits for r in range(3)}
    before_state = {name: tensor.clone() for name, tensor in mote.state_dict().items()}
    route = mote.add_expert("t3", init_from="t0")
    mote.freeze_for_expert_addition("t3")
    new_task = {3: permutation_task(1, shift=1)}
    arguments["weight_decay"] = 0.1  # would move any parameter the optimizer held without a gradient
    MoteTrainer(model=mote, args=quiet_arguments(tmp_path, **arguments),
                train_dataset=permutation_rows(new_task, copies=16).map(lambda row: {"task_ids": route})).train()
    assert accuracy(mote, new_task, routes={3: route})[3] >= 0.95
    with torch.no_grad():
        for r in range(3):
            assert torch.equal(mote(input_ids=probe, task_ids=torch.full((8,), r)).logits, before_logits[r])
    after_state = mote.state_dict()
    for name, tensor in before_state.items():
        assert torch.equal(after_state[name], tensor), name
    new = [name for name in after_state if ".t3." in name]
    assert any(not torch.equal(after_state[n], after_state[n.replace(".t3.", ".t0.")]) for n in new)


def test_unselected_experts_get_no_gradient_and_do_not_move(dense_and_mote, tmp_path):
    _, converted = dense_and_mote
    mote = type(converted)(converted.config)
    mote.load_state_dict(converted.state_dict())
    tasks = {0: permutation_task(0), 1: permutation_task(1)}  # routes 0 and 1 only: t2 is never selected
    before = {n: p.clone() for n, p in mote.named_parameters() if ".t2." in n}
    trainer = MoteTrainer(
        model=mote, train_dataset=permutation_rows(tasks, copies=2),
        args=quiet_arguments(tmp_path, max_steps=4, per_device_train_batch_size=8, learning_rate=1e-2,
                             weight_decay=0.1, logging_steps=1),
    )  # fmt: skip
    trainer.train()
    assert logged_route_losses(trainer) == {"loss/t0", "loss/t1"}
    for name, parameter in mote.named_parameters():
        if ".t2." in name:
            assert parameter.grad is None and torch.equal(parameter, before[name]), name
            assert parameter not in trainer.optimizer.state  # AdamW never saw a gradient for it
    assert any(not torch.equal(p, converted.state_dict()[n]) for n, p in mote.named_parameters() if ".t0." in n)


def test_trl_sft_trainer_trains_a_mote_model_on_prompt_completion_data(dense_and_mote, tmp_path):
    trl = pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    _, converted = dense_and_mote
    model = type(converted)(converted.config)
    model.load_state_dict(converted.state_dict())
    words = [f"w{i}" for i in range(20)]
    tokenizer = build_word_level_tokenizer(32, {0: "<|pad|>", 1: "<s>", 2: "</s>"}, [], words, 64,
                                           bos_token="<s>", eos_token="</s>", pad_token="<|pad|>")
    data = Dataset.from_dict({
        "prompt": [f"w{x} w{x + 1}" for x in range(8)] * 4,
        "completion": [f" w{(x * 3) % 8 + 10}" for x in range(8)] * 4,
        "task": ["t1"] * 32,
    })  # fmt: skip
    before = {n: p.clone() for n, p in model.named_parameters() if ".t0." in n or ".t2." in n}
    trainer = trl.SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=data,
        data_collator=TaskIdsCollator(DataCollatorForLanguageModeling(pad_token_id=0), ["t0", "t1", "t2"]),
        args=trl.SFTConfig(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=8, learning_rate=1e-2,
                           remove_unused_columns=False, report_to="none", save_strategy="no", use_cpu=True,
                           logging_steps=10, disable_tqdm=True),
    )  # fmt: skip
    losses = []
    trainer.add_callback(type("Losses", (trl.trainer.callbacks.TrainerCallback,), {
        "on_log": lambda self, args, state, control, logs=None, **kw: losses.append(logs.get("loss"))})())
    trainer.train()
    losses = [loss for loss in losses if loss is not None]
    assert losses[-1] < losses[0] / 2
    # The route reached the model: only expert t1 (and the shared parts) trained.
    for name, parameter in model.named_parameters():
        if name in before:
            assert torch.equal(parameter, before[name]), name
    assert any(not torch.equal(p, converted.state_dict()[n]) for n, p in model.named_parameters() if ".t1." in n)


# ------------------------------------------------------------------------------------------ moezoo train mote


@pytest.fixture(scope="module")
def videollm_folder(tmp_path_factory, procedure_videos):
    """A tiny VideoLLM-MoTE (step, next, task) converted from a random tiny Llama and SigLIP, with its processor."""
    root = tmp_path_factory.mktemp("videollm")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(root / "llama")
    SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP_VISION)).save_pretrained(root / "siglip")
    model, _ = convert_llama_to_mote(root / "llama", vision=root / "siglip", experts=["step", "next", "task"],
                                     video_token="<v>", video_token_id=120, frame_token_interval_id=11, verify=False)
    model.save_pretrained(root / "mote")
    make_videollm_mote_processor(model.config, words=procedure_videos.words).save_pretrained(root / "mote")
    return root / "mote"


def test_train_mote_joint_then_add_an_expert_leaving_the_other_routes_bit_identical(
    videollm_folder, procedure_videos, tmp_path
):
    data = procedure_videos.dataset({"step": 12, "next": 8, "task": 6, "proc": 8}, torch.Generator().manual_seed(0))
    options = MoteTrainingOptions(steps=3, batch_size=4, learning_rate=1e-3, logging_steps=1,
                                  tasks=("step", "next", "task"))
    summary = train_mote(videollm_folder, data, tmp_path / "joint", options)
    assert summary["examples_per_task"] == {"next": 8, "step": 12, "task": 6}
    assert (tmp_path / "joint" / "training_curves.png").is_file()
    provenance = json.loads((tmp_path / "joint" / "moezoo.json").read_text())
    assert provenance["training"]["steps"] == 3
    base = VideoLlmMoteForConditionalGeneration.from_pretrained(videollm_folder).state_dict()
    joint = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "joint").state_dict()
    assert all(torch.equal(joint[n], base[n]) for n in base if n.startswith("model.vision_tower."))  # frozen
    assert not torch.equal(joint["model.multi_modal_projector.linear_1.weight"],
                           base["model.multi_modal_projector.linear_1.weight"])

    # `moezoo train mote` with the command's own options: add `proc`, copied from `next`, and train it alone.
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    rows = tmp_path / "data"  # the command reads files: the examples as JSON Lines with PNG frames
    rows.mkdir()
    with open(rows / "train.jsonl", "w") as file:
        for index, example in enumerate(data):
            paths = []
            for number, frame in enumerate(example["frames"]):
                paths.append(f"{index}_{number}.png")
                frame.save(rows / paths[-1])
            row = {key: example[key] for key in ("task", "prompt", "answer")} | {"frames": paths}
            file.write(json.dumps(row) + "\n")
    args = parser.parse_args([
        "--model", str(tmp_path / "joint"), "--data", str(rows / "train.jsonl"), "--out", str(tmp_path / "added"),
        "--steps", "3", "--batch-size", "4", "--lr", "1e-2", "--weight-decay", "0.1", "--add-expert", "proc",
        "--init-from", "next", "--description", "forecast the sequence of upcoming steps",
    ])  # fmt: skip
    assert run_train(args) == 0
    added_model = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "added")
    added = added_model.state_dict()
    assert added_model.config.text_config.mote_expert_names == ["step", "next", "task", "proc"]
    assert VideoLlmMoteProcessor.from_pretrained(tmp_path / "added").expert_names == ["step", "next", "task", "proc"]
    for name, tensor in joint.items():
        assert torch.equal(added[name], tensor), name
    new = [n for n in added if ".experts.proc." in n]
    assert new and any(not torch.equal(added[n], added[n.replace(".proc.", ".next.")]) for n in new)
    summary = json.loads((tmp_path / "added" / "moezoo.json").read_text())["training"]
    assert summary["examples_per_task"] == {"proc": 8}


def test_joint_training_with_lora_trains_attention_adapters_experts_and_projector(videollm_folder, procedure_videos,
                                                                                  tmp_path):
    data = procedure_videos.dataset({"step": 8}, torch.Generator().manual_seed(0))
    options = MoteTrainingOptions(steps=2, batch_size=4, learning_rate=1e-2, lora_r=4)
    summary = train_mote(videollm_folder, data, tmp_path / "lora", options)
    base = VideoLlmMoteForConditionalGeneration.from_pretrained(videollm_folder).state_dict()
    trained = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "lora").state_dict()
    assert set(trained) == set(base)  # merged: no adapter weights left
    changed = {n for n in base if not torch.equal(trained[n], base[n])}
    assert any(".self_attn.q_proj." in n for n in changed)  # through the merged adapters
    assert any(".experts.step." in n for n in changed) and any("multi_modal_projector" in n for n in changed)
    allowed = ("self_attn.", "mlp.experts.step.", "mlp.shared_expert.", "multi_modal_projector.")
    assert all(any(part in n for part in allowed) for n in changed), sorted(changed)
    assert summary["lora_r"] == 4


def test_train_mote_takes_live_streams_beside_offline_examples(videollm_folder, procedure_videos, tmp_path):
    offline = list(procedure_videos.dataset({"step": 4}, torch.Generator().manual_seed(0)))
    streams = [
        {"task": "step", "prompt": "narrate", "frames": example["frames"], "answer": None,
         "responses": [{"frame": 0, "text": example["answer"]}]}
        for example in offline
    ]  # fmt: skip
    data = Dataset.from_list([example | {"responses": None} for example in offline] + streams)
    options = MoteTrainingOptions(steps=2, batch_size=8, learning_rate=1e-2, logging_steps=1)
    summary = train_mote(videollm_folder, data, tmp_path / "out", options)
    assert summary["examples_per_task"] == {"step": 8}
    base = VideoLlmMoteForConditionalGeneration.from_pretrained(videollm_folder).state_dict()
    trained = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    assert not torch.equal(trained["model.multi_modal_projector.linear_1.weight"],
                           base["model.multi_modal_projector.linear_1.weight"])  # fmt: skip


def test_an_expert_added_from_dense_starts_as_the_base_models_ffn(videollm_folder, procedure_videos, tmp_path):
    data = procedure_videos.dataset({"proc": 4}, torch.Generator().manual_seed(0))
    options = MoteTrainingOptions(steps=1, batch_size=4, learning_rate=0.0, add_expert="proc", init_from="dense")
    train_mote(videollm_folder, data, tmp_path / "added", options)  # the base: the model's mote_base_model
    added = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "added").state_dict()
    llama = LlamaForCausalLM.from_pretrained(videollm_folder.parent / "llama").state_dict()
    for layer in range(TINY_LLAMA["num_hidden_layers"]):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(added[f"model.language_model.layers.{layer}.mlp.experts.proc.{projection}.weight"],
                               llama[f"model.layers.{layer}.mlp.{projection}.weight"])  # fmt: skip
    model = VideoLlmMoteForConditionalGeneration.from_pretrained(videollm_folder)
    model.config.text_config.mote_base_model = None
    with pytest.raises(ValueError, match="records none .mote_base_model.: give its folder or Hub id"):
        load_dense_base(model)


def test_the_dense_baseline_converts_exactly_and_trains_with_the_same_command(videollm_folder, procedure_videos,
                                                                            tmp_path):
    root = videollm_folder.parent
    dense, report = convert_llama_to_mote(root / "llama", vision=root / "siglip", dense=True, video_token="<v>",
                                          video_token_id=120, frame_token_interval_id=11)  # fmt: skip
    assert report["max_abs_diff_by_route"] == {"dense": 0.0, "vision_tower": 0.0}
    assert dense.config.text_config.mote_expert_names == [] and not any(".experts." in n for n in dense.state_dict())
    dense.save_pretrained(tmp_path / "dense")
    make_videollm_mote_processor(dense.config, words=procedure_videos.words).save_pretrained(tmp_path / "dense")
    data = procedure_videos.dataset({"step": 4, "next": 4}, torch.Generator().manual_seed(0))
    options = MoteTrainingOptions(steps=2, batch_size=4, learning_rate=1e-2, logging_steps=1)
    train_mote(tmp_path / "dense", data, tmp_path / "trained", options)  # every task takes the one dense path
    trained = VideoLlmMoteForConditionalGeneration.from_pretrained(tmp_path / "trained").state_dict()
    ffn = "model.language_model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(trained[ffn], dense.state_dict()[ffn])


def test_train_mote_rejects_data_without_the_tasks_it_needs(videollm_folder, procedure_videos, tmp_path):
    data = procedure_videos.dataset({"step": 4}, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"no example of the tasks \['proc'\]"):
        train_mote(videollm_folder, data, tmp_path / "x", MoteTrainingOptions(steps=1, add_expert="proc"))
    with pytest.raises(ValueError, match="needs columns task, prompt, answer"):
        train_mote(videollm_folder, data.remove_columns("answer"), tmp_path / "y", MoteTrainingOptions(steps=1))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.fixture(scope="module")
def glm_ocr_mote(tmp_path_factory):
    """GLM-OCR-MoTE's starting point (spec §7.4): a tiny GLM-OCR converted with ocr (the default route) and kie, its
    processor, and four receipt examples for kie."""
    root = tmp_path_factory.mktemp("glm_ocr_mote")
    torch.manual_seed(0)
    base = GlmOcrForConditionalGeneration(GlmOcrConfig(**TINY_GLM_OCR)).eval()
    base.save_pretrained(root / "glm")
    model, _ = convert_glm_ocr_to_mote(root / "glm", verify=False)
    model.save_pretrained(root / "mote")
    make_glm_ocr_mote_processor(model.config, words=("shop", "total", "7")).save_pretrained(root / "mote")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8)) for _ in range(4)]
    receipts = Dataset.from_dict({
        "task": ["kie"] * 4, "prompt": [kie_prompt()] * 4, "image": images,
        "answer": ['{"company": "shop", "total": "7"}'] * 4,
    })  # fmt: skip
    return base, root / "mote", receipts


def test_receipt_images_batch_and_a_second_kie_expert_trains_alone(glm_ocr_mote, tmp_path):
    _, folder, data = glm_ocr_mote
    batch = MoteCollator(GlmOcrMoteProcessor.from_pretrained(folder))([data[0], data[1]])
    # 24 x 16 is below GLM-OCR's 8 merged tokens: resized up to 32 x 24, an 8 x 6 patch grid, 12 image tokens.
    assert batch["image_grid_thw"].tolist() == [[1, 8, 6]] * 2 and batch["pixel_values"].shape == (96, 96)
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert batch["mm_token_type_ids"].sum().item() == 2 * 12 and batch["task_ids"].tolist() == [1, 1]

    options = MoteTrainingOptions(steps=2, batch_size=2, learning_rate=1e-2, weight_decay=0.1, add_expert="kie_v2",
                                  init_from="kie")
    with pytest.raises(ValueError, match=r"no example of the tasks \['kie_v2'\]"):
        train_mote(folder, data, tmp_path / "unused", options)
    train_mote(folder, data.map(lambda row: {"task": "kie_v2"}), tmp_path / "trained", options)
    before = GlmOcrMoteForConditionalGeneration.from_pretrained(folder).state_dict()
    after = GlmOcrMoteForConditionalGeneration.from_pretrained(tmp_path / "trained")
    assert after.config.text_config.mote_expert_names == ["ocr", "kie", "kie_v2"]
    assert all(torch.equal(after.state_dict()[name], tensor) for name, tensor in before.items())
    assert any(not torch.equal(tensor, before[name.replace("kie_v2", "kie")])
               for name, tensor in after.state_dict().items() if ".kie_v2." in name)


def test_training_only_the_kie_expert_keeps_the_ocr_route_glm_ocr_bit_for_bit(glm_ocr_mote, tmp_path):
    # GLM-OCR-MoTE's recipe (spec §7.1, §7.4, A18): train only experts.kie; the shared expert stays frozen.
    base, folder, receipts = glm_ocr_mote
    with open(tmp_path / "receipts.jsonl", "w") as file:  # `moezoo train mote` reads files
        for index, example in enumerate(receipts):
            example["image"].save(tmp_path / f"{index}.png")
            file.write(json.dumps({key: example[key] for key in ("task", "prompt", "answer")}
                                  | {"image": f"{index}.png"}) + "\n")
        # An OCR example beside them, which training kie alone leaves out.
        ocr = {"task": "ocr", "prompt": "Text Recognition:", "answer": "shop", "image": "0.png"}
        file.write(json.dumps(ocr) + "\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args([
        "--model", str(folder), "--data", str(tmp_path / "receipts.jsonl"), "--out", str(tmp_path / "trained"),
        "--steps", "2", "--batch-size", "2", "--lr", "1e-2", "--weight-decay", "0.1", "--train-experts", "kie",
    ])  # fmt: skip
    assert run_train(args) == 0
    before = GlmOcrMoteForConditionalGeneration.from_pretrained(folder).state_dict()
    trained = GlmOcrMoteForConditionalGeneration.from_pretrained(tmp_path / "trained").eval()
    changed = {name for name, tensor in trained.state_dict().items() if not torch.equal(tensor, before[name])}
    assert changed and all(".mlp.experts.kie." in name for name in changed), sorted(changed)
    inputs = synthetic_inputs(trained.config)
    with torch.no_grad():
        assert torch.equal(trained(**inputs).logits, base(**inputs).logits)  # the default route: ocr
    summary = json.loads((tmp_path / "trained" / "moezoo.json").read_text())["training"]
    assert summary["examples_per_task"] == {"kie": 4}
    with pytest.raises(ValueError, match="no expert named 'kei'"):
        train_mote(folder, receipts, tmp_path / "x", MoteTrainingOptions(steps=1, train_experts=("kei",)))
    with pytest.raises(ValueError, match="does not combine with add_expert or lora_r"):
        train_mote(folder, receipts, tmp_path / "y", MoteTrainingOptions(steps=1, train_experts=("kie",), lora_r=4))
    with pytest.raises(ValueError, match="add_expert trains the new expert 'kie_v2' alone.* drop lora_r"):
        train_mote(folder, receipts, tmp_path / "z", MoteTrainingOptions(steps=1, add_expert="kie_v2", lora_r=4))


# --------------------------------------------------------------------------------------- synthetic procedure videos


def test_each_clip_determines_its_procedure_and_the_answers_follow_the_a5_formats(procedure_videos):
    pairs = Counter((steps[i], steps[i + 1]) for steps in PROCEDURES.values() for i in range(len(steps) - 1))
    assert max(pairs.values()) == 1  # two consecutive steps never appear in two procedures
    generator = torch.Generator().manual_seed(0)
    example = procedure_videos.example("proc_plus", "make tea", 0, generator)
    assert example["prompt"] == task_prompt("proc_plus", num_steps=2, goal="Make tea")
    assert example["answer"] == "1. Stir.\n2. Serve."
    assert len(example["frames"]) == 4 and example["frames"][0].size == (32, 32)
    assert procedure_videos.example("next", "make soup", 1, generator)["answer"] == "Serve."
    assert procedure_videos.example("task", "bake pie", 2, generator)["answer"] == "Bake pie."
    assert procedure_videos.example("proc", "bake bread", 1, generator)["prompt"] == task_prompt("next")
    # Forecasting needs a step after the clip: two windows per procedure, three for the others.
    assert len(procedure_videos.windows("next")) == 8 and len(procedure_videos.windows("step")) == 12


def test_procedure_video_sets_are_deterministic_with_the_requested_task_counts(procedure_videos):
    first = procedure_videos.dataset({"step": 5, "task": 3}, torch.Generator().manual_seed(4))
    again = procedure_videos.dataset({"step": 5, "task": 3}, torch.Generator().manual_seed(4))
    assert Counter(first["task"]) == {"step": 5, "task": 3}
    assert first["answer"] == again["answer"]
    assert np.array_equal(np.asarray(first[0]["frames"][1]), np.asarray(again[0]["frames"][1]))
    # The frames of a step show its own colour: the step's shape is the frame's most saturated region.
    frame = np.asarray(procedure_videos.step_frames("cut", torch.Generator().manual_seed(0))[0], dtype=int)
    red = (frame[..., 0] > 200) & (frame[..., 1] < 80)
    assert red.sum() > 50


# ------------------------------------------------------------------------------------------------ moezoo bench mote


def test_bench_active_compute_stays_flat_as_experts_are_stored(capsys):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--size", "tiny", "--experts", "1", "4", "16", "--tokens", "16", "--seconds", "0.05",
                              "--threads", "1", "--json"])
    assert run_bench(args) == 0
    rows = json.loads(capsys.readouterr().out)
    dense, *mote = rows
    assert dense["model"] == "dense" and [row["experts"] for row in mote] == [1, 4, 16]
    ffn = 2 * 3 * 64 * 128  # one FFN per layer: gate, up and down of 64 x 128, two layers
    for row in mote:
        assert row["total_parameters"] == dense["total_parameters"] + row["experts"] * ffn  # + shared, - dense FFN
        assert row["active_parameters"] == dense["total_parameters"] + ffn  # the shared expert and one routed expert
        assert row["gflops"] == mote[0]["gflops"] > dense["gflops"]
        assert row["ms"] > 0 and row["latency_vs_dense"] == pytest.approx(row["ms"] / dense["ms"])
