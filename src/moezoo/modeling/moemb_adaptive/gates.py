"""MoEMB's trained efficiency modules (spec moemb.md §3.0, §3.1, §3.4, §3.7, §3.10) and the runtime control of a
forward through them (training, GRPO rollouts). Which modules a model has: `MoEmbConfig.gates`
(`moezoo.configuration.moemb_gates.GateModules`); which act at inference: `AdaptiveSettings`.

Modules (created only when `config.gates` asks for them, so other checkpoints are unchanged):

    layers[l].mlp.efficiency_head   EfficiencyHead = Linear(d, 3) on the router input x = RMSNorm_post(h): logits
                                    (ROUTE, SKIP, DROP); DROP is -inf for the pooled token (and text with
                                    `gates.protect_text`)
    layers[l].mlp.null_router       NullRouter: N_null null-expert logits W_null x + b_null, joined to the router's
    layers[l].skip_gate             Linear(d, 1): the layer-skip logit from the pooled token's hidden state
    language_model.token_pruner     TokenPruner: (keep, drop) logits on the hidden state after block `pruner_layer`

Efficiency-head API (what GRPO builds on):

    head(x, drop_allowed)                      (T, 3) fp32 logits, DROP = -inf where `drop_allowed` is False
    action_log_probs(logits, temperature)       (T, 3) log π(a | x) at a sampling temperature
    sample_actions(log_probs, generator)        (T,) actions drawn from them (ROUTE = 0, SKIP = 1, DROP = 2)
    skip_probability(logits)                    p_skip of the (ROUTE, SKIP) sub-softmax (the learned skip gate)

Running a forward with sampled or forced actions, per token and layer (`moezoo.modeling.moemb.controlled_gates`):

    control = GateControl(policy="sample", temperature=1.0, generator=torch.Generator().manual_seed(0))
    with controlled_gates(model, control):
        out = model(**inputs)                   # out.adaptive: logical FLOPs and S(a), per sample too
    control.record.actions                      # (B, S, L) long, input layout; -1 where no decision was taken
    control.record.log_prob_sum                 # (B,) Σ log π of the actions taken, differentiable in the heads
    control.record.decisions                    # (B,) how many decisions each sample took
    replay = GateControl(policy="forced", actions=control.record.actions)  # the same actions, new log-probs

`GateControl(train=True)` runs the trained actions that the adaptive settings select in their differentiable form
(soft fade of the skip gate, Gumbel straight-through pruner with masked attention and Gated DeltaNet, straight-
through layer skip, null experts with their joint logits recorded for the load-balancing loss); what the losses need
is in `control.record`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from ...configuration.moemb_gates import EFFICIENCY_HEAD_INITS, GateModules
from ..moe.balancing import number_of_processes
from ..moe.precision import Fp32Linear, fp32_linear


ROUTE, SKIP, DROP = 0, 1, 2
ACTIONS = ("route", "skip", "drop")
LAYER_SKIP_INIT_BIAS = -4.0  # σ(-4) ≈ 0.018: no block is skipped at step 0


class EfficiencyHead(nn.Linear):
    """Per MoE layer: (ROUTE, SKIP, DROP) logits from the router input, initialised as `init` says (W = 0)."""

    def __init__(self, hidden_size: int, init_name: str):
        self.init_name = init_name
        super().__init__(hidden_size, 3)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.bias.copy_(torch.tensor(EFFICIENCY_HEAD_INITS[self.init_name]))

    def forward(self, x: torch.Tensor, drop_allowed: torch.Tensor) -> torch.Tensor:
        """`(T, 3)` fp32 logits of the tokens `x` `(T, d)`; DROP is -inf where `drop_allowed` `(T,)` is False. A
        forward, so that accelerate's offload hooks bring the weights of an offloaded head. fp32 under autocast too
        (`autocast_off`): GRPO's ratios and the sampled actions read their log-probabilities."""
        logits = fp32_linear(self, x)
        return logits.masked_fill(F.pad(~drop_allowed[:, None], (2, 0)), float("-inf"))


def action_log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`(T, 3)` log-probabilities of ROUTE, SKIP, DROP at a sampling temperature."""
    return torch.log_softmax(logits / temperature, dim=-1)


def sample_actions(log_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`(T,)` one action per token drawn from `log_probs` `(T, 3)`."""
    probs = log_probs.detach().exp().float()
    return torch.multinomial(probs.cpu(), 1, generator=generator).flatten().to(log_probs.device)


def skip_probability(logits: torch.Tensor) -> torch.Tensor:
    """p_skip = softmax(logits[ROUTE, SKIP])[SKIP] (the learned expert-skip gate, spec §3.4)."""
    return torch.softmax(logits[:, :2], dim=-1)[:, 1]


class NullRouter(nn.Module):
    """AdaMoE's N_null null experts (spec §3.7): logits `W_null x + b_null`, W = 0 and b = `bias` at init, so that no
    null expert is selected at step 0. A null expert has no weights and costs nothing."""

    def __init__(self, hidden_size: int, num_null_experts: int, bias: float):
        super().__init__()
        self.initial_bias = bias
        self.weight = nn.Parameter(torch.zeros(num_null_experts, hidden_size))
        self.bias = nn.Parameter(torch.full((num_null_experts,), float(bias)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(T, N_null)` fp32 logits, under autocast too: they join the router's fp32 logits."""
        return fp32_linear(self, x)


def null_expert_slots(
    router_logits: torch.Tensor, top_k_index: torch.Tensor, null_logits: torch.Tensor
) -> torch.Tensor:
    """`(T, k)` bool: the router's top-k physical slots that stay in the joint top-k over the physical and null
    logits (the physical ones selected jointly are a prefix of the physical top-k). Ties go to physical experts."""
    top_k = top_k_index.shape[1]
    joint = torch.cat([router_logits, null_logits], dim=-1)
    selected = torch.topk(joint, top_k, dim=-1, sorted=False).indices
    return (top_k_index[:, :, None] == selected[:, None, :]).any(-1)


class TokenPruner(nn.Sequential):
    """Dynamic-LLaVA's one-shot predictor (spec §3.1, A-17): (keep, drop) logits from h after block n."""

    def __init__(self, hidden_size: int):
        # fp32 layers, under autocast too: the Gumbel keep decision and the keep budget read the logits.
        super().__init__(Fp32Linear(hidden_size, hidden_size // 8), nn.GELU(), Fp32Linear(hidden_size // 8, 2))


class LayerSkipGate(Fp32Linear):
    """q_l = σ(wᵀ h_pooled + b), the probability that a sample skips block l (spec §3.10); W = 0, b = -4 at init.
    fp32 under autocast too: a straight-through threshold at 0.5 reads q."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.bias.fill_(LAYER_SKIP_INIT_BIAS)


def attach_gate_modules(text_model: nn.Module, config) -> None:
    """Creates the modules that `config.gates` (a text config's) asks for and `text_model` (a `MoEmbTextModel`)
    lacks, on the device and in the dtype of its embeddings: at construction, and when a training recipe adds gates
    to a loaded model."""
    gates = GateModules.from_dict(config.gates)
    hidden = config.hidden_size
    reference = text_model.embed_tokens.weight
    new = []
    for layer in text_model.layers:
        if gates.efficiency_head is not None and not hasattr(layer.mlp, "efficiency_head"):
            layer.mlp.efficiency_head = EfficiencyHead(hidden, gates.efficiency_head)
            new.append(layer.mlp.efficiency_head)
        if gates.null_experts and not hasattr(layer.mlp, "null_router"):
            layer.mlp.null_router = NullRouter(hidden, gates.null_experts, gates.null_bias)
            new.append(layer.mlp.null_router)
        if gates.layer_skip and layer.layer_idx in gates.skip_blocks(config.num_hidden_layers):
            if not hasattr(layer, "skip_gate"):
                layer.skip_gate = LayerSkipGate(hidden)
                new.append(layer.skip_gate)
    if gates.token_pruner and not hasattr(text_model, "token_pruner"):
        text_model.token_pruner = TokenPruner(hidden)
        new.append(text_model.token_pruner)
    if reference.device.type != "meta":
        for module in new:
            module.to(reference.device, reference.dtype)


def init_gate_module(module: nn.Module) -> bool:
    """Initialise `module` if it is one of the gates (transformers' `_init_weights`); returns whether it was one.
    The `transformers.initialization` functions skip tensors loaded from a checkpoint."""
    if isinstance(module, EfficiencyHead):
        init.zeros_(module.weight)
        init.copy_(module.bias, torch.tensor(EFFICIENCY_HEAD_INITS[module.init_name]))
        return True
    if isinstance(module, NullRouter):
        init.zeros_(module.weight)
        init.constant_(module.bias, module.initial_bias)
        return True
    if isinstance(module, LayerSkipGate):
        init.zeros_(module.weight)
        init.constant_(module.bias, LAYER_SKIP_INIT_BIAS)
        return True
    return False


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard Gumbel noise of `shape` (fp32, CPU), drawn from `generator`."""
    uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
    return -torch.log(-torch.log(uniform.clamp(1e-10, 1 - 1e-7)))


def gumbel_keep(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None,
                gumbel: torch.Tensor | None = None):  # fmt: skip
    """Gumbel-softmax straight-through keep mask (spec §3.1): `(hard, soft)` where `hard` is the one-hot keep
    decision in the forward with the gradient of the soft keep probability y[keep], and `soft` is y[keep]. `gumbel`:
    the noise, if drawn already (`SharedDraws.noise`); else drawn here from `generator`."""
    gumbel = (gumbel_noise(logits.shape, generator) if gumbel is None else gumbel).to(logits.device)
    soft = torch.softmax((logits.float() + gumbel) / tau, dim=-1)[..., 0]
    hard = (soft > 0.5).float()
    return hard - soft.detach() + soft, soft


def straight_through(probability: torch.Tensor) -> torch.Tensor:
    """1[p > 0.5] in the forward, with the gradient of p."""
    return (probability > 0.5).to(probability.dtype) - probability.detach() + probability


# --- runtime control ------------------------------------------------------------------------------------------------


@dataclass
class GateRecord:
    """What a controlled forward's gates did, for the losses and GRPO (filled by the forward)."""

    alive: torch.Tensor | None = None  # (B, S) the real tokens of the input
    token_segments: torch.Tensor | None = None  # (T,) the sample of each real token (row-major)

    actions: torch.Tensor | None = None  # (B, S, L) long, input layout: the efficiency head's actions, -1 = none
    log_prob_sum: torch.Tensor | None = None  # (B,) Σ log π(a) of the actions taken (policy forwards)
    decisions: torch.Tensor | None = None  # (B,) decisions taken per sample (policy forwards)
    # Per MoE layer, over its routed tokens (row-major): p_skip (0 for the pooled token) and the tokens that decide.
    skip_probability: list = field(default_factory=list)
    skip_candidates: list = field(default_factory=list)
    # The pruner's (B, S): soft keep probability and straight-through keep mask (1 off the candidates), candidates.
    keep_probability: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None
    keep_candidates: torch.Tensor | None = None
    layer_skip_probability: dict = field(default_factory=dict)  # block -> (B,) q_l (soft), per sample
    layer_skip_mask: dict = field(default_factory=dict)  # block -> (B,) straight-through skip decision
    joint_router_logits: list = field(default_factory=list)  # per MoE layer: (T_l, E + N_null) for the LB loss
    physical_experts: list = field(default_factory=list)  # per MoE layer: (T_l,) physical experts run per token


@dataclass
class SharedDraws:
    """The random draws of a forward made as for a larger batch, of which the forward's input rows are `rows`: each
    row's Gumbel noise `(positions, channels)` comes from a generator of its own, seeded by one number drawn from the
    shared generator (which so advances the same whatever rows the forward holds) plus the row's index in the larger
    batch; a token reads its row's noise at its position (right padding: its input column), which does not depend on
    how long the batch is. The sampled actions take argmax(log π + noise) at every MoE layer (Gumbel-max: a draw from
    π), the pruner's Gumbel keep its noise. Data-parallel processes that share a generator state and pass their rows
    of the global batch (`global_batch`) draw for every token what one process on the global batch would, each
    drawing its own rows' noise only: the draws depend neither on which process holds an input nor on its batch
    neighbours."""

    rows: torch.Tensor  # (B,) long: each input row's row in the larger batch

    @classmethod
    def global_batch(cls, block_rows: int, blocks: int) -> SharedDraws:
        """The draws of a forward over `blocks` consecutive blocks of `block_rows` inputs, each block this process's
        share of a block of the global batch (the data loader gives process p its rows p·B to p·B + B − 1): rows
        block·B_g + p·B + b, B_g = world size × B."""
        world_size = number_of_processes()
        rank = dist.get_rank() if world_size > 1 else 0
        block, row = torch.meshgrid(torch.arange(blocks), torch.arange(block_rows), indexing="ij")
        return cls(rows=(block * world_size * block_rows + rank * block_rows + row).flatten())

    def noise(self, generator: torch.Generator | None, positions: int, channels: int) -> torch.Tensor:
        """`(B, positions, channels)` Gumbel noise of this forward's rows."""
        seed = int(torch.randint(2**62, (), generator=generator))
        return torch.stack([gumbel_noise((positions, channels), torch.Generator().manual_seed(seed + int(row)))
                            for row in self.rows])  # fmt: skip

    def actions(self, log_probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor,
                columns: torch.Tensor, positions: int) -> torch.Tensor:  # fmt: skip
        """`(T,)` actions of the tokens at input `rows` and `columns` (of `positions`) from their `log_probs`
        `(T, 3)`."""
        noise = self.noise(generator, positions, log_probs.shape[-1])
        return (log_probs.detach().float() + noise[rows.cpu(), columns.cpu()].to(log_probs.device)).argmax(-1)


@dataclass
class GateControl:
    """How the trained gates act in one forward (see the module docstring).

    train: run the selected actions in their differentiable form (training).
    gumbel_temperature: τ_g of the pruner's Gumbel softmax (annealed by the trainer).
    policy: None, "sample" (actions drawn from the efficiency heads) or "forced" (`actions` replayed).
    temperature: the sampling temperature of the heads (T_s).
    actions: `(B, S, L)` long, "forced": the action of every token (input layout) at every layer, -1 where none.
    generator: the random source of the samples and the Gumbel noise (CPU).
    draws: draw the sampled actions and the Gumbel noise for a larger batch (`SharedDraws`), not the forward's alone.
    """

    train: bool = False
    gumbel_temperature: float = 1.0
    policy: str | None = None
    temperature: float = 1.0
    actions: torch.Tensor | None = None
    generator: torch.Generator | None = None
    draws: SharedDraws | None = None
    record: GateRecord = field(default_factory=GateRecord)

    def __post_init__(self):
        if self.policy not in (None, "sample", "forced"):
            raise ValueError(f"GateControl.policy={self.policy!r} must be None, 'sample' or 'forced'")
        if self.policy == "forced" and self.actions is None:
            raise ValueError("GateControl.policy='forced' needs the actions to replay (GateControl.actions)")
        if not self.temperature > 0 or not self.gumbel_temperature > 0:
            raise ValueError("GateControl.temperature and gumbel_temperature must be > 0")
