"""GRPO over MoEMB's efficiency gates (spec moemb.md §3.13, §10 D-24): the group advantages against TRL's arithmetic,
the reward's terms on hand-made embeddings, the replay (log-probs equal to the sampling-time ones, only the heads
get gradients), the pooled token never dropped, per-sample independence, a learning test on a synthetic task with
redundant tokens, the command with its curves, the saved model loaded here and exported without moezoo, and bad
options."""

import argparse
import copy
import json
import math

import pytest
import torch
from torch.nn import functional as F

from conftest import exported_moemb_outputs
from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.hub.export import export_folder
from moezoo.modeling.moemb import MoEmbForEmbedding, controlled_gates
from moezoo.modeling.moemb_adaptive.gates import DROP, EfficiencyHead, GateControl, SharedDraws
from moezoo.training.moemb_grpo import (
    GatePolicyGRPOTrainer,
    GrpoOptions,
    grpo_config,
    group_advantages,
    in_batch_accuracy,
    mean_log_prob,
    policy_settings,
    prepare_policy_model,
    replay,
    replayed_log_prob,
    retrieval_rewards,
    sample_rollouts,
)
from moezoo.processors.moemb import MoEmbProcessor
from moezoo.training.moemb import add_train_arguments, run_train
from moezoo.training.moemb_grpo_synthetic import RedundantTokenRetrieval, collate_pairs
from moezoo.training.moemb_synthetic import ShapeRetrieval

EMB = TINY_MOEMB["emb_token_id"]
TASK = RedundantTokenRetrieval(emb_token_id=EMB, num_classes=32, num_fillers=10)


# --- advantages and rewards ----------------------------------------------------------------------------------------


def test_group_advantages_are_trls_arithmetic():
    rewards = torch.tensor([[1.0, 2.0, 4.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 0.0, 2.0]])
    advantages, std = group_advantages(rewards, "group")
    # TRL: (r - mean of the prompt's completions) / (unbiased std of them + 1e-4)
    expected_std = rewards.std(dim=1, keepdim=True).expand_as(rewards)
    torch.testing.assert_close(std, expected_std)
    torch.testing.assert_close(advantages, (rewards - rewards.mean(1, keepdim=True)) / (expected_std + 1e-4))
    assert torch.equal(advantages[1], torch.zeros(4))  # identical rewards: no update (spec §10 item 24)
    advantages, std = group_advantages(rewards, "batch")
    torch.testing.assert_close(advantages, (rewards - rewards.mean(1, keepdim=True)) / (rewards.std() + 1e-4))
    advantages, _ = group_advantages(rewards, "none")
    torch.testing.assert_close(advantages, rewards - rewards.mean(1, keepdim=True))


def unit(*values):
    return F.normalize(torch.tensor(values, dtype=torch.float32), dim=-1)


def test_reward_terms_on_hand_made_embeddings():
    # Three in-batch candidates (teacher embeddings of the other side), orthonormal; two rollouts of three inputs.
    candidates = torch.eye(3)
    teacher = torch.stack([unit(1, 0.2, 0), unit(0, 1, 0), unit(0, 0, 1)])
    rollouts = torch.stack([
        torch.stack([unit(1, 0, 0), unit(0.6, 0.8, 0), unit(0, 1, 0)]),  # input 2 retrieves candidate 1
        torch.stack([unit(0.8, 0.6, 0), unit(0, 1, 0), unit(0, 0.6, 0.8)]),
    ])  # fmt: skip
    saving = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    options = GrpoOptions(rollouts=2, efficiency_weight=2.0, distillation_weight=0.5, recall_at=1)
    terms = retrieval_rewards(rollouts, teacher, candidates, saving, options)

    similarity = rollouts @ candidates.t()
    for i in range(2):
        for b in range(3):
            others = [c for c in range(3) if c != b]
            weights = torch.softmax(similarity[i, b, others] / 0.2, dim=0)
            negative = float((weights * similarity[i, b, others]).sum())
            positive = float(similarity[i, b, b])
            recall = float(positive >= float(similarity[i, b].max()))
            distillation = float(rollouts[i, b] @ teacher[b])
            expected = positive - negative + 2.0 * recall * float(saving[i, b]) + 0.5 * distillation
            assert math.isclose(float(terms.positive[i, b]), positive, abs_tol=1e-6)
            assert math.isclose(float(terms.negative[i, b]), negative, abs_tol=1e-6)
            assert float(terms.recall[i, b]) == recall
            assert math.isclose(float(terms.distillation[i, b]), distillation, abs_tol=1e-6)
            assert math.isclose(float(terms.reward[i, b]), expected, abs_tol=1e-6)
    assert terms.recall[0].tolist() == [1.0, 1.0, 0.0]  # input 2 of rollout 0 ranks its positive second
    assert terms.correct.tolist() == terms.recall.tolist()  # K_r = 1: recall@1 is the accuracy

    # "all": the recall gate multiplies the whole reward; K_r = 2 lets input 2 of rollout 0 through
    gated = retrieval_rewards(rollouts, teacher, candidates, saving, GrpoOptions(rollouts=2, reward_gate_mode="all"))
    assert gated.recall.min() == 1.0
    strict = retrieval_rewards(rollouts, teacher, candidates, saving,
                               GrpoOptions(rollouts=2, reward_gate_mode="all", recall_at=1))  # fmt: skip
    assert float(strict.reward[0, 2]) == 0.0
    separation = strict.positive - strict.negative
    torch.testing.assert_close(strict.reward[0, :2], (separation + saving + strict.distillation)[0, :2])


def test_identical_candidates_are_neither_negatives_nor_ranked_above_the_positive():
    candidates = torch.stack([unit(1, 0), unit(1, 0), unit(0, 1)])  # candidates 0 and 1 are the same target
    rollouts = torch.stack([unit(1, 0), unit(1, 0), unit(0, 1)])[None]
    keys = torch.tensor([7, 7, 3])
    terms = retrieval_rewards(rollouts, rollouts[0], candidates, torch.zeros(1, 3), GrpoOptions(recall_at=1), keys)
    assert terms.correct.tolist() == [[1.0, 1.0, 1.0]]
    torch.testing.assert_close(terms.negative, torch.zeros(1, 3), atol=1e-6, rtol=0)  # only the orthogonal one is
    assert float(in_batch_accuracy(candidates, candidates, keys)) == 1.0


def test_a_share_of_the_batch_rewarded_against_all_candidates_gets_the_whole_batchs_rewards():
    """What a process of a distributed launch computes: its inputs against every process's candidates, its positives
    at its offset among them."""
    generator = torch.Generator().manual_seed(6)
    rollouts = F.normalize(torch.randn(3, 4, 5, generator=generator), dim=-1)
    teacher, candidates = (F.normalize(torch.randn(4, 5, generator=generator), dim=-1) for _ in range(2))
    saving, keys = torch.rand(3, 4, generator=generator), torch.tensor([1, 2, 1, 3])
    whole = retrieval_rewards(rollouts, teacher, candidates, saving, GrpoOptions(recall_at=2), keys)
    for start in (0, 2):
        shown = slice(start, start + 2)
        part = retrieval_rewards(rollouts[:, shown], teacher[shown], candidates, saving[:, shown],
                                 GrpoOptions(recall_at=2), keys, offset=start)  # fmt: skip
        for name in ("reward", "negative", "recall", "correct"):
            torch.testing.assert_close(getattr(part, name), getattr(whole, name)[:, shown])


def test_group_size_below_two_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"--rollouts .*>= 2"):
        grpo_config(tmp_path / "out", GrpoOptions(rollouts=1))
    with pytest.raises(ValueError, match="--reward-gate"):
        GrpoOptions(reward_gate_mode="recall").validate()
    with pytest.raises(ValueError, match="--temperature"):
        GrpoOptions(temperature=0).validate()


def test_options_that_do_not_apply_to_grpo_are_refused(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--model", "m", "--data", "d", "--out", str(tmp_path / "o"), "--grpo", "--chunk-size",
                              "2", "--negatives"])  # fmt: skip
    with pytest.raises(ValueError, match="--chunk-size, --negatives do not apply to --grpo"):
        run_train(args)
    with pytest.raises(ValueError, match="--rollouts"):
        run_train(parser.parse_args(["--model", "m", "--data", "d", "--out", "o", "--grpo", "--rollouts", "1"]))


def test_grpo_config_carries_the_options():
    options = GrpoOptions(steps=3, batch_size=4, rollouts=4, temperature=0.7, epsilon=0.1)
    args = grpo_config("unused", options)
    assert (args.num_generations, args.temperature, args.epsilon, args.beta, args.scale_rewards) == (4, 0.7, 0.1, 0.0,
                                                                                                      "group")
    assert (args.max_steps, args.per_device_train_batch_size, args.learning_rate) == (3, 4, 5e-5)


# --- rollouts and replay on a tiny model ---------------------------------------------------------------------------


def policy_model(head_std: float = 0.0, seed: int = 0) -> MoEmbForEmbedding:
    """A 4-layer tiny MoEMB (3 Gated DeltaNet + 1 attention layer) with GRPO heads, the backbone frozen; with
    `head_std`, head weights drawn at random so that tokens decide differently."""
    config = copy.deepcopy(TINY_MOEMB)
    config["text_config"]["num_hidden_layers"] = 4
    torch.manual_seed(seed)
    model = MoEmbForEmbedding(MoEmbConfig(**config, gates={"efficiency_head": "grpo"})).eval()
    heads = prepare_policy_model(model)
    with torch.no_grad():
        for head in heads:
            head.weight.normal_(0, head_std)
    return model


@pytest.fixture(scope="module")
def model():
    return policy_model(head_std=0.5)


@pytest.fixture(scope="module")
def batch():
    """Four pairs, the targets shorter than the queries (right padding)."""
    short = RedundantTokenRetrieval(emb_token_id=EMB, num_fillers=5)
    pairs = [{"query": TASK.item(label, TASK.query_marker_id), "target": short.item(label, short.target_marker_id),
              "label": label} for label in (3, 1, 4, 1)]  # fmt: skip
    return collate_pairs(pairs)["inputs"]


def test_replayed_log_probs_equal_the_sampled_ones(model, batch):
    rollouts = sample_rollouts(model, batch, 3, 1.0, "masked", torch.Generator().manual_seed(0))
    assert rollouts.embeddings.shape == (3, 8, 64) and rollouts.actions.shape[:2] == (3, 8)
    assert rollouts.rate(DROP) > 0 and len({tuple(a.flatten().tolist()) for a in rollouts.actions}) == 3
    for i in range(3):
        log_prob = replayed_log_prob(model, batch, rollouts.actions[i], 1.0, "masked")
        assert log_prob.requires_grad
        torch.testing.assert_close(log_prob.detach(), rollouts.log_probs[i], atol=1e-5, rtol=0)
    # packed execution takes the same actions with the same probabilities
    packed = replayed_log_prob(model, batch, rollouts.actions[0], 1.0, "packed")
    torch.testing.assert_close(packed.detach(), rollouts.log_probs[0], atol=1e-5, rtol=0)


def test_the_pooled_token_never_drops(batch):
    model = policy_model(head_std=0.0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, EfficiencyHead):
                module.bias.copy_(torch.tensor([0.0, 0.0, 4.0]))  # DROP is by far the likeliest action
    rollouts = sample_rollouts(model, batch, 4, 1.0, "masked", torch.Generator().manual_seed(1))
    pooled = batch["input_ids"] == EMB
    assert bool((rollouts.actions[:, pooled] == -1).all())  # no decision: it always routes
    assert rollouts.rate(DROP) > 0.9
    assert bool(torch.isfinite(rollouts.embeddings).all())


def test_rollouts_drawn_for_the_whole_batch_do_not_depend_on_how_it_is_split(model, batch):
    """`SharedDraws`, as two processes of a distributed launch use it: each half of the batch (its queries and their
    targets), drawing for the whole batch from the same generator state and keeping its rows, takes the actions and
    log-probabilities of the whole batch's rollouts; the draws differ from rollout to rollout."""
    pairs, rollouts = 2, 3
    whole = sample_rollouts(model, batch, rollouts, 1.0, "masked", torch.Generator().manual_seed(7),
                            SharedDraws(torch.arange(rollouts * 4 * pairs)))  # fmt: skip
    assert len({tuple(actions.flatten().tolist()) for actions in whole.actions}) == rollouts
    for half in range(2):
        rows = torch.tensor([half * pairs + b + side * 2 * pairs for side in range(2) for b in range(pairs)])
        part = {key: value[rows] for key, value in batch.items()}
        part_length = int(part["attention_mask"].sum(-1).max())
        part = {key: value[:, :part_length] for key, value in part.items()}  # padded to its own longest input
        draws = SharedDraws(torch.cat([rows + g * 4 * pairs for g in range(rollouts)]))
        sampled = sample_rollouts(model, part, rollouts, 1.0, "masked", torch.Generator().manual_seed(7), draws)
        assert torch.equal(sampled.actions, whole.actions[:, rows, :part_length])
        torch.testing.assert_close(sampled.log_probs, whole.log_probs[:, rows], atol=1e-5, rtol=0)


def forced_forward(model, inputs: dict, actions: torch.Tensor, execution: str):
    control = GateControl(policy="forced", actions=actions)
    with torch.no_grad(), controlled_gates(model, control):
        output = model(**inputs, adaptive=policy_settings(execution))
    return output.embeddings, mean_log_prob(control)


@pytest.mark.parametrize("execution", ["masked", "packed"])
def test_each_samples_rollout_is_its_own(model, batch, execution):
    """Forced actions give a sample the embedding and log-probability it gets alone (no batch neighbours)."""
    actions = sample_rollouts(model, batch, 1, 1.0, execution, torch.Generator().manual_seed(2)).actions[0]
    embeddings, log_probs = forced_forward(model, batch, actions, execution)
    for row in (0, 5):
        length = int(batch["attention_mask"][row].sum())
        alone = {key: value[row : row + 1, :length] for key, value in batch.items()}
        embedding, log_prob = forced_forward(model, alone, actions[row : row + 1, :length], execution)
        torch.testing.assert_close(embedding, embeddings[row : row + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(log_prob, log_probs[row : row + 1], atol=1e-5, rtol=0)


def test_replay_gives_the_joint_gradients_and_only_heads_get_them(model, batch):
    rollouts = sample_rollouts(model, batch, 3, 1.0, "masked", torch.Generator().manual_seed(4))
    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))
    args = grpo_config("unused", GrpoOptions(rollouts=3, batch_size=4))
    model.zero_grad()
    replay(model, batch, rollouts, advantages, args, "masked", torch.Tensor.backward)
    replayed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    losses = []
    replay(model, batch, rollouts, advantages, args, "masked", losses.append)
    torch.stack(losses).sum().backward()
    joint = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert replayed and sorted(replayed) == sorted(joint)
    assert all(".mlp.efficiency_head." in name for name in replayed)
    assert all(float(grad.abs().sum()) > 0 for name, grad in replayed.items() if name.endswith("bias"))
    for name in replayed:
        torch.testing.assert_close(replayed[name], joint[name], atol=1e-6, rtol=1e-5)


# --- learning ------------------------------------------------------------------------------------------------------


def test_the_policy_learns_to_drop_redundant_tokens(tmp_path):
    """On retrieval of a class token among ten uninformative filler tokens, a short GRPO run (12 steps of 8 pairs,
    4 rollouts) makes the FLOPs saving rise far above its start, while the greedy policy's in-batch accuracy on held-out
    pairs stays within 0.1 of full compute's; the fillers are dropped, the class token kept; only the heads change."""
    model = policy_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    options = GrpoOptions(steps=12, batch_size=8, learning_rate=0.05, rollouts=4, recall_at=1, execution="masked",
                          logging_steps=1)  # fmt: skip
    args = grpo_config(tmp_path / "run", options, lr_scheduler_type="constant", max_grad_norm=1.0)
    pairs = TASK.pairs(96, torch.Generator().manual_seed(0))
    trainer = GatePolicyGRPOTrainer(model=model, args=args, train_dataset=pairs, data_collator=collate_pairs,
                                    options=options)  # fmt: skip
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert {"reward_std", "frac_reward_zero_std", "clip_ratio/region_mean", "accuracy"} <= set(logs[0])
    assert logs[-1]["flops_saving"] > logs[0]["flops_saving"] + 0.3, logs
    assert all(log["clip_ratio/region_mean"] == 0 for log in logs)  # on-policy: r = 1

    held_out = collate_pairs(TASK.pairs(32, torch.Generator().manual_seed(99)))
    inputs, keys = held_out["inputs"], held_out["target_keys"]
    with torch.no_grad():
        full = model(**inputs, adaptive={}).embeddings
        greedy = model(**inputs, adaptive={"efficiency_policy": "greedy", "execution": "masked"})
    full_accuracy = float(in_batch_accuracy(full[:32], full[32:], keys))
    accuracy = float(in_batch_accuracy(greedy.embeddings[:32], greedy.embeddings[32:], keys))
    assert greedy.adaptive.flops_saving > 0.3 and accuracy >= full_accuracy - 0.1, (accuracy, full_accuracy)
    ids = inputs["input_ids"][inputs["attention_mask"].bool()]
    dropped = greedy.adaptive.decisions.drop.amax(dim=1)  # per real token: dropped at some layer
    assert float(dropped[ids == TASK.filler_token_id].mean()) > 0.8
    classes = (ids >= TASK.first_class_id) & (ids < TASK.first_class_id + TASK.num_classes)
    assert float(dropped[classes].mean()) < 0.5
    changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])]
    assert changed and all(".mlp.efficiency_head." in name for name in changed)


# --- the command, the saved model, its export ------------------------------------------------------------------------


def test_train_command_saves_heads_that_load_here_and_exported_without_moezoo(tiny_moemb, tmp_path):
    data = ShapeRetrieval().write_mmeb_training(tmp_path / "mmeb", 8, torch.Generator().manual_seed(3))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args([
        "--model", str(tiny_moemb), "--data", str(data), "--out", str(out), "--grpo", "--steps", "2", "--batch-size",
        "4", "--rollouts", "2", "--lr", "0.05", "--logging-steps", "1", "--rollout-execution", "masked",
    ])  # fmt: skip
    assert run_train(args) == 0
    for name in ("model.safetensors", "processor_config.json", "grpo_curves.png", "action_rates.png"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["gates"]["efficiency_head"] == "grpo" and config["adaptive"]["efficiency_policy"] == "greedy"
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["rollouts"] == 2 and 0 <= training["flops_saving_last"] <= 1

    base, trained = (MoEmbForEmbedding.from_pretrained(folder).state_dict() for folder in (tiny_moemb, out))
    heads = [name for name in trained if ".efficiency_head." in name]
    assert heads and sorted(set(trained) - set(base)) == sorted(heads)
    assert all(torch.equal(base[name], trained[name]) for name in base)  # the backbone is frozen
    assert not torch.equal(trained[heads[1]], torch.tensor([0.0, -2.5, -4.0]))  # a bias moved from its init

    # A policy that decides something (two steps barely move the heads): layer 0 drops every token it may.
    model = MoEmbForEmbedding.from_pretrained(out).eval()
    with torch.no_grad():
        model.model.language_model.layers[0].mlp.efficiency_head.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    model.save_pretrained(tmp_path / "policy")
    MoEmbProcessor.from_pretrained(out).save_pretrained(tmp_path / "policy")
    exported = export_folder(tmp_path / "policy", tmp_path / "exported")
    inputs = dict(MoEmbProcessor.from_pretrained(out)(["a red circle", "a photo of a blue square"]))
    with torch.no_grad():
        greedy, full = model(**inputs), model(**inputs, adaptive={})
    assert greedy.adaptive.flops_saving > 0.5
    assert not torch.allclose(greedy.embeddings, full.embeddings, atol=1e-4)
    embeddings, flops_saving = exported_moemb_outputs(exported, inputs, tmp_path)
    torch.testing.assert_close(embeddings, greedy.embeddings, atol=1e-6, rtol=0)
    assert flops_saving > 0.5
