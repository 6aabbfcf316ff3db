"""Training MoEMB's trained efficiency gates (spec moemb.md §3.1, §3.4, §3.7, §3.10, §3.12, §7.3):
`moezoo train moemb --adaptive-recipe NAME`, on the contrastive trainer of `moezoo.training.moemb` (the gates train
beside its LoRA adapters; the backbone stays frozen).

    token_pruner           one-shot pruner after block n: Gumbel straight-through, τ 4 -> 0.5, masked attention and
                           Gated DeltaNet; L1 budget |ρ_keep - ρ*| (0.5, off for the first 15%), L2 distillation (1.0),
                           the pruner's learning rate 40x
    skip_gate              the efficiency heads' (ROUTE, SKIP) sub-softmax, soft fade; λ_c (1 - ρ_skip), λ_c = 0.02
                           held at 0 for 15% of the steps then ramped over 5%
    adamoe                 N_null null experts (W = 0, b = -8) in a joint top-k, renormalised over the physical experts;
                           load balancing over all E + N_null candidates, 0.02 for the first half, then 1e-4; the
                           physical router rows frozen
    layer_skip             per-block gates on the pooled token, straight-through; (ρ_layer - ρ*)² (1.0), L2
                           distillation (1.0)
    combined_global        pruner + skip gate + layer skip, λ_f (E[FLOPs] / FLOPs_full - b)_+ (one FLOPs budget)
    combined_simultaneous  the same gates, Σ_a λ_a (ρ_a - ρ*_a)² (targets drop 0.7, skip 0.3, layer 0.2)
    combined_alternating   the same loss, one gate updated per step (the others' gradients dropped)
    combined_sequential    drop, then skip, then layer skip, each frozen once its realised rate reaches its target

Rates: ρ_keep is the mean soft keep probability of the visual tokens, ρ_skip the mean p_skip over the tokens and
layers (a global budget), ρ_layer the share of (sample, eligible block) pairs skipped. The distillation target is the
full-compute embedding of a frozen copy of the starting model (computed beside each batch rather than cached), as
mean ||e - e_full||² of the normalised embeddings. E[FLOPs] is the language model's (the vision tower runs in full
whatever the gates decide), from the per-token costs of `moemb_flops`. The saved model's config holds the gates and
the inference settings that use them (hard decisions), so the exported folder runs them; the rates are logged as
`rate/*` and drawn in `adaptive_rates.png`.

On several processes (DDP, `--fsdp`, `--ep`) every rate, FLOPs ratio and load-balancing statistic is the global
batch's (`global_mean`), and the pruner's Gumbel noise of each input is what one process on the global batch would
draw for it (`SharedDraws`, from a generator every process seeds alike): the run trains as one process on the
global batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from transformers import Trainer

from ..configuration.moemb_adaptive import AdaptiveSettings
from ..configuration.moemb_gates import GateModules
from ..modeling.moe.balancing import number_of_processes, sum_over_processes
from ..modeling.moe.losses import load_balancing_loss
from ..modeling.moemb import controlled_gates
from ..modeling.moemb_adaptive.gates import GateControl, SharedDraws, attach_gate_modules
from ..modeling.moemb_flops import TokenLayerFlops
from .adapted_sharding import with_every_trainable_parameter
from .plots import plot_log_history


# The gate of each action: (its parameters' name marker, its realised rate's log key).
ACTIONS = {
    "drop": ("token_pruner", "rate/token_drop"),
    "skip": ("efficiency_head", "rate/expert_skip"),
    "layer": ("skip_gate", "rate/layer_skip"),
    "null": ("null_router", "rate/physical_experts"),
}
COMBINED_GATES = {"token_pruner": True, "efficiency_head": "skip_gate", "layer_skip": True}
COMBINED_TRAINING = {"token_pruning": "learned", "expert_skip": "learned", "layer_skip": "learned"}


@dataclass(frozen=True)
class GateRecipe:
    """One recipe as data: the gates it adds, the actions it trains, its training-time and saved (inference)
    adaptive settings, and its loss."""

    gates: dict
    actions: tuple[str, ...]
    training: dict  # the adaptive settings of the training forwards
    inference: dict  # what the saved config's `adaptive` holds
    budget: str  # "keep_l1", "skip_linear", "load_balance", "layer_squared", "flops", "per_action"
    distill: bool = False
    schedule: str = "simultaneous"  # "simultaneous", "alternating" or "sequential"


RECIPES = {
    "token_pruner": GateRecipe({"token_pruner": True}, ("drop",), {"token_pruning": "learned"},
                               {"token_pruning": "learned"}, "keep_l1", distill=True),
    "skip_gate": GateRecipe({"efficiency_head": "skip_gate"}, ("skip",), {"expert_skip": "learned"},
                            {"expert_skip": "learned"}, "skip_linear"),
    "adamoe": GateRecipe({}, ("null",), {"top_k": "null_experts"}, {"top_k": "null_experts"}, "load_balance"),
    "layer_skip": GateRecipe({"layer_skip": True}, ("layer",), {"layer_skip": "learned"}, {"layer_skip": "learned"},
                             "layer_squared", distill=True),
    "combined_global": GateRecipe(COMBINED_GATES, ("drop", "skip", "layer"), COMBINED_TRAINING, COMBINED_TRAINING,
                                  "flops"),
    "combined_simultaneous": GateRecipe(COMBINED_GATES, ("drop", "skip", "layer"), COMBINED_TRAINING,
                                        COMBINED_TRAINING, "per_action"),
    "combined_alternating": GateRecipe(COMBINED_GATES, ("drop", "skip", "layer"), COMBINED_TRAINING,
                                       COMBINED_TRAINING, "per_action", schedule="alternating"),
    "combined_sequential": GateRecipe(COMBINED_GATES, ("drop", "skip", "layer"), COMBINED_TRAINING, COMBINED_TRAINING,
                                      "per_action", schedule="sequential"),
}  # fmt: skip


@dataclass
class AdaptiveRecipeOptions:
    """The options of `--adaptive-recipe` (spec §7.3 defaults; λ = 1.0 where the paper gives none, A-27).

    recipe: one of `RECIPES`.
    keep_target: ρ*, the share of visual tokens the pruner keeps ("token_pruner").
    drop_target / skip_target / layer_skip_target: the per-action targets (the combined recipes; layer_skip_target
        also "layer_skip").
    flops_budget: b, the FLOPs fraction of full compute "combined_global" aims at.
    budget_weight: the budget term's weight (default: the recipe's: 0.5, 0.02, 1.0).
    distill_weight: the L2 distillation weight ("token_pruner", "layer_skip").
    budget_warmup: the share of the steps before the budget acts (15%); skip_gate then ramps it over `budget_ramp`.
    gumbel_start / gumbel_end / gumbel_steps: the pruner's τ, annealed linearly over at most `gumbel_steps` steps.
    pruner_lr_scale: the pruner's learning rate over the others'.
    null_experts: N_null ("adamoe"; default: the model's number of experts, the paper's 256 for 256).
    load_balance_weights: the load-balancing weight in the first and the second half ("adamoe").
    pruner_layer: n, the block after which the pruner decides.
    protect_text: the efficiency heads never DROP text tokens.
    """

    recipe: str = "skip_gate"
    keep_target: float = 0.30
    drop_target: float = 0.70
    skip_target: float = 0.30
    layer_skip_target: float = 0.20
    flops_budget: float = 0.70
    budget_weight: float | None = None
    distill_weight: float = 1.0
    budget_warmup: float = 0.15
    budget_ramp: float = 0.05
    gumbel_start: float = 4.0
    gumbel_end: float = 0.5
    gumbel_steps: int = 2000
    pruner_lr_scale: float = 40.0
    null_experts: int | None = None
    load_balance_weights: tuple[float, float] = (0.02, 1e-4)
    pruner_layer: int = 2
    protect_text: bool = False

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"--adaptive-recipe {self.recipe!r} is not one of {', '.join(RECIPES)}")
        for name in ("keep_target", "drop_target", "skip_target", "layer_skip_target", "flops_budget",
                     "budget_warmup", "budget_ramp"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"adaptive recipe option {name}={value!r} must lie in [0, 1)")
        for name in ("gumbel_start", "gumbel_end", "pruner_lr_scale", "distill_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"adaptive recipe option {name}={getattr(self, name)!r} must be > 0")
        if self.budget_weight is not None and not self.budget_weight >= 0:
            raise ValueError(f"adaptive recipe option budget_weight={self.budget_weight!r} must be >= 0")
        if self.null_experts is not None and not (isinstance(self.null_experts, int) and self.null_experts > 0):
            raise ValueError(f"adaptive recipe option null_experts={self.null_experts!r} must be a positive integer")

    @property
    def spec(self) -> GateRecipe:
        return RECIPES[self.recipe]

    def target(self, action: str) -> float:
        return {"drop": self.drop_target, "skip": self.skip_target, "layer": self.layer_skip_target}[action]


def global_mean(total: torch.Tensor, count) -> torch.Tensor:
    """The mean over every process's items, of which this process holds `count` summing to `total`: the global
    batch's value on every process, differentiable in this process's share as world size times its own (as SMoES's
    P_e is), so that the processes' averaged gradients (DDP, FSDP2) are one process's on the global batch. Without
    torch.distributed, `total / count`."""
    count = torch.as_tensor(count, dtype=torch.float32, device=total.device)
    sums = sum_over_processes(torch.stack([total.detach().float(), count]))
    return (sums[0] + number_of_processes() * (total - total.detach())) / sums[1]


class GateTraining:
    """A recipe applied to one model: adds its gates, makes them trainable, and computes its loss terms."""

    def __init__(self, options: AdaptiveRecipeOptions):
        self.options = options
        self.recipe = options.spec
        self.teacher = None
        self.costs = self.config = None  # set by add_gates

    def add_gates(self, model: nn.Module, teacher: nn.Module | None = None) -> None:
        """Adds the recipe's gates to a loaded `MoEmbForEmbedding` (and keeps a frozen copy of it, the
        distillation teacher, unless given `teacher`, the same model loaded apart); its config then holds them and
        the inference settings that use them."""
        config = model.config
        if self.recipe.distill:
            self.teacher = (copy.deepcopy(model) if teacher is None else teacher).eval().requires_grad_(False)
        gates = config.gate_modules().to_dict() | dict(self.recipe.gates)
        if self.recipe.actions == ("null",):
            if config.router_trainable:
                raise ValueError(
                    "--adaptive-recipe adamoe keeps the physical router rows frozen: do not pass --train-router"
                )
            gates["null_experts"] = self.options.null_experts or config.text_config.num_experts
        if "drop" in self.recipe.actions:
            gates["pruner_layer"] = self.options.pruner_layer
        if "skip" in self.recipe.actions:
            gates["protect_text"] = self.options.protect_text
        gates = GateModules.from_dict(gates)
        gates.validate(config.text_config.num_hidden_layers, config.moe_variant)
        settings = AdaptiveSettings.from_dict(dict(self.recipe.inference))
        config.gates = config.text_config.gates = gates.to_dict()
        config.adaptive = settings.to_dict()
        config.validate_fields()  # names the option an unsuitable model refuses
        attach_gate_modules(model.model.language_model, config.text_config)
        self.costs = TokenLayerFlops.from_config(config)
        self.config = config

    def set_trainable(self, model: nn.Module) -> nn.Module:
        """The recipe's gate parameters train (beside what the contrastive trainer trains)."""
        for name, parameter in model.named_parameters():
            if any(ACTIONS[action][0] in name for action in self.recipe.actions):
                parameter.requires_grad_(True)
        return model

    def gate_parameters(self, model: nn.Module, action: str) -> list[nn.Parameter]:
        return [p for name, p in model.named_parameters() if ACTIONS[action][0] in name]

    # --- one training step ---

    def gumbel_temperature(self, step: int, total: int) -> float:
        options = self.options
        span = max(1, min(options.gumbel_steps, total))
        progress = min(1.0, step / span)
        return options.gumbel_start + progress * (options.gumbel_end - options.gumbel_start)

    def embed(self, model: nn.Module, chunk: dict, step: int, total: int, generator: torch.Generator | None = None):
        """The embeddings of a training forward with the gates in their differentiable form, and its record. The
        pruner's Gumbel noise comes from `generator`, drawn for the global batch (`SharedDraws`)."""
        draws = SharedDraws.global_batch(chunk["input_ids"].shape[0], 1)
        control = GateControl(train=True, gumbel_temperature=self.gumbel_temperature(step, total), generator=generator,
                              draws=draws)  # fmt: skip
        with controlled_gates(model, control):
            embeddings = model(**chunk, adaptive=dict(self.recipe.training, execution="masked")).embeddings
        return embeddings, control.record

    @torch.no_grad()
    def teacher_embeddings(self, chunk: dict) -> torch.Tensor:
        return self.teacher(**chunk, adaptive={}).embeddings

    def rates(self, records: list) -> dict[str, torch.Tensor]:
        """The differentiable rates (`soft/*`) and the realised ones (`rate/*`) of a step's forwards, the global
        batch's (`global_mean`)."""
        rates = {}

        def mean(values: torch.Tensor) -> torch.Tensor:
            return global_mean(values.float().sum(), values.numel())

        if "drop" in self.recipe.actions:
            soft = torch.cat([r.keep_probability[r.keep_candidates] for r in records])
            hard = torch.cat([r.keep_mask[r.keep_candidates] for r in records])
            rates["soft/keep"], rates["rate/token_drop"] = mean(soft), 1 - mean(hard.detach())
        if "skip" in self.recipe.actions:
            p = torch.cat([p[c] for r in records for p, c in zip(r.skip_probability, r.skip_candidates)])
            rates["soft/skip"], rates["rate/expert_skip"] = mean(p), mean(p.detach() > 0.5)
        if "layer" in self.recipe.actions:
            mask = torch.cat([m for r in records for m in r.layer_skip_mask.values()])
            rates["soft/layer"], rates["rate/layer_skip"] = mean(mask), mean(mask.detach())
        if "null" in self.recipe.actions:
            physical = torch.cat([p for r in records for p in r.physical_experts])
            rates["rate/physical_experts"] = mean(physical)
        return rates

    def budget_loss(self, records: list, rates: dict, step: int, total: int, active: tuple[str, ...]) -> torch.Tensor:
        options, budget = self.options, self.recipe.budget
        progress = step / max(1, total)
        weight = options.budget_weight
        if budget == "keep_l1":
            weight = 0.5 if weight is None else weight
            return (progress >= options.budget_warmup) * weight * (rates["soft/keep"] - options.keep_target).abs()
        if budget == "skip_linear":
            late = progress - options.budget_warmup
            ramp = late / options.budget_ramp if options.budget_ramp else float(late >= 0)
            weight = (0.02 if weight is None else weight) * min(1.0, max(0.0, ramp))
            return weight * (1 - rates["soft/skip"])
        if budget == "load_balance":
            first, second = options.load_balance_weights
            logits = [logits for r in records for logits in r.joint_router_logits]
            candidates = logits[0].shape[-1]
            balance = load_balancing_loss(logits, candidates, self.costs.experts_per_token, over_processes=True)
            return (first if progress < 0.5 else second) * balance
        if budget == "layer_squared":
            weight = 1.0 if weight is None else weight
            return weight * (rates["soft/layer"] - options.layer_skip_target) ** 2
        weight = 1.0 if weight is None else weight
        if budget == "flops":
            ratio = torch.stack([self.expected_flops_ratio(r) for r in records]).mean()
            rates["rate/flops_ratio"] = ratio.detach()
            return weight * F.relu(ratio - options.flops_budget)
        soft = {"drop": 1 - rates["soft/keep"], "skip": rates["soft/skip"], "layer": rates["soft/layer"]}
        return weight * sum((soft[action] - options.target(action)) ** 2 for action in active)

    def expected_flops_ratio(self, record) -> torch.Tensor:
        """E[FLOPs] / FLOPs_full of the language model in one forward (of every process: `global_mean`),
        differentiable in the gates' probabilities: Σ_tℓ keep_tℓ (1 - q_ℓ) [f_mixer(ℓ) + f_sh + (1 - p^skip_tℓ) f_rt]
        over the same sum at full compute (attention's context term left out)."""
        costs, text = self.costs, self.config.text_config
        num_tokens, num_layers = record.token_segments.numel(), text.num_hidden_layers
        device = record.token_segments.device
        # (L, T) over the real tokens, row-major: every layer routes them all in masked execution.
        p_skip = torch.zeros(num_layers, num_tokens, device=device)
        if record.skip_probability:
            p_skip = torch.stack(record.skip_probability)
        keep = torch.ones(num_tokens, device=device)
        if record.keep_probability is not None:
            keep = record.keep_probability[record.alive]
        after_pruning = torch.arange(text.num_hidden_layers, device=p_skip.device) > self.options.pruner_layer
        reach = torch.where(after_pruning[:, None], keep[None], 1.0)  # (L, T)
        skipped_block = torch.zeros_like(p_skip)
        for layer, q in record.layer_skip_probability.items():
            skipped_block[layer] = q[record.token_segments]
        mixer = torch.tensor(
            [costs.attention_projections if kind == "full_attention" else
             costs.gated_delta_net_projections + costs.gated_delta_net_recurrence for kind in text.layer_types],
            device=p_skip.device,
        )[:, None]  # fmt: skip
        routed = costs.experts_per_token * costs.routed_expert + costs.router
        cost = reach * (1 - skipped_block) * (mixer + costs.shared_expert + (1 - p_skip) * routed)
        full = num_tokens * (mixer + costs.shared_expert + routed).sum()
        return global_mean(cost.sum(), full)

    def finish(self, log_history: list, folder: Path) -> dict:
        """Draws the rates beside the model; what the training record says of the recipe."""
        panels = {"token drop rate": "rate/token_drop", "expert skip rate": "rate/expert_skip",
                  "layer skip rate": "rate/layer_skip", "physical experts per token": "rate/physical_experts",
                  "FLOPs / full (language model)": "rate/flops_ratio", "budget loss": "budget_loss"}  # fmt: skip
        plot_log_history(log_history, panels, folder / "adaptive_rates.png", title=f"MoEMB {self.options.recipe}")
        last = {key: round(log[key], 4) for log in log_history for key in log if key.startswith("rate/")}
        return {"adaptive_recipe": self.options.recipe, "adaptive_settings": self.config.adaptive,
                "gates": self.config.gates, **last}  # fmt: skip


class GateRecipeTrainer(Trainer):
    """The contrastive trainer's loss plus the recipe's budget and distillation terms; the recipe's schedules
    (alternating, sequential) act on the gates' gradients. Mixed into `MoEmbTrainer` by `recipe_trainer`."""

    def __init__(self, *args, gate_training: GateTraining, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate_training = gate_training
        # The pruner's Gumbel noise: the same draws on every process (`SharedDraws`), whatever else draws numbers.
        self.generator = torch.Generator().manual_seed(self.args.seed)
        self.sequential_stage = 0
        self.logged_rates: dict[str, list[float]] = {}

    def active_actions(self) -> tuple[str, ...]:
        actions, schedule = self.gate_training.recipe.actions, self.gate_training.recipe.schedule
        if schedule == "alternating":
            return (actions[self.state.global_step % len(actions)],)
        if schedule == "sequential":
            return (actions[min(self.sequential_stage, len(actions) - 1)],)
        return actions

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.gate_training
        step, total = self.state.global_step, max(1, self.state.max_steps)
        embeddings, records, distill = {}, [], []
        for side in ("query", "target", "negative"):
            if side not in inputs:
                continue
            parts = []
            for chunk in inputs[side]:
                part, record = training.embed(model, chunk, step, total, self.generator)
                parts.append(part)
                records.append(record)
                if training.teacher is not None:
                    distill.append(((part - training.teacher_embeddings(chunk)) ** 2).sum(-1))
            embeddings[side] = torch.cat(parts)
        loss = with_every_trainable_parameter(self.contrastive_loss(embeddings, inputs), model)
        active = self.active_actions()
        rates = training.rates(records)
        budget = training.budget_loss(records, rates, step, total, active)
        loss = loss + budget
        if distill:
            loss = loss + training.options.distill_weight * torch.cat(distill).mean()
        self.remember({"budget_loss": float(budget), **{k: float(v) for k, v in rates.items() if k[:5] == "rate/"}})
        if training.recipe.schedule == "sequential":
            self.advance_sequence(rates)
        return (loss, embeddings) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.gate_training.recipe.schedule != "simultaneous":  # the frozen gates keep their values
            frozen = [a for a in self.gate_training.recipe.actions if a not in self.active_actions()]
            for action in frozen:
                for parameter in self.gate_training.gate_parameters(model, action):
                    parameter.grad = None
        return loss

    def advance_sequence(self, rates: dict) -> None:
        """Sequential schedule: the current gate freezes once its realised rate reaches its target."""
        actions = self.gate_training.recipe.actions
        if self.sequential_stage >= len(actions):
            return
        action = actions[self.sequential_stage]
        if float(rates[ACTIONS[action][1]]) >= self.gate_training.options.target(action):
            self.sequential_stage += 1

    def remember(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.logged_rates.setdefault(key, []).append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.logged_rates:  # the mean over the steps since the last log
            logs = logs | {key: sum(values) / len(values) for key, values in self.logged_rates.items()}
            self.logged_rates = {}
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """AdamW as the Trainer builds it, with the pruner's learning rate scaled (spec §3.1: 40x). Under `--fsdp` /
        `--ep` each group is split into the sharded parameters (DTensors) and those kept whole (the layer-skip gates):
        the fused AdamW steps a group's parameters together and cannot mix them."""
        scale = self.gate_training.options.pruner_lr_scale
        model = self.model if model is None else model
        if self.optimizer is None and "drop" in self.gate_training.recipe.actions and scale != 1:
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            pruner = [p for name, p in named if ACTIONS["drop"][0] in name]
            others = [p for name, p in named if ACTIONS["drop"][0] not in name]
            optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
            self.optimizer = optimizer_cls(
                [{"params": others, "weight_decay": self.args.weight_decay},
                 {"params": pruner, "weight_decay": self.args.weight_decay, "lr": self.args.learning_rate * scale}],
                **kwargs,
            )  # fmt: skip
        optimizer = super().create_optimizer(model)
        groups = []
        for group in optimizer.param_groups:
            sharded = [p for p in group["params"] if isinstance(p, DTensor)]
            whole = [p for p in group["params"] if not isinstance(p, DTensor)]
            groups += [group | {"params": sharded}, group | {"params": whole}] if sharded and whole else [group]
        optimizer.param_groups = groups
        return optimizer


def recipe_trainer(base: type[Trainer]) -> type[Trainer]:
    """`base` (the contrastive trainer, whose `contrastive_loss` the recipe adds to) with the recipe's steps."""
    return type(f"Gated{base.__name__}", (GateRecipeTrainer, base), {})


def add_recipe_arguments(parser) -> None:
    defaults = AdaptiveRecipeOptions()
    group = parser.add_argument_group("trained efficiency gates (spec §3.1-3.12)")
    group.add_argument("--adaptive-recipe", choices=list(RECIPES),
                       help="train efficiency gates with this recipe beside the contrastive LoRA training; the saved "
                            "config holds the gates and turns them on")  # fmt: skip
    for name, help_text in (
        ("keep_target", "token_pruner: share of visual tokens kept"),
        ("drop_target", "combined: target share of visual tokens dropped"),
        ("skip_target", "combined: target share of tokens that skip their routed experts"),
        ("layer_skip_target", "layer_skip, combined: target share of blocks skipped"),
        ("flops_budget", "combined_global: target FLOPs as a fraction of full compute"),
    ):
        group.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name), help=help_text)
    group.add_argument("--budget-weight", type=float, help="the budget term's weight (default: the recipe's)")
    group.add_argument("--null-experts", type=int, help="adamoe: null experts per layer (default: the experts')")
    group.add_argument("--protect-text", action="store_true", help="the efficiency heads never drop text tokens")


def recipe_options(args) -> AdaptiveRecipeOptions | None:
    if args.adaptive_recipe is None:
        return None
    return AdaptiveRecipeOptions(
        recipe=args.adaptive_recipe, keep_target=args.keep_target, drop_target=args.drop_target,
        skip_target=args.skip_target, layer_skip_target=args.layer_skip_target, flops_budget=args.flops_budget,
        budget_weight=args.budget_weight, null_experts=args.null_experts, protect_text=args.protect_text,
    )  # fmt: skip
