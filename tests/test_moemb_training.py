"""MoEMB training: InfoNCE against its formula and across two gloo processes, GradCache, the LoRA recipe of spec §7.2
(router frozen, expert adapters train, merge exact), the train command, and a learning test (spec §10 items 9-12)."""

import argparse
import json
import textwrap

import pytest
import torch
from datasets import Dataset
from torch.nn import functional as F
from transformers import TrainingArguments

from conftest import run_two_processes
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.evaluation.moemb import embed
from moezoo.modeling.moe.router import TopKRouter
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.moemb import MoEmbProcessor, mmeb_input
from moezoo.training.moemb import (
    LoraOptions,
    MoEmbCollator,
    MoEmbTrainer,
    MoEmbTrainingOptions,
    add_train_arguments,
    apply_lora,
    cached_contrastive_backward,
    count_trainable,
    embed_chunks,
    info_nce_loss,
    load_mmeb_dataset,
    merge_lora,
    run_train,
    train_moemb,
)
from moezoo.training.moemb_synthetic import IMAGE_TO_TEXT, ShapeRetrieval

CONFIG = MoEmbConfig(**TINY_MOEMB)
EMB = TINY_MOEMB["emb_token_id"]


def shapes_examples(count, seed=0):
    return load_mmeb_dataset(ShapeRetrieval().training_dataset(count, torch.Generator().manual_seed(seed)))


# --- loss ------------------------------------------------------------------------------------------------------------


def reference_info_nce(queries, targets, scale, negatives=None, mask=None):
    """Spec §2.3, written out: -1/N sum_i log(exp(S_ii) / sum_j exp(S_ij)) over the targets then the negatives."""
    scores = scale * queries @ targets.t()
    if negatives is not None:
        scores = torch.cat([scores, scale * queries @ negatives.t()], dim=1)
    exp = scores.exp()
    if mask is not None:
        exp = exp * torch.cat([~mask, torch.ones(len(queries), exp.shape[1] - mask.shape[1], dtype=torch.bool)], 1)
    return -(exp.diagonal() / exp.sum(1)).log().mean()


def test_info_nce_equals_its_formula():
    generator = torch.Generator().manual_seed(0)
    queries, targets, negatives = (F.normalize(torch.randn(6, 8, generator=generator), dim=-1) for _ in range(3))
    torch.testing.assert_close(info_nce_loss(queries, targets, 2.0), reference_info_nce(queries, targets, 2.0))
    torch.testing.assert_close(
        info_nce_loss(queries, targets, 2.0, negatives), reference_info_nce(queries, targets, 2.0, negatives)
    )
    # Targets 1 and 4 are the same: each is masked out of the other's row.
    keys = torch.tensor([0, 1, 2, 3, 1, 5])
    mask = (keys[:, None] == keys[None, :]) & ~torch.eye(6, dtype=torch.bool)
    torch.testing.assert_close(
        info_nce_loss(queries, targets, 2.0, negatives, target_keys=keys),
        reference_info_nce(queries, targets, 2.0, negatives, mask),
    )
    # Matching orthogonal pairs at the paper's scale 50: nothing left to learn.
    basis = torch.eye(6, 8)
    assert info_nce_loss(basis, basis, 50.0) < 1e-20


def test_info_nce_over_two_gloo_processes_equals_one_process(tmp_path):
    """Each process holds half the batch; the gathered loss and gradients (averaged as DDP does) equal the
    single-process ones on the whole batch, with negatives and duplicate masking."""
    generator = torch.Generator().manual_seed(0)
    batch = {name: F.normalize(torch.randn(8, 16, generator=generator), dim=-1) for name in ("q", "t", "n")}
    keys = torch.tensor([0, 1, 2, 3, 4, 1, 6, 7])  # targets 1 and 5 are the same, on different processes
    torch.save(batch | {"keys": keys}, tmp_path / "batch.pt")
    script = tmp_path / "gather.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from moezoo.training.moemb import info_nce_loss
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        batch = torch.load(sys.argv[1] + "/batch.pt")
        local = {name: batch[name][4 * rank : 4 * rank + 4].clone().requires_grad_() for name in ("q", "t", "n")}
        loss = info_nce_loss(local["q"], local["t"], 50.0, local["n"], batch["keys"][4 * rank : 4 * rank + 4])
        loss.backward()
        gradients = {name: tensor.grad for name, tensor in local.items()}
        torch.save({"loss": loss.detach(), **gradients}, sys.argv[1] + f"/rank{rank}.pt")
        dist.destroy_process_group()
    """))
    run_two_processes(script, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    whole = {name: tensor.clone().requires_grad_() for name, tensor in batch.items()}
    loss = info_nce_loss(whole["q"], whole["t"], 50.0, whole["n"], keys)
    loss.backward()
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss.detach())
    for name in ("q", "t", "n"):
        # DDP averages the two processes' gradients: half of what each computed for its own slice.
        gathered = torch.cat([ranks[0][name], ranks[1][name]]) / 2
        torch.testing.assert_close(gathered, whole[name].grad)


def test_hard_negatives_reach_the_loss(tiny_moemb):
    """MMEB rows with neg_text give every query a negative: the trainer's loss is InfoNCE over targets then
    negatives, on the model's embeddings."""
    rows = Dataset.from_dict({
        "qry": ["a red circle", "a blue square", "a green cross"], "qry_image_path": ["", "", ""],
        "pos_text": ["red", "blue", "green"], "pos_image_path": ["", "", ""],
        "neg_text": ["a red square", "a blue circle", "a green circle"], "neg_image_path": ["", "", ""],
    })  # fmt: skip
    examples = load_mmeb_dataset(rows, negatives=True)
    assert examples[0]["negative"] == {"text": "a red square"}
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb).eval()
    inputs = MoEmbCollator(MoEmbProcessor.from_pretrained(tiny_moemb))([examples[i] for i in range(3)])
    args = TrainingArguments(output_dir=str(tiny_moemb.parent / "negatives"), report_to="none", use_cpu=True)
    trainer = MoEmbTrainer(model=model, args=args, logit_scale=50.0)
    with torch.no_grad():
        loss = trainer.compute_loss(model, inputs)
        embeddings = {side: model(**inputs[side][0]).embeddings for side in ("query", "target", "negative")}
    torch.testing.assert_close(loss, reference_info_nce(embeddings["query"], embeddings["target"], 50.0,
                                                        embeddings["negative"]))  # fmt: skip


def test_evaluation_reports_the_training_loss_on_validation_batches(tiny_moemb):
    """`eval_strategy="steps"` logs `eval_loss` during training, and `evaluate()` gives the InfoNCE loss that
    `compute_loss` gives on the same batch with the model in eval mode (LoRA dropout off)."""
    model = apply_lora(MoEmbForEmbedding.from_pretrained(tiny_moemb), LoraOptions(rank=2, alpha=4, dropout=0.5))
    collator = MoEmbCollator(MoEmbProcessor.from_pretrained(tiny_moemb))
    examples = shapes_examples(4)
    args = TrainingArguments(output_dir=str(tiny_moemb.parent / "evaluate"), max_steps=2, eval_strategy="steps",
                             eval_steps=1, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             report_to="none", save_strategy="no", use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True)  # fmt: skip
    trainer = MoEmbTrainer(model=model, args=args, train_dataset=examples, eval_dataset=examples,
                           data_collator=collator, logit_scale=50.0)  # fmt: skip
    trainer.train()
    assert len([log for log in trainer.state.log_history if "eval_loss" in log]) == 2
    eval_loss = trainer.evaluate()["eval_loss"]
    with torch.no_grad():
        expected = trainer.compute_loss(model.eval(), collator([examples[i] for i in range(4)]))
    assert eval_loss == pytest.approx(expected.item(), rel=1e-5)


def test_a_row_without_its_hard_negative_is_named():
    rows = Dataset.from_dict({
        "qry": ["a red circle", "a blue square"], "qry_image_path": ["", ""], "pos_text": ["red", "blue"],
        "pos_image_path": ["", ""], "neg_text": ["a red square", ""], "neg_image_path": ["", ""],
    })  # fmt: skip
    examples = load_mmeb_dataset(rows, negatives=True)
    assert examples[0] == {"task": "train", "query": {"text": "a red circle"}, "target": {"text": "red"},
                           "negative": {"text": "a red square"}}  # fmt: skip
    with pytest.raises(ValueError, match=r"data row 1 .*task 'train' has no negative: its neg_text and neg_image_path"):
        examples[1]


# --- GradCache -------------------------------------------------------------------------------------------------------


def test_gradcache_gives_the_gradients_of_the_whole_batch(tiny_moemb):
    """Chunks of 2 embedded without gradients, then again with them, replaying dropout: the same loss and parameter
    gradients as embedding the chunks with gradients and back-propagating the loss at once."""
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb)
    peft_model = apply_lora(model, LoraOptions(rank=4, alpha=8, dropout=0.2)).train()
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # non-zero adapters, so that LoRA's dropout changes the outputs
            torch.nn.init.normal_(parameter, std=0.1)
    processor = MoEmbProcessor.from_pretrained(tiny_moemb)
    examples = [shapes_examples(5)[i] for i in range(5)]
    inputs = MoEmbCollator(processor, chunk_size=2)(examples)
    assert [len(inputs[side]) for side in ("query", "target")] == [3, 3]

    def loss_fn(embeddings):
        return info_nce_loss(embeddings["query"], embeddings["target"], 50.0)

    def gradients():
        return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad and p.grad is not None}

    torch.manual_seed(7)
    cached_loss = cached_contrastive_backward(peft_model, inputs, loss_fn)
    cached = gradients()
    peft_model.zero_grad()
    torch.manual_seed(7)
    loss = loss_fn({side: embed_chunks(peft_model, inputs[side]) for side in ("query", "target")})
    loss.backward()
    direct = gradients()
    torch.testing.assert_close(cached_loss, loss.detach())
    assert cached.keys() == direct.keys() and len(direct) > 10
    for name in direct:
        torch.testing.assert_close(cached[name], direct[name], atol=1e-6, rtol=1e-4, msg=name)


# --- LoRA ------------------------------------------------------------------------------------------------------------


def expected_lora_parameters(rank: int, expert_groups: int) -> int:
    """r * (in + out) per adapted matrix (spec §7.2), plus the <emb> row."""
    text, vision = CONFIG.text_config, CONFIG.vision_config
    d, heads, kv, head_dim = text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim
    attention = (d + 2 * heads * head_dim) + 2 * (d + kv * head_dim) + (heads * head_dim + d)  # q (and gate), k, v, o
    shared = 3 * (d + text.shared_expert_intermediate_size)
    experts = expert_groups * ((d + 2 * text.moe_intermediate_size) + (text.moe_intermediate_size + d))
    full_attention_layers = text.layer_types.count("full_attention")
    h, i, merged = vision.hidden_size, vision.intermediate_size, vision.hidden_size * vision.spatial_merge_size**2
    vision_block = (h + 3 * h) + 2 * h + 2 * (h + i)
    merger = 2 * merged + (merged + vision.out_hidden_size)
    linear = full_attention_layers * attention + text.num_hidden_layers * (shared + experts)
    return rank * (linear + vision.depth * vision_block + merger) + d


@pytest.mark.parametrize(("experts", "groups"), [("shared", 1), ("grouped", 2), ("per-expert", 8)])
def test_lora_count_matches_the_formula(experts, groups):
    torch.manual_seed(0)
    model = apply_lora(MoEmbForEmbedding(CONFIG), LoraOptions(rank=4, alpha=8, experts=experts, expert_groups=groups))
    assert count_trainable(model) == expected_lora_parameters(4, groups)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in name or "trainable_tokens" in name for name in trainable), trainable
    assert not any(".mlp.gate." in name for name in trainable)


def test_lora_wiring_router_frozen_experts_train_and_merge_is_exact(tiny_moemb):
    model = MoEmbForEmbedding.from_pretrained(tiny_moemb)
    processor = MoEmbProcessor.from_pretrained(tiny_moemb)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = processor(["a red circle", {"instruction": "Find it.", "images": [ShapeRetrieval().shapes.draw(
        3, torch.Generator().manual_seed(0))]}])  # fmt: skip
    reference = model(**batch).embeddings.detach()
    peft_model = apply_lora(model, LoraOptions(rank=4, alpha=8, dropout=0.0))
    torch.testing.assert_close(peft_model(**batch).embeddings, reference)  # adapters start as the identity

    args = TrainingArguments(output_dir=str(tiny_moemb.parent / "run"), max_steps=3, per_device_train_batch_size=6,
                             learning_rate=5e-2, report_to="none", save_strategy="no", use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True)  # fmt: skip
    MoEmbTrainer(model=peft_model, args=args, train_dataset=shapes_examples(12),
                 data_collator=MoEmbCollator(processor), logit_scale=50.0).train()  # fmt: skip
    adapted = peft_model.eval()(**batch).embeddings.detach()
    assert not torch.allclose(adapted, reference, atol=1e-4)
    expert_adapters = [
        p for n, p in peft_model.named_parameters() if ".experts.parametrizations." in n and "lora_B" in n
    ]
    assert expert_adapters and all(p.abs().sum() > 0 for p in expert_adapters)

    merged = merge_lora(peft_model)
    torch.testing.assert_close(merged(**batch).embeddings, adapted, atol=1e-5, rtol=1e-4)
    after = dict(merged.named_parameters())
    assert after.keys() == before.keys()  # plain weights again: no adapter left behind
    for name, original in before.items():
        if ".mlp.gate." in name or "norm" in name or "shared_expert_gate" in name:
            assert torch.equal(after[name], original), name  # frozen
    assert not torch.equal(after["model.language_model.layers.0.mlp.experts.gate_up_proj"],
                           before["model.language_model.layers.0.mlp.experts.gate_up_proj"])  # fmt: skip
    embeddings = "model.language_model.embed_tokens.weight"
    changed = (after[embeddings] != before[embeddings]).any(-1).nonzero().flatten().tolist()
    assert changed == [EMB]  # only the <emb> row of the embeddings trains


def test_train_router_option_makes_only_the_routers_trainable_too():
    model = apply_lora(MoEmbForEmbedding(CONFIG), LoraOptions(rank=2, alpha=4, train_router=True))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(p.requires_grad for router in routers for p in router.parameters())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "shared_expert_gate" in n)


# --- the command -----------------------------------------------------------------------------------------------------


def test_train_command_on_mmeb_files(tiny_moemb, tmp_path):
    data = ShapeRetrieval().write_mmeb_training(tmp_path / "mmeb", 16, torch.Generator().manual_seed(3))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args([
        "--model", str(tiny_moemb), "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "2",
        "--batch-size", "4", "--chunk-size", "2", "--lora-r", "2", "--lora-alpha", "4", "--expert-lora", "grouped",
        "--expert-lora-groups", "4", "--mask-duplicate-targets", "--logging-steps", "1", "--eval-data", str(data),
    ])  # fmt: skip
    assert run_train(args) == 0
    out = tmp_path / "out"
    for name in ("model.safetensors", "processor_config.json", "training_curves.png", "routing_heatmap.png"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["steps"] == 2 and training["gradcache_chunk_size"] == 2 and "4 groups" in training["lora"]
    assert training["eval_loss"] > 0
    model = MoEmbForEmbedding.from_pretrained(out)
    assert not any("lora" in name for name in model.state_dict())
    assert embed(model, MoEmbProcessor.from_pretrained(out), ["a red circle"], progress=False).shape == (1, 64)


def test_training_data_errors(tiny_moemb, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"query": "a", "positive": "b"}) + "\n")
    with pytest.raises(ValueError, match="has no column 'qry'"):
        load_mmeb_dataset(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="fewer than one batch"):
        train_moemb(tiny_moemb, ShapeRetrieval().training_dataset(4, torch.Generator()), tmp_path / "out",
                    MoEmbTrainingOptions(batch_size=8))  # fmt: skip
    assert not (tmp_path / "out").exists()


# --- learning --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_moemb_learns_synthetic_retrieval(tiny_moemb, tmp_path):
    """LoRA for 200 steps on image -> caption pairs of 16 colour-shape classes: the logged loss falls by more than
    half and image -> caption recall@1 on fresh images rises far above chance, 1/16 (spec §10 item 12); the frozen
    routers leave training unchanged."""
    data = ShapeRetrieval()
    options = MoEmbTrainingOptions(
        steps=200, batch_size=16, learning_rate=3e-3, warmup_steps=10, logging_steps=10, mask_duplicate_targets=True,
        lora=LoraOptions(rank=8, alpha=16, dropout=0.0),
    )  # fmt: skip
    training_set = data.training_dataset(3200, torch.Generator().manual_seed(0), directions=("image_to_text",))
    training = train_moemb(tiny_moemb, training_set, tmp_path / "trained", options)
    assert training["final_loss"] < 0.5 * training["initial_loss"], training
    before, after = recall_at_1(tiny_moemb, data), recall_at_1(tmp_path / "trained", data)
    assert after >= 4 / data.num_classes and after > 2 * before, (before, after)
    assert changed_routers(tiny_moemb, tmp_path / "trained") == []


def test_trained_routers_are_saved_with_the_merged_model(tiny_moemb, tmp_path):
    data = ShapeRetrieval()
    options = MoEmbTrainingOptions(steps=2, batch_size=8, learning_rate=1e-2, warmup_steps=0, logging_steps=1,
                                   lora=LoraOptions(rank=2, alpha=4, train_router=True))  # fmt: skip
    train_moemb(tiny_moemb, data.training_dataset(16, torch.Generator().manual_seed(0)), tmp_path / "trained", options)
    base = MoEmbForEmbedding.from_pretrained(tiny_moemb).state_dict()
    assert changed_routers(tiny_moemb, tmp_path / "trained") == [name for name in base if ".mlp.gate." in name]


def changed_routers(base_folder, trained_folder) -> list[str]:
    base, trained = (MoEmbForEmbedding.from_pretrained(f).state_dict() for f in (base_folder, trained_folder))
    return [name for name in base if ".mlp.gate." in name and not torch.equal(base[name], trained[name])]


def recall_at_1(folder, data: ShapeRetrieval, images_per_class: int = 3) -> float:
    """Image -> caption recall@1 of fresh images, `images_per_class` of each class, against the 16 captions."""
    model, processor = MoEmbForEmbedding.from_pretrained(folder), MoEmbProcessor.from_pretrained(folder)
    generator = torch.Generator().manual_seed(123)
    labels = torch.arange(data.num_classes).repeat(images_per_class)
    queries = [mmeb_input(IMAGE_TO_TEXT, data.shapes.draw(label, generator)) for label in labels.tolist()]
    captions = [data.shapes.caption(label) for label in range(data.num_classes)]
    scores = embed(model, processor, queries, progress=False) @ embed(model, processor, captions, progress=False).t()
    return (scores.argmax(-1) == labels).float().mean().item()
