"""GRPO over MoEMB's efficiency gates (spec moemb.md §3.13, paper §4.1 and App. E.1), on TRL and transformers' Trainer.

The policy is the per-MoE-layer three-way efficiency head (`mlp.efficiency_head`, logits ROUTE / SKIP / DROP, see
`moezoo.modeling.moemb_adaptive.gates`): every token alive at a MoE layer draws one action from
softmax(logits / T_s). Native routing stays greedy; only the heads train, the backbone (LoRA merged) is frozen.

One training step on a batch of B (query, target) pairs:

    with no_grad: E_full = full-compute embeddings of queries and targets (the teacher)
    with no_grad: G rollouts of both sides, each token and layer drawing its action; their actions, embeddings,
                  log-probabilities ℓ_i^old and logical FLOPs saving S(a_i) kept
    R = retrieval reward of each rollout (below); Â = TRL's group advantages over each input's G rollouts
    for i in 1..G: ℓ_i = mean log π of rollout i's actions, forward re-run with them forced; r_i = exp(ℓ_i − ℓ_i^old)
                   (−(1/G) · mean over inputs of min(r_i Â_i, clip(r_i, 1 ± ε) Â_i)).backward()
    optimizer step (AdamW, heads only)

The reward of rollout i of query q_b against the teacher's embeddings of the in-batch targets {t_c} (spec §3.13):

    s⁺ = cos(e_i(q_b), e_full(t_b))
    s̄⁻ = Σ_{c≠b} w_c cos(e_i(q_b), e_full(t_c)),  w = softmax_c(cos / 0.2)
    recall = 1[rank of t_b among the in-batch targets ≤ K_r]                   (K_r = G unless set)
    R = (s⁺ − s̄⁻) + λ_s · recall · S(a_i) + λ_d · cos(e_i(q_b), e_full(q_b))  reward_gate_mode="efficiency_only"
    R = recall · ((s⁺ − s̄⁻) + λ_s · S(a_i) + λ_d · cos(e_i(q_b), e_full(q_b)))  reward_gate_mode="all"

and symmetrically for the target side against the teacher's query embeddings (A-29). In-batch candidates identical
to the positive (the same target key) are neither negatives nor ranked above it.

On several data-parallel processes (DDP: a distributed launch), the batch is the global batch, as the contrastive
loss's is: the candidates are the teacher's embeddings of every process's inputs, the advantages and the logged
metrics are computed from every process's rewards (TRL's gather, each process keeping its own inputs' advantages),
and each input's rollouts draw the actions one process on the global batch would draw for it (`SharedDraws`). The policy
gradient flows through each process's own log-probabilities and DDP averages it, so two processes at batch B train
as one process at 2B. Updates are on-policy (one per rollout
batch), so r_i = 1 up to rounding and the clipping is inactive; the clip ratios are logged under TRL's names anyway.

`trl.GRPOConfig` holds the arguments (`num_generations` = G, `temperature`, `epsilon`, `beta` = 0, `scale_rewards`),
TRL's group-advantage arithmetic and `nanstd` are reused, and the logged metrics carry TRL's names (`reward`,
`reward_std`, `frac_reward_zero_std`, `clip_ratio/low_mean`, ...) beside the FLOPs saving and in-batch accuracy.
TRL's `GRPOTrainer` is not subclassed: it generates and scores text completions, and its per-sample reward functions
cannot express a batch-level retrieval reward (spec §3.13).

S(a) is the language model's saving (Eq. 6-7 on the realised actions; the vision tower runs in full whatever the
gates decide). The G rollouts of a batch are sampled in one forward over G copies of it (every sample draws its own
actions: spec §3.0), queries and targets together, in packed execution (spec §3.14; `execution="masked"` is faster on
CPU at tiny sizes, with the same actions and log-probabilities).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments, set_seed
from trl import GRPOConfig
from trl.trainer.utils import nanstd

from .. import __version__
from ..hub.folders import read_provenance, write_provenance
from ..hub.sources import model_folder
from ..configuration.moemb_adaptive import EXECUTION_MODES
from ..modeling.moemb import MoEmbForEmbedding, controlled_gates
from ..modeling.moe.balancing import sum_over_processes
from ..modeling.moe.precision import scaled_similarities
from ..modeling.moemb_adaptive.gates import (
    DROP,
    SKIP,
    EfficiencyHead,
    GateControl,
    SharedDraws,
    attach_gate_modules,
)
from ..processors.moemb import MoEmbProcessor
from ..terminal import console
from .arguments import TrainerOptions, checkpoint_to_resume, trainer_arguments
from .callbacks import LogAtCheckpointsAndEnd, LogsStepMeans, use_rich_progress, write_tensorboard_into
from . import deepspeed_zero
from .adapted_sharding import load_adapted_for_training, unsharded_copy
from .distributed import all_gather_with_grad, check_enough_examples, main_process_output_dir, world
from .moemb_data import load_mmeb_dataset, target_key
from .plots import plot_log_history, save_figure
from .precision import load_dtype
from .sharded_checkpoints import ShardedCheckpointsMixin

REWARD_GATE_MODES = ("efficiency_only", "all")
SCALE_REWARDS = ("group", "batch", "none")
# The training curves written beside the model: panel title -> logged metric.
CURVES = {"reward": "reward", "FLOPs saving S(a)": "flops_saving", "in-batch accuracy (rollouts)": "accuracy",
          "in-batch accuracy (full compute)": "full_compute_accuracy"}  # fmt: skip
# GRPOConfig's own fields that this GRPO honours, and those it does not: TRL's GRPOTrainer generates and scores text
# with them.
HONOURED_GRPO_FIELDS = ("num_generations", "temperature", "epsilon", "epsilon_high", "scale_rewards")
TEXT_GENERATION_FIELDS = sorted({field.name for field in dataclasses.fields(GRPOConfig)}
                                - {field.name for field in dataclasses.fields(TrainingArguments)}
                                - set(HONOURED_GRPO_FIELDS))  # fmt: skip


# --- options ------------------------------------------------------------------------------------------------------


@dataclass
class GrpoOptions(TrainerOptions):
    """`moezoo train moemb --grpo`: the Trainer's options (spec §3.13's defaults) and the policy's."""

    arguments_class = GRPOConfig
    recipe_fields = {name: "it is for generating text, and this GRPO samples the efficiency heads' actions"
                     for name in TEXT_GENERATION_FIELDS} | {
        "beta": "there is no reference model (beta = 0)",
        "num_iterations": "updates are on-policy, one per rollout batch",
        "steps_per_generation": "each step samples its own rollouts (--num_generations of each input)",
        "dataloader_drop_last": "the in-batch candidates assume equal local batches",
        "ddp_find_unused_parameters": "the heads' log-probabilities are read from the gates' record, not from the "
                                      "forward's output, so DDP's search would take every head for unused",
    }  # fmt: skip

    steps: int = 200
    batch_size: int = 32  # (query, target) pairs per process; the in-batch candidates are the global batch's
    learning_rate: float | None = 5e-5
    weight_decay: float = 0.01  # AdamW's (App. E.1); biases are not decayed
    rollouts: int = 8  # G
    temperature: float = 1.0  # T_s
    efficiency_weight: float = 1.0  # λ_s
    distillation_weight: float = 1.0  # λ_d
    reward_gate_mode: str = "efficiency_only"
    recall_at: int | None = None  # K_r of the recall gate; None: G
    negative_temperature: float = 0.2  # of the softmax weighting the negatives
    epsilon: float = 0.2  # PPO clip range (inactive on-policy)
    scale_rewards: str = "group"  # TRL's: standardise advantages by the group's std, the batch's, or not at all
    max_length: int | None = None  # longest input in tokens (default: the processor's)
    execution: str = "packed"  # of the rollouts (AdaptiveSettings.execution); "masked" is faster on CPU at tiny sizes
    dtype: str | None = None  # load the weights in this dtype (`moezoo.training.precision`); None: the folder's

    def validate(self) -> None:
        """Raises a ValueError naming the option (its command-line flag) for values GRPO cannot run with."""
        if not (isinstance(self.rollouts, int) and self.rollouts >= 2):
            raise ValueError(
                f"--rollouts (GrpoOptions.rollouts, GRPO's group size G) must be an integer >= 2, got "
                f"{self.rollouts!r}: advantages compare each rollout with the other rollouts of its input"
            )
        if self.batch_size < 2:
            raise ValueError(f"--batch-size must be >= 2, got {self.batch_size}: the reward ranks in-batch targets")
        for flag, value in (("--temperature", self.temperature), ("--negative-temperature", self.negative_temperature)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        for flag, value in (("--lambda-s", self.efficiency_weight), ("--lambda-d", self.distillation_weight),
                            ("--epsilon", self.epsilon)):  # fmt: skip
            if not value >= 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.reward_gate_mode not in REWARD_GATE_MODES:
            raise ValueError(f"--reward-gate must be one of {REWARD_GATE_MODES}, got {self.reward_gate_mode!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"--scale-rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if self.execution not in EXECUTION_MODES:
            raise ValueError(f"--rollout-execution must be one of {EXECUTION_MODES}, got {self.execution!r}")
        if self.recall_at is not None and not (isinstance(self.recall_at, int) and self.recall_at >= 1):
            raise ValueError(f"--recall-at must be an integer >= 1, got {self.recall_at!r}")

    @property
    def recall_cutoff(self) -> int:
        return self.rollouts if self.recall_at is None else self.recall_at


# Help of the GRPOConfig fields GRPO honours, on `moezoo train moemb`.
GRPO_FIELD_HELPS = {
    "num_generations": f"with --grpo: G, rollouts per input (>= 2; default here: {GrpoOptions.rollouts})",
    "temperature": "with --grpo: sampling temperature of the efficiency heads (default here: "
                   f"{GrpoOptions.temperature})",
    "epsilon": f"with --grpo: PPO clip range (inactive on-policy; default here: {GrpoOptions.epsilon})",
    "scale_rewards": "with --grpo: TRL's advantage scaling, by each input's reward std (group), the batch's, or none "
                     f"(default here: {GrpoOptions.scale_rewards})",
}


def grpo_config(out: str | Path, options: GrpoOptions, fixed: dict | None = None, **defaults) -> GRPOConfig:
    """TRL's `GRPOConfig` for a run writing `out`: the Trainer arguments every moezoo command uses
    (`trainer_arguments`, with TrainingArguments' defaults, not GRPOConfig's, which checkpoint activations) and
    GRPO's. TRL counts its batch in completions; here each of the `batch_size` inputs has `rollouts` of them, so its
    generation batch is `batch_size × rollouts`."""
    options.validate()
    grpo = dict(num_generations=options.rollouts, steps_per_generation=options.rollouts,
                temperature=options.temperature, epsilon=options.epsilon, beta=0.0, num_iterations=1,
                scale_rewards=options.scale_rewards)  # fmt: skip
    arguments = trainer_arguments(out, options, (fixed or {}) | grpo, **defaults)
    init_fields = {field.name for field in dataclasses.fields(TrainingArguments) if field.init}
    common = TrainingArguments(**{key: value for key, value in arguments.items() if key in init_fields})
    return GRPOConfig(
        **{key: value for key, value in common.to_dict().items() if key in init_fields},
        **{key: value for key, value in arguments.items() if key not in init_fields},
    )


# --- reward and advantages ----------------------------------------------------------------------------------------


@dataclass
class RolloutRewards:
    """Per rollout and input, `(G, B)` each: the reward and its terms."""

    reward: torch.Tensor
    positive: torch.Tensor  # s⁺
    negative: torch.Tensor  # s̄⁻
    recall: torch.Tensor  # 1[rank ≤ K_r]
    correct: torch.Tensor  # 1[rank = 1]: the in-batch accuracy
    distillation: torch.Tensor  # cos(e_i, e_full) of the same input
    flops_saving: torch.Tensor  # S(a_i)

    @classmethod
    def cat(cls, parts: list[RolloutRewards]) -> RolloutRewards:
        """The rewards of several sets of inputs, side by side `(G, N_1 + N_2 + ...)`."""
        return cls(**{field.name: torch.cat([getattr(part, field.name) for part in parts], dim=1)
                      for field in dataclasses.fields(cls)})  # fmt: skip

    def gathered(self) -> RolloutRewards:
        """Every process's rewards side by side, in rank order `(G, world size × N)` (a collective)."""
        return RolloutRewards(**{field.name: all_gather_with_grad(getattr(self, field.name).t()).t()
                                 for field in dataclasses.fields(self)})  # fmt: skip


def retrieval_rewards(
    embeddings: torch.Tensor,  # (G, B, d) normalised: the rollouts of one side
    teacher: torch.Tensor,  # (B, d) the same inputs at full compute
    candidates: torch.Tensor,  # (C, d) the other side at full compute; candidate offset + b is input b's positive
    flops_saving: torch.Tensor,  # (G, B) S(a) of every rollout
    options: GrpoOptions,
    keys: torch.Tensor | None = None,  # (C,) candidates with the key of input b's positive are not its negatives
    offset: int = 0,  # where the inputs' positives start among the candidates (the global batch's, on a process)
) -> RolloutRewards:
    """The batch-level retrieval reward of spec §3.13 (see the module docstring)."""
    embeddings, teacher, candidates = embeddings.float(), teacher.float(), candidates.float()
    inputs = torch.arange(embeddings.shape[1], device=embeddings.device)
    labels = offset + inputs
    similarity = scaled_similarities(embeddings, candidates)  # (G, B, C), fp32 under autocast too
    positive = similarity[:, inputs, labels]  # (G, B)
    own = torch.zeros(similarity.shape[1:], dtype=torch.bool, device=similarity.device)
    own[inputs, labels] = True
    duplicate = own if keys is None else keys[labels][:, None] == keys[None, :]
    negative_logits = (similarity / options.negative_temperature).masked_fill(duplicate, float("-inf"))
    weights = torch.softmax(negative_logits, dim=-1).nan_to_num(0.0)  # a batch of duplicates has no negative
    negative = (weights * similarity).sum(-1)
    rank = 1 + ((similarity > positive[..., None]) & ~duplicate).sum(-1)
    recall = (rank <= options.recall_cutoff).float()
    distillation = (embeddings * teacher).sum(-1)
    separation, efficiency = positive - negative, options.efficiency_weight * flops_saving
    distilled = options.distillation_weight * distillation
    if options.reward_gate_mode == "efficiency_only":
        reward = separation + recall * efficiency + distilled
    else:
        reward = recall * (separation + efficiency + distilled)
    return RolloutRewards(reward, positive, negative, recall, (rank == 1).float(), distillation, flops_saving)


def group_advantages(rewards: torch.Tensor, scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's group advantages (`GRPOTrainer._generate_and_score_completions`) of `rewards` `(N, G)`, the G rollouts
    of each of N inputs: `(r − mean_group) / (std + 1e-4)`, std the group's (`"group"`), the batch's (`"batch"`) or
    none. Returns the advantages `(N, G)` and each rollout's std (for `frac_reward_zero_std`)."""
    num_generations = rewards.shape[1]
    flat = rewards.flatten()  # TRL's layout: the G completions of a prompt are consecutive
    mean_grouped = torch.nanmean(flat.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        std = nanstd(flat).expand_as(flat)
    else:
        std = nanstd(flat.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    advantages = flat - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages.view_as(rewards), std.view_as(rewards)


# --- rollouts -----------------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """G rollouts of a batch of N inputs: what the reward and the replay need."""

    embeddings: torch.Tensor  # (G, N, d)
    actions: torch.Tensor  # (G, N, S, L) long, input layout, -1 where no decision was taken
    log_probs: torch.Tensor  # (G, N) mean log π of each rollout's actions at sampling time (ℓ^old)
    flops_saving: torch.Tensor  # (G, N) S(a)

    def counts(self) -> torch.Tensor:
        """`(3,)` the decisions that took SKIP, those that took DROP, and all decisions, over every rollout."""
        return torch.stack([(self.actions == SKIP).sum(), (self.actions == DROP).sum(), (self.actions >= 0).sum()])

    def rate(self, action: int) -> float:
        """The share of the decisions that took `action` (SKIP or DROP), over every rollout."""
        counts = self.counts()
        return float(counts[[SKIP, DROP].index(action)] / counts[2].clamp(min=1))


def mean_log_prob(control: GateControl) -> torch.Tensor:
    """ℓ = (1/N) Σ_ℓ Σ_t log π(a_tℓ | x_tℓ) per sample, N its number of decisions (spec §3.13, App. E.1)."""
    record = control.record
    return record.log_prob_sum / record.decisions.clamp(min=1).to(record.log_prob_sum)


def policy_settings(execution: str) -> dict:
    """The adaptive settings of a rollout: the efficiency heads alone, in `execution` mode; the `GateControl`'s
    policy (sampled or forced) replaces the greedy one."""
    return {"efficiency_policy": "greedy", "execution": execution}


def repeat_batch(batch: dict, times: int) -> dict:
    """`times` copies of a processed batch, one after the other: rows, and the pixels of their images and videos
    (which follow the rows' order), are concatenated."""
    return {key: torch.cat([value] * times) if torch.is_tensor(value) else value for key, value in batch.items()}


@torch.no_grad()
def sample_rollouts(
    model, batch: dict, num_rollouts: int, temperature: float, execution: str = "packed",
    generator: torch.Generator | None = None, draws: SharedDraws | None = None,
) -> Rollouts:  # fmt: skip
    """`num_rollouts` rollouts of every input of `batch`, every token drawing its action at every MoE layer; one
    forward over `num_rollouts` copies of the batch (each sample's actions are its own, spec §3.0). `draws`: the
    actions drawn for a larger batch of which the copies are rows (`SharedDraws.global_batch`)."""
    control = GateControl(policy="sample", temperature=temperature, generator=generator, draws=draws)
    with controlled_gates(model, control):
        output = model(**repeat_batch(batch, num_rollouts), adaptive=policy_settings(execution))
    return Rollouts(
        embeddings=output.embeddings.unflatten(0, (num_rollouts, -1)),
        actions=control.record.actions.unflatten(0, (num_rollouts, -1)),
        log_probs=mean_log_prob(control).unflatten(0, (num_rollouts, -1)),
        flops_saving=output.adaptive.sample_flops_saving.to(output.embeddings).unflatten(0, (num_rollouts, -1)),
    )


def replayed_log_prob(
    model, batch: dict, actions: torch.Tensor, temperature: float, execution: str = "packed"
) -> torch.Tensor:
    """`(N,)` mean log π of `actions` (one rollout's), the forward re-run with them forced; differentiable in the
    heads."""
    control = GateControl(policy="forced", actions=actions, temperature=temperature)
    with controlled_gates(model, control):
        model(**batch, adaptive=policy_settings(execution))
    return mean_log_prob(control)


def replay(
    model,
    batch: dict,
    rollouts: Rollouts,
    advantages: torch.Tensor,  # (N, G)
    args: GRPOConfig,
    execution: str,
    backward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped GRPO objective, one rollout at a time: rollout i's actions are forced, ℓ_i read with gradients,
    and `backward` called on −(1/G) · mean over inputs of min(r_i Â_i, clip(r_i, 1 ± ε) Â_i) before the next
    rollout's forward (only one rollout's graph is alive). Returns the summed loss and the ratios r `(N, G)`."""
    low, high = clip_range(args)
    total, ratios = torch.zeros((), device=advantages.device), []
    for i in range(args.num_generations):
        log_prob = replayed_log_prob(model, batch, rollouts.actions[i], args.temperature, execution)
        ratio = torch.exp(log_prob - rollouts.log_probs[i])
        advantage = advantages[:, i]
        objective = torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)
        loss = -objective.mean() / args.num_generations
        backward(loss)
        total += loss.detach()
        ratios.append(ratio.detach())
    return total, torch.stack(ratios, dim=1)


# --- the trainer --------------------------------------------------------------------------------------------------


class GatePolicyGRPOTrainer(LogsStepMeans, ShardedCheckpointsMixin, Trainer):
    """GRPO over the efficiency heads (see the module docstring), with a `trl.GRPOConfig` as `args` and the reward's
    options in `options`. A batch is `{"inputs": <the B queries then their B targets, processed as one batch>,
    "target_keys": (B,)}` (`GrpoCollator`); the model's parameters other than the efficiency heads must be frozen
    (`prepare_policy_model`)."""

    zero3_refusal = deepspeed_zero.SKIPPED_MODULES.format(module="vision tower", inputs="an image")

    def __init__(self, *args, options: GrpoOptions, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, GRPOConfig):
            raise TypeError(f"GatePolicyGRPOTrainer takes a trl.GRPOConfig as args, got {type(self.args).__name__}")
        self.options = options
        self.generator = torch.Generator().manual_seed(self.args.seed)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # No dropout: the replayed forward must see the hidden states the actions were drawn from.
        model.eval()
        inputs = self._prepare_inputs(inputs)
        args, options = self.args, self.options
        batch, keys = inputs["inputs"], inputs.get("target_keys")
        pairs = batch["input_ids"].shape[0] // 2  # queries, then their targets
        rank, _ = world()
        with torch.no_grad():
            teacher = model(**batch, adaptive={}).embeddings
        # G copies of the queries and the targets: 2G blocks, each this process's share of the global batch's.
        draws = SharedDraws.global_batch(pairs, 2 * args.num_generations)
        rollouts = sample_rollouts(model, batch, args.num_generations, args.temperature, options.execution,
                                   self.generator, draws)  # fmt: skip
        # Queries against the teacher's targets, targets against the teacher's queries (spec A-29), of every process.
        sides = {"query": slice(0, pairs), "target": slice(pairs, 2 * pairs)}
        candidates = {side: all_gather_with_grad(teacher[rows]) for side, rows in sides.items()}
        keys = None if keys is None else all_gather_with_grad(keys)
        rewards = RolloutRewards.cat([
            retrieval_rewards(rollouts.embeddings[:, sides[own]], teacher[sides[own]], candidates[other],
                              rollouts.flops_saving[:, sides[own]], options, keys, offset=rank * pairs)
            for own, other in (("query", "target"), ("target", "query"))
        ]).gathered()  # fmt: skip
        advantages, std = group_advantages(rewards.reward.t(), args.scale_rewards)  # (world size × 2B, G)
        local = slice(rank * 2 * pairs, (rank + 1) * 2 * pairs)

        steps = self.current_gradient_accumulation_steps
        loss, ratio = replay(model, batch, rollouts, advantages[local], args, options.execution,
                             lambda loss: self.accelerator.backward(loss / steps))  # fmt: skip
        self._record_metrics(rewards, std, advantages[local], ratio, rollouts, candidates["query"],
                             candidates["target"], keys)  # fmt: skip
        return loss / steps

    def _record_metrics(self, rewards, std, advantages, ratio, rollouts, queries, targets, keys) -> None:
        """The step's metrics: of the global batch (`rewards`, `std`, the teacher's `queries` and `targets` and their
        `keys` are every process's), but for the clip ratios, this process's, which the logs average over processes."""
        low_epsilon, high_epsilon = clip_range(self.args)
        record = self.record_step_value
        reward = rewards.reward
        record("reward", torch.nanmean(reward))
        record("reward_std", nanstd(reward.flatten()))
        record("frac_reward_zero_std", torch.isclose(std, torch.zeros_like(std)).float().mean())
        low = (ratio < 1 - low_epsilon) & (advantages < 0)
        high = (ratio > 1 + high_epsilon) & (advantages > 0)
        record("clip_ratio/low_mean", low.float().mean())
        record("clip_ratio/high_mean", high.float().mean())
        record("clip_ratio/region_mean", (low | high).float().mean())
        for name in ("positive", "negative", "recall", "distillation"):
            record(f"rewards/{name}", getattr(rewards, name).mean())
        record("flops_saving", rewards.flops_saving.mean())
        record("accuracy", rewards.correct.mean())
        full = (in_batch_accuracy(queries, targets, keys) + in_batch_accuracy(targets, queries, keys)) / 2
        record("full_compute_accuracy", full)
        skips, drops, decisions = sum_over_processes(rollouts.counts()).float()
        record("skip_rate", skips / decisions.clamp(min=1))
        record("drop_rate", drops / decisions.clamp(min=1))


def clip_range(args: GRPOConfig) -> tuple[float, float]:
    """(ε_low, ε_high) as TRL reads them: `epsilon_high` defaults to `epsilon`."""
    return args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high


def in_batch_accuracy(queries: torch.Tensor, targets: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Share of queries whose own target is the most similar in-batch target (targets with its key count as it)."""
    similarity = scaled_similarities(queries, targets)
    best = similarity.argmax(-1)
    own = torch.arange(len(queries), device=queries.device)
    hit = best == own if keys is None else keys[best] == keys[own]
    return hit.float().mean()


@dataclass
class GrpoCollator:
    """Examples of `load_mmeb_dataset` -> `{"inputs": the B queries then their B targets as one processed batch,
    "target_keys": (B,)}` (`target_key` of each target: identical targets share it)."""

    processor: MoEmbProcessor
    max_length: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        items = [example["query"] for example in examples] + [example["target"] for example in examples]
        return {"inputs": self.processor(items, max_length=self.max_length),
                "target_keys": torch.tensor([target_key(example["target"]) for example in examples])}  # fmt: skip


# --- the command --------------------------------------------------------------------------------------------------


def prepare_policy_model(model: MoEmbForEmbedding) -> list[torch.nn.Module]:
    """Freezes everything but the efficiency heads and returns them; the model must have them
    (`MoEmbConfig.gates["efficiency_head"]`)."""
    heads = [module for module in model.modules() if isinstance(module, EfficiencyHead)]
    if not heads:
        raise ValueError(
            "the model has no efficiency heads: load it with gates={'efficiency_head': 'grpo'} (what "
            "train_moemb_grpo does), or set MoEmbConfig.gates"
        )
    model.requires_grad_(False)
    for head in heads:
        head.requires_grad_(True)
    return heads


def load_policy_model(folder: str | Path, fsdp: int = 1, ep: int = 1, ep_implementation: str = "auto",
                      dtype: str | None = None) -> MoEmbForEmbedding:  # fmt: skip
    """The MoEMB model of `folder` with efficiency heads (`with_policy_heads`), sharded as `--fsdp` / `--ep` ask:
    the heads are added to the model loaded whole, then the frozen backbone is sharded (`adapted_sharding`). The
    heads stay whole on every process: the loss reaches them through the gates' record, not through the output of
    the FSDP2 unit that holds them, so FSDP2 would not reduce their gradients; the Trainer averages them instead.
    The vision tower runs on the batches that hold images only: it is left to the root unit. `dtype`: see
    `moezoo.training.precision`."""
    return load_adapted_for_training(MoEmbForEmbedding, folder, with_policy_heads, fsdp, ep, ep_implementation,
                                     root_held=("model.visual",), kept_whole=("efficiency_head",),
                                     **load_dtype(dtype))  # fmt: skip


def with_policy_heads(model: MoEmbForEmbedding) -> MoEmbForEmbedding:
    """`model` with efficiency heads: its own if it has them (a GRPO run continued), else new ones with GRPO's
    initialisation (W = 0, bias (0, −2.5, −4): spec A-28); the backbone frozen."""
    config = model.config
    gates = config.gate_modules()
    if gates.efficiency_head is None:
        gates.efficiency_head = "grpo"
        gates.validate(config.text_config.num_hidden_layers, config.moe_variant)  # e.g. no router to gate
        config.gates = config.text_config.gates = gates.to_dict()
        attach_gate_modules(model.model.language_model, config.text_config)
    prepare_policy_model(model)
    return model


def train_moemb_grpo(
    model_dir: str | Path,
    data,
    out: str | Path,
    options: GrpoOptions | None = None,
    image_root: str | Path | None = None,
    overwrite: bool = False,
) -> dict:
    """GRPO over the efficiency heads of the MoEMB model in `model_dir` (a contrastively trained one, spec §7.3) on
    `data` (MMEB's training format, see `load_mmeb_dataset`). Saves to `out` the model with its trained heads, run
    greedily at inference (`adaptive={"efficiency_policy": "greedy"}` in its config), its processor, the curves of
    reward, FLOPs saving and accuracy (`grpo_curves.png`) and the per-layer skip and drop rates by modality on the
    first examples (`action_rates.png`). Returns the training record (also in the provenance file)."""
    options = options or GrpoOptions()
    options.validate()
    checkpoint = checkpoint_to_resume(out, options)
    folder, _ = model_folder(model_dir, "`moezoo train moemb --grpo`", ["moemb"])
    dataset = load_mmeb_dataset(data, image_root)
    check_enough_examples(len(dataset), options.batch_size)
    set_seed(options.seed)
    model = load_policy_model(folder, options.fsdp, options.ep, options.ep_implementation, options.dtype)
    processor = MoEmbProcessor.from_pretrained(folder)
    collator = GrpoCollator(processor, options.max_length)

    with main_process_output_dir(out, overwrite=overwrite) as staging:
        # DDP's search for unused parameters walks back from the forward's output, which the log-probabilities of the
        # heads do not feed (they are read from the gates' record): it would take every head for unused.
        args = grpo_config(out, options, dict(dataloader_drop_last=True, ddp_find_unused_parameters=False),
                           max_grad_norm=1.0)
        trainer = GatePolicyGRPOTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                        callbacks=[LogAtCheckpointsAndEnd()], options=options)  # fmt: skip
        use_rich_progress(trainer)
        write_tensorboard_into(trainer, staging)
        trainer.train(resume_from_checkpoint=checkpoint)
        if options.fsdp > 1 or options.ep > 1:
            model = unsharded_copy(model, partial(load_policy_model, folder, dtype=options.dtype))
        model.config.adaptive = (model.config.adaptive or {}) | {"efficiency_policy": "greedy"}
        model.save_pretrained(staging)
        processor.save_pretrained(staging)

        logs = trainer.state.log_history
        curves = plot_log_history(logs, CURVES, staging / "grpo_curves.png", title="MoEMB: GRPO over efficiency gates")
        examples = [dataset[i] for i in range(min(16, len(dataset)))]
        with torch.no_grad():  # the greedy policy the saved config runs
            inputs = processor([example[side] for side in ("query", "target") for example in examples],
                               max_length=options.max_length).to(model.device)  # fmt: skip
            report = model.eval()(**inputs).adaptive
        rates = plot_action_rates(report, staging / "action_rates.png")
        trained = [log for log in logs if "reward" in log]
        training = {
            "summary": f"GRPO over the efficiency heads for {options.steps} steps, batch {options.batch_size}, "
                       f"{options.rollouts} rollouts per input, reward gate {options.reward_gate_mode}",
            "steps": options.steps,
            "batch_size": options.batch_size,
            "rollouts": options.rollouts,
            "learning_rate": options.learning_rate,
            "temperature": options.temperature,
            "efficiency_weight": options.efficiency_weight,
            "distillation_weight": options.distillation_weight,
            "reward_gate_mode": options.reward_gate_mode,
            "recall_at": options.recall_cutoff,
            **{f"{name}_{when}": round(log[name], 4) for when, log in (("first", trained[0]), ("last", trained[-1]))
               for name in ("reward", "flops_saving", "accuracy")},  # fmt: skip
            "greedy_flops_saving": round(report.flops_saving, 4),
            "examples": len(dataset),
        }
        write_provenance(staging, read_provenance(folder) | {"training": training, "moezoo_version": __version__})
        console.print(f"wrote {curves.name} and {rates.name}")
    return training


def plot_action_rates(report, path: str | Path, title: str | None = None) -> Path:
    """The paper's Fig. 9: per layer, the share of each modality's tokens (those present) that skip their routed
    experts and that are dropped, from a forward's `AdaptiveReport`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..configuration.moemb import TOKEN_MODALITIES

    drop = report.token_drop_rate
    panels = {"expert skip rate": report.expert_skip_rate - drop, "token drop rate": drop}
    fig, axes = plt.subplots(1, len(panels), figsize=(9, 3.2), squeeze=False)
    layers = range(drop.shape[0])
    for axis, (name, rates) in zip(axes[0], panels.items()):
        for modality, label in sorted(TOKEN_MODALITIES.items()):
            if not bool(torch.isnan(rates[:, modality]).all()):
                axis.plot(layers, rates[:, modality].tolist(), marker="o", label=label)
        axis.set_title(name)
        axis.set_xlabel("layer")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend()
    title = title or f"efficiency actions per layer and modality (FLOPs saving {report.flops_saving:.1%})"
    return save_figure(fig, path, title)


def add_grpo_arguments(parser) -> None:
    """`moezoo train moemb --grpo` and its options (the Trainer's are `moezoo train moemb`'s)."""
    defaults = GrpoOptions()
    group = parser.add_argument_group(
        "GRPO over the efficiency gates (spec §3.13)",
        "with --grpo, --model is a trained MoEMB (its backbone stays frozen) and only the per-layer efficiency heads "
        "train; --learning_rate defaults to 5e-5; the LoRA, --recipe, --chunk-size and --negatives options do not "
        "apply; GRPOConfig's --num_generations (--rollouts), --temperature, --epsilon, --epsilon_high and "
        "--scale_rewards do",
    )
    group.add_argument("--grpo", action="store_true",
                       help="train the efficiency heads (ROUTE / SKIP / DROP per token and MoE layer) with GRPO")
    group.add_argument("--rollouts", dest="num_generations", type=int, default=argparse.SUPPRESS,
                       help="--num_generations")
    group.add_argument("--lambda-s", type=float, default=defaults.efficiency_weight,
                       help="weight of the FLOPs-saving reward S(a)")
    group.add_argument("--lambda-d", type=float, default=defaults.distillation_weight,
                       help="weight of the distillation reward cos(e_a, e_full)")
    group.add_argument("--reward-gate", choices=REWARD_GATE_MODES, default=defaults.reward_gate_mode,
                       help="what the recall@K gate multiplies: the efficiency reward, or the whole reward")
    group.add_argument("--recall-at", type=int, help="K of the recall gate (default: --rollouts)")
    group.add_argument("--negative-temperature", type=float, default=defaults.negative_temperature,
                       help="temperature of the softmax weighting the in-batch negatives")
    group.add_argument("--rollout-execution", choices=EXECUTION_MODES, default=defaults.execution,
                       help="packed (spec §3.14, the savings become time) or masked (faster on CPU at tiny sizes)")


def run_grpo(args) -> int:
    """`moezoo train moemb --grpo`."""
    from ..terminal import print_table
    from .arguments import trainer_options

    given = {"--chunk-size": args.chunk_size is not None, "--negatives": args.negatives,
             "--adaptive-recipe": getattr(args, "adaptive_recipe", None) is not None}
    misplaced = [flag for flag, present in given.items() if present]
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} do not apply to --grpo, which embeds a batch at once on each "
                         "process and trains only the efficiency heads, by GRPO")  # fmt: skip
    options = GrpoOptions(
        **trainer_options(args, GrpoOptions), efficiency_weight=args.lambda_s, distillation_weight=args.lambda_d,
        reward_gate_mode=args.reward_gate, recall_at=args.recall_at, negative_temperature=args.negative_temperature,
        max_length=args.max_length, execution=args.rollout_execution, dtype=args.dtype,
    )  # fmt: skip
    training = train_moemb_grpo(args.model, args.data, args.out, options, image_root=args.image_root,
                                overwrite=args.overwrite)  # fmt: skip
    print_table("trained", ["key", "value"], [[key, value] for key, value in training.items()])
    return 0
