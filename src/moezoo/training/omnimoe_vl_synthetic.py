"""Synthetic depth tasks for OmniMoE-VL, made in-house (spec omnimoe_vl.md §9.11-9.12, the learning version of the
paper's C.4 access example): the answer is one bit that only one visual depth carries, so a model answers well only
when its route exposes that depth.

Each sample has `num_streams` precomputed visual streams (the `visual_streams` hook: no vision tower) of
`num_patches` patches. Every stream s holds its own random bit b_s, written as `(2 b_s - 1) m + noise` with one
direction m shared by all streams: a mixture of streams is ambiguous unless the route favours the right one.

- Fixed depth (`DepthTask(selected_stream=s)`, §9.11): the answer is always b_s. The prompt is constant.
- Question-selected depth (`DepthTask(selected_stream=None)`, §9.12): a prompt token `SELECT + J` (or its paraphrase
  `PARAPHRASE + J`) asks for b_J. Half of each stream's patches carry the bit, the other half a fixed key vector
  kappa_s: the router queries read a stream only through attention weights (Eq. 6), so a prompt can change the route
  only over streams with spatial structure to attend to.

The token sequence is `[BOS, <image> x num_patches, prompt x 3, SEP, answer]`, the answer `ANSWER + bit`, the only
supervised token; `prompt_mask` marks the three prompt tokens.

Measured on CPU (spec §9.11-9.12 settings): the fixed depth is answered and favoured by the route within a few tens
of steps; the question-selected depth needs the router utility supervision L_util (`router_utility="grad"`): with
it, seeds 0 and 1 reach accuracy >= 0.95 with the route's argmax on the asked stream for most samples within 300-500
steps; without it seed 0 stays below 0.93 accuracy, its route mostly ignoring the question.

`train_depth_task` trains a model on fresh batches (the spec's recipe: AdamW, everything trainable, the routing step
advanced after every optimizer step, as `RoutingStepCallback` does in a Trainer) and `evaluate_depth_task` measures
its accuracy and route.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from ..modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from .omnimoe_vl import advance_routing_step

PAD, BOS, SEP, QUESTION = 0, 1, 3, 4
ANSWER = 10  # + bit
SELECT = 20  # + J: "answer with stream J's bit"
PARAPHRASE = 30  # + J: another token with the same meaning
IMAGE, VISION_START, VISION_END = 60, 61, 62
VOCAB_SIZE = 64


def depth_task_config(num_streams: int = 4, exploration_steps: int = 90, **overrides) -> OmniMoeVlConfig:
    """The spec's model for the depth tasks: the tiny preset with S streams of 16 patches of width 32 (taps at blocks
    1..S of an S-block tower, which the streams hook skips), a 4-layer language model (hidden 64, 4 experts top-2 on
    even layers) with one anchor per stream, top-2 of S depths, fusion groups of 4, and exploration (lambda_h =
    lambda_b = 1, sigma = 0.5) for the first `exploration_steps` routing steps (0: none)."""
    tiny = copy.deepcopy(TINY_OMNIMOE_VL)
    layers = max(4, num_streams)
    config = tiny | dict(
        vision_config=tiny["vision_config"] | dict(num_hidden_layers=num_streams, moe_layers=[0]),
        text_config=tiny["text_config"] | dict(
            vocab_size=VOCAB_SIZE, num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=list(range(1, layers, 2)), max_position_embeddings=64, pad_token_id=PAD,
        ),
        image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        vision_feature_layers=list(range(1, num_streams + 1)), injection_layers=list(range(num_streams)),
        depth_top_k=2, fusion_top_k=2, fusion_group_size=4,
        exploration_steps=exploration_steps, exploration_noise_std=0.5, prior_coef=1.0, underuse_bonus_coef=1.0,
    )  # fmt: skip
    return OmniMoeVlConfig(**(config | overrides))


@dataclass
class DepthTask:
    """Batches of the depth task (see the module docstring).

    Args:
        num_streams / num_patches / stream_width: the streams' shape S, N, d_V.
        selected_stream: s*, the stream whose bit is the answer; None: the prompt selects it.
        signal_norm: the norm of the shared bit direction m (and of the keys kappa_s).
        noise_std: the standard deviation of the Gaussian noise on every patch.
        seed: seeds m and the keys.
    """

    num_streams: int = 4
    num_patches: int = 16
    stream_width: int = 32
    selected_stream: int | None = 2
    signal_norm: float = 3.0
    noise_std: float = 0.7
    seed: int = 0

    def __post_init__(self):
        if self.selected_stream is not None and not 0 <= self.selected_stream < self.num_streams:
            raise ValueError(f"selected_stream must be in [0, {self.num_streams}) or None, got {self.selected_stream}")
        generator = torch.Generator().manual_seed(self.seed)
        direction = torch.randn(self.stream_width, generator=generator)
        self.direction = self.signal_norm * direction / direction.norm()  # m
        keys = torch.randn(self.num_streams, self.stream_width, generator=generator)
        self.keys = self.signal_norm * keys / keys.norm(dim=-1, keepdim=True)  # kappa_s

    def batch(self, batch_size: int, generator: torch.Generator, paraphrase: bool = False) -> dict[str, torch.Tensor]:
        """Model inputs (`input_ids`, `attention_mask`, `prompt_mask`, `visual_streams`, `labels`) and, for scoring,
        `answers` (the answer token) and `selected` (the stream asked about), all of `batch_size` rows."""
        bits = torch.randint(0, 2, (batch_size, self.num_streams), generator=generator)
        if self.selected_stream is None:
            selected = torch.randint(0, self.num_streams, (batch_size,), generator=generator)
        else:
            selected = torch.full((batch_size,), self.selected_stream)
        streams = self.streams(bits, generator)
        if self.selected_stream is None:
            prompt = self.prompt((PARAPHRASE if paraphrase else SELECT) + selected)
        else:
            prompt = self.prompt(torch.full((batch_size,), QUESTION))
        return self.inputs(streams, prompt) | {
            "answers": ANSWER + bits[torch.arange(batch_size), selected],
            "selected": selected,
        }

    def streams(self, bits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B, S) bits -> (B, S, N, d_V) streams."""
        batch_size = bits.shape[0]
        signs = (2 * bits - 1).float()[:, :, None, None]  # (B, S, 1, 1)
        streams = signs * self.direction.expand(batch_size, self.num_streams, self.num_patches, -1).clone()
        if self.selected_stream is None:  # the second half of every stream's patches is its key
            half = self.num_patches // 2
            streams[:, :, half:] = self.keys[None, :, None, :]
        noise = torch.randn(streams.shape, generator=generator)
        return streams + self.noise_std * noise

    @staticmethod
    def prompt(first_tokens: torch.Tensor) -> torch.Tensor:
        """(B,) -> (B, 3): the prompt tokens, `first_tokens` (which stream to answer about, in the question-selected
        task) then the constant question."""
        prompt = torch.full((len(first_tokens), 3), QUESTION)
        prompt[:, 0] = first_tokens
        return prompt

    def inputs(self, streams: torch.Tensor, prompt: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model inputs for `streams` (B, S, N, d_V) and prompt tokens (B, P), up to SEP (`with_answers` appends
        the answer for training)."""
        batch_size = streams.shape[0]
        input_ids = torch.cat([
            torch.full((batch_size, 1), BOS), torch.full((batch_size, self.num_patches), IMAGE), prompt,
            torch.full((batch_size, 1), SEP),
        ], dim=1)  # fmt: skip
        prompt_mask = torch.zeros_like(input_ids)
        prompt_mask[:, 1 + self.num_patches : 1 + self.num_patches + prompt.shape[1]] = 1
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "prompt_mask": prompt_mask,
                "visual_streams": streams}  # fmt: skip


def with_answers(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The training inputs of a `DepthTask.batch`: the answer token appended, and the only label."""
    answers = batch["answers"][:, None]
    input_ids = torch.cat([batch["input_ids"], answers], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -1:] = answers
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "prompt_mask": torch.cat([batch["prompt_mask"], torch.zeros_like(answers)], dim=1),
        "visual_streams": batch["visual_streams"],
        "labels": labels,
    }


@torch.no_grad()
def evaluate_depth_task(
    model: OmniMoeVlForConditionalGeneration, task: DepthTask, num_samples: int = 256, seed: int = 12345
) -> dict:
    """In `eval()` mode (content routing) on `num_samples` fresh samples: `accuracy` (the greedy next token after
    SEP is the answer), `mean_route` (the mean route weight per depth), `argmax_hit` (the share of samples whose
    largest route weight is on the stream asked about) and `support_hit` (the share whose route holds it)."""
    was_training = model.training
    model.eval()
    batch = task.batch(num_samples, torch.Generator().manual_seed(seed))
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "prompt_mask", "visual_streams")}
    outputs = model(**inputs)
    model.train(was_training)
    route = outputs.depth_route
    rows = torch.arange(num_samples)
    return {
        "accuracy": (outputs.logits[:, -1].argmax(dim=-1) == batch["answers"]).float().mean().item(),
        "mean_route": route.mean(dim=0).tolist(),
        "argmax_hit": (route.argmax(dim=-1) == batch["selected"]).float().mean().item(),
        "support_hit": (route[rows, batch["selected"]] > 0).float().mean().item(),
    }


def answers_from_the_depth(evaluation: dict, stream: int, min_accuracy: float = 0.95) -> bool:
    """Spec §9.11's success: an `evaluate_depth_task` result with accuracy >= `min_accuracy` whose largest mean route
    weight is on `stream`."""
    mean_route = evaluation["mean_route"]
    return evaluation["accuracy"] >= min_accuracy and max(range(len(mean_route)), key=mean_route.__getitem__) == stream


@torch.no_grad()
def prompt_route_distances(
    model: OmniMoeVlForConditionalGeneration, task: DepthTask, num_images: int = 64, seed: int = 54321
) -> dict[str, float]:
    """Table 5a's check on the question-selected task: for the same images, the mean total-variation distance
    D_TV(w, w') = 1/2 sum_s |w_s - w'_s| between the routes of prompts that ask for different streams
    (`different_questions`: J and J + 1 mod S), and between two paraphrases of one question (`paraphrases`: SELECT + J
    and PARAPHRASE + J)."""
    if task.selected_stream is not None:
        raise ValueError("prompt_route_distances needs the question-selected task (selected_stream=None)")
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (num_images, task.num_streams), generator=generator)
    streams = task.streams(bits, generator)
    asked = torch.randint(0, task.num_streams, (num_images,), generator=generator)

    def route(first_tokens: torch.Tensor) -> torch.Tensor:
        return model(**task.inputs(streams, task.prompt(first_tokens))).depth_route

    question = route(SELECT + asked)
    other_question = route(SELECT + (asked + 1) % task.num_streams)
    paraphrase = route(PARAPHRASE + asked)
    model.train(was_training)

    def distance(first: torch.Tensor, second: torch.Tensor) -> float:
        return 0.5 * (first - second).abs().sum(dim=-1).mean().item()

    return {"different_questions": distance(question, other_question), "paraphrases": distance(question, paraphrase)}


def train_depth_task(
    model: OmniMoeVlForConditionalGeneration,
    task: DepthTask,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 2e-3,
    seed: int = 0,
    eval_every: int = 0,
    stop: Callable[[dict], bool] | None = None,
) -> list[dict]:
    """AdamW on fresh batches for up to `steps` optimizer steps, everything trainable, the learning rate decaying
    linearly to 0 at `steps` (so that the route settles); the routing step advances after every step. Every
    `eval_every` steps (0: only at the end) `evaluate_depth_task` is recorded with its `step` and the step's training
    `loss`; training stops early at an evaluation for which `stop(evaluation)` is true. Returns the evaluations."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    history = []
    for step in range(1, steps + 1):
        loss = model(**with_answers(task.batch(batch_size, generator))).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        advance_routing_step(model)
        if step == steps or (eval_every and step % eval_every == 0):
            history.append({"step": step, "loss": loss.item(), **evaluate_depth_task(model, task)})
            if stop is not None and stop(history[-1]):
                break
    return history
