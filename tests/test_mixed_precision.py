"""Mixed precision that is correct, not merely accepted (issue 27, item 2), on CPU, where bf16 autocast runs too.

Under `torch.autocast("cpu", torch.bfloat16)`, what the Trainer's `bf16=True` wraps every forward in (checked below
on a recipe run), a matmul runs in bf16 whatever its inputs' dtype. For every architecture the fp32 numerics stay
fp32 (router logits of the zoo's routers and of the SMoES hosts' transformers routers, the logits of every other gate:
OmniMoE-VL's depth scores and participation gate, MoEMB's trained gates; balancing and SMoES terms, OmniMoE-VL's
depth route and route objectives, contrastive logits), the training loss is within bf16's tolerance of
fp32's on the same batch, and gradients reach the same parameters. Loaded in bf16 (`dtype=torch.bfloat16`, a recipe's
`dtype="bfloat16"`), the fp32 buffers stay fp32. Every train recipe run through its Trainer with `--bf16 --dtype
bfloat16` (`RECIPE_RUNS`) trains under autocast, saves a bf16 folder but for its fp32 buffers and loads it back in bf16.

The loss tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). The tiny models' losses go through
2-4 blocks of rounded matmuls whose errors add up like a random walk, while the routers, in fp32, pick the same
experts but at near-ties: a relative 2% (about ten unit roundoffs) holds them, where a loss computed from bf16
router logits or bf16 contrastive logits at a logit scale of 50-100 is off by more on these batches.
"""

import copy
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from safetensors import safe_open

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.configuration.smoes_settings import SmoesSettings
from moezoo.modeling.moe.router import TopKRouter
from moezoo.modeling.moemb_adaptive.gates import EfficiencyHead, LayerSkipGate, NullRouter, TokenPruner
from moezoo.modeling.omnimoe_vl_projector import OmniMoeVlDepthScore, OmniMoeVlQuerySynthesis
from moezoo.modeling.smoes.common import Fp32RouterMixin
from moezoo.registry import get_architecture
from moezoo.training import moe_vie, moemb, moemb_grpo, mote, omnimoe_vl, smoes
from moezoo.training.arguments import mirrored_fields
from moezoo.training.moemb_adaptive import AdaptiveRecipeOptions
from moezoo.zoo import create_from_preset

from test_moemb_grpo import batch, model  # noqa: F401  (fixtures, used by the GRPO test)
from test_moemb_trained_gates import inputs  # noqa: F401  (a fixture, used by the adaptive recipes' test)

BF16_LOSS_RTOL = 2e-2

PRESETS = ("tiny-moe_vie", "tiny-moemb", "tiny-mote-llama", "tiny-mote", "tiny-omnimoe_vl", "tiny-smoes",
           "tiny-smoes-qwen3-vl-moe")  # fmt: skip


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("mixed-precision")
    return {preset: create_from_preset(preset, root / preset) for preset in PRESETS}


def load(folder, **kwargs):
    from transformers import AutoConfig

    return get_architecture(AutoConfig.from_pretrained(folder).model_type).model_class().from_pretrained(folder, **kwargs)


# --- one training forward per architecture, its loss and the tensors that must stay fp32 ---------------------------


def shapes_examples(count: int):
    from moezoo.training.synthetic import ColouredShapes

    return ColouredShapes(image_size=16).image_text_dataset(count, torch.Generator().manual_seed(0))


def mmeb_pairs():
    from moezoo.training.moemb_synthetic import ShapeRetrieval

    return ShapeRetrieval().training_dataset(4, torch.Generator().manual_seed(0))


def procedure_clips():
    from moezoo.training.mote_synthetic import ProcedureVideos

    return ProcedureVideos().dataset({"step": 2, "next": 2}, torch.Generator().manual_seed(0))


def vqa_examples():
    from datasets import Dataset
    from test_omnimoe_vl_training import examples

    return Dataset.from_list(examples(4))


def moe_vie_step(model, folder):
    from moezoo.processors.moe_vie import MoeVieProcessor
    from moezoo.training.moe_vie import ImageTextCollator

    batch = ImageTextCollator(MoeVieProcessor.from_pretrained(folder))(list(shapes_examples(4)))
    outputs = model(**batch, return_loss=True)
    return outputs.loss, {"logits_per_image": outputs.logits_per_image, "aux_loss": outputs.aux_loss}


def moemb_step(model, folder, smoes: bool = False):
    from moezoo.processors.moemb import MoEmbProcessor
    from moezoo.training.moemb import MoEmbCollator, info_nce_loss, load_mmeb_dataset

    data = load_mmeb_dataset(mmeb_pairs())
    batch = MoEmbCollator(MoEmbProcessor.from_pretrained(folder))([data[i] for i in range(4)])
    queries, targets = model(**batch["query"][0]), model(**batch["target"][0])
    loss = info_nce_loss(queries.embeddings, targets.embeddings, model.config.logit_scale)
    watched = {"contrastive_logits": model.contrastive_logits(queries.embeddings, targets.embeddings)}
    if smoes:
        loss = loss + queries.aux_loss + targets.aux_loss
        watched |= {"aux_loss": queries.aux_loss, "smoes_mi": queries.smoes_mi}
    return loss, watched


def mote_step(model, folder):
    routes = torch.tensor([model.route_id("step"), model.route_id("next")])
    input_ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 8, 9, 10, 11, 12]])
    outputs = model(input_ids=input_ids, labels=input_ids, task_ids=routes)
    return outputs.loss, {}


def omnimoe_vl_step(model, folder):
    from test_omnimoe_vl_training import examples

    from moezoo.processors.omnimoe_vl import OmniMoeVlProcessor
    from moezoo.training.omnimoe_vl import OmniMoeVlCollator

    outputs = model(**OmniMoeVlCollator(OmniMoeVlProcessor.from_pretrained(folder))(examples(4)),
                    output_router_logits=True)  # fmt: skip
    watched = {"depth_route": outputs.depth_route, "depth_scores": outputs.depth_scores, "aux_loss": outputs.aux_loss,
               "routing_loss": outputs.routing_loss, **outputs.routing_losses}  # fmt: skip
    return outputs.loss, watched | ({"smoes_mi": outputs.smoes_mi} if outputs.smoes_mi is not None else {})


def smoes_step(model, folder):
    from moezoo.processors.smoes import SmoesQwen3_5MoeProcessor
    from moezoo.training.smoes import SmoesCollator

    outputs = model(**SmoesCollator(SmoesQwen3_5MoeProcessor.from_pretrained(folder))(list(shapes_examples(4))))
    return outputs.loss, {"aux_loss": outputs.aux_loss, "smoes_bal_loss": outputs.smoes_bal_loss,
                          "smoes_mi_loss": outputs.smoes_mi_loss}  # fmt: skip


def with_zoo_smoes(model):
    from moezoo.modeling.smoes.zoo import enable_smoes

    model.config.router_trainable = True
    enable_smoes(model, SmoesSettings())
    return model


CASES = {
    "moe_vie": ("tiny-moe_vie", moe_vie_step, None),
    "moemb": ("tiny-moemb", moemb_step, None),
    "moemb --smoes": ("tiny-moemb", lambda model, folder: moemb_step(model, folder, smoes=True), with_zoo_smoes),
    "mote": ("tiny-mote-llama", mote_step, None),
    "mote videollm": ("tiny-mote", mote_step, None),  # what `moezoo train mote` trains
    "omnimoe_vl": ("tiny-omnimoe_vl", omnimoe_vl_step, None),
    "omnimoe_vl --smoes": ("tiny-omnimoe_vl", omnimoe_vl_step, with_zoo_smoes),
    "smoes qwen3.5-moe": ("tiny-smoes", smoes_step, None),
    "smoes qwen3-vl-moe": ("tiny-smoes-qwen3-vl-moe", smoes_step, None),
}


# The modules whose output is (first) the logits of a routing decision: the zoo's and the SMoES hosts' routers,
# OmniMoE-VL's depth scores, MoEMB's trained gates (efficiency heads, null routers, layer-skip gates, token pruner).
GATES = (TopKRouter, Fp32RouterMixin, OmniMoeVlDepthScore, EfficiencyHead, NullRouter, LayerSkipGate, TokenPruner)


def routed(case: str) -> bool:
    """Whether the model of `case` has gates: MoTE routes by task id, with no router."""
    return not case.startswith("mote")


@contextmanager
def recorded_gate_logit_dtypes(model):
    """Records the dtype of every gate's logits in a forward of `model`: the `GATES` modules' outputs, and the logits
    of OmniMoE-VL's participation gate (`OmniMoeVlQuerySynthesis.gate_logits`, a method)."""
    dtypes, handles = [], []

    def record(module, args, output):
        dtypes.append((output[0] if isinstance(output, tuple) else output).dtype)

    def recording(gate_logits):
        def recorded(*args):
            logits = gate_logits(*args)
            dtypes.append(logits.dtype)
            return logits

        return recorded

    for module in model.modules():
        if isinstance(module, GATES):
            handles.append(module.register_forward_hook(record))
        if isinstance(module, OmniMoeVlQuerySynthesis):
            module.gate_logits = recording(module.gate_logits)
    try:
        yield dtypes
    finally:
        for handle in handles:
            handle.remove()
        for module in model.modules():
            module.__dict__.pop("gate_logits", None)


def run_step(case: str, folders, precision: str):
    """The training forward and backward of `case` on a fresh copy of its tiny model (seed 0), in fp32 or under bf16
    autocast: the loss, the watched tensors, the router logits' dtypes and the parameters that got a gradient."""
    preset, step, prepare = CASES[case]
    torch.manual_seed(0)
    model = load(folders[preset])
    if prepare is not None:
        model = prepare(model)
    if "omnimoe" in case:  # past exploration: no noise, the route is the scores' own
        router = model.model.projector.depth_router
        router.routing_step.fill_(model.config.exploration_steps)
    model.train()
    with recorded_gate_logit_dtypes(model) as dtypes:
        with autocast() if precision == "bf16" else torch.autocast("cpu", enabled=False):
            loss, watched = step(model, folders[preset])
    loss.backward()
    graded = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    return loss.detach(), watched, dtypes, graded


@pytest.fixture(scope="module")
def steps(folders):
    return {(case, precision): run_step(case, folders, precision) for case in CASES for precision in ("fp32", "bf16")}


@pytest.mark.parametrize("case", list(CASES))
def test_under_bf16_autocast_the_fp32_quantities_stay_fp32(steps, case):
    _, watched, dtypes, _ = steps[case, "bf16"]
    assert dtypes or not routed(case)
    assert set(dtypes) <= {torch.float32}, dtypes
    for name, tensor in watched.items():
        if tensor is not None:
            assert tensor.dtype == torch.float32, name


@pytest.mark.parametrize("case", list(CASES))
def test_a_bf16_step_has_the_fp32_loss_within_bf16_tolerance_and_the_same_gradients(steps, case):
    loss32, _, _, graded32 = steps[case, "fp32"]
    loss16, _, _, graded16 = steps[case, "bf16"]
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, rtol=BF16_LOSS_RTOL, atol=0)
    assert graded16 == graded32 and graded32


def test_without_autocast_the_fp32_islands_change_nothing(folders):
    """In fp32 and without autocast, `autocast_off` and the upcasts leave the numbers bit for bit as they were: the
    router's outputs and MoE-ViE's contrastive logits equal the plain formulas (the fidelity tests against transformers
    cover the whole forwards)."""
    model = load(folders["tiny-moe_vie"]).eval()
    router = next(module for module in model.modules() if isinstance(module, TopKRouter))
    hidden = torch.randn(5, router.hidden_dim, generator=torch.Generator().manual_seed(0))
    for wrapped, plain in zip(router(hidden), router._route(hidden)):
        assert torch.equal(wrapped, plain)
    images, texts = torch.nn.functional.normalize(torch.randn(2, 3, 8), dim=-1)
    plain = texts @ images.t() * model.logit_scale.clamp(max=model.config.max_logit_scale).exp()
    assert torch.equal(model.contrastive_logits(images, texts), plain)


# --- loading in bf16 -----------------------------------------------------------------------------------------------


FP32_BUFFERS = ("e_score_correction_bias", "depth_usage_ema", "gauss_mean", "gauss_var", "expert_counts_ema")


@pytest.mark.parametrize("preset", PRESETS)
def test_loaded_in_bf16_the_fp32_buffers_stay_fp32(folders, preset):
    model = load(folders[preset], dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    floating = {name: buffer.dtype for name, buffer in model.named_buffers() if buffer.is_floating_point()}
    kept = {name: dtype for name, dtype in floating.items() if name.rsplit(".", 1)[-1] in FP32_BUFFERS}
    assert set(kept.values()) <= {torch.float32}, kept
    if preset == "tiny-omnimoe_vl":  # transformers' fp32 list must not turn the step counter into a float
        assert model.model.projector.depth_router.routing_step.dtype == torch.int64
    with torch.no_grad():
        model.to(torch.bfloat16)  # a cast after loading keeps them too
    assert all(dict(model.named_buffers())[name].dtype == torch.float32 for name in kept)


# --- every train recipe run through its Trainer: autocast, bf16 weights, the saved folder ---------------------------


def bf16_run(options_class, **fields):
    """`options_class` for a run of 2 steps of batch 2 with `--bf16 --dtype bfloat16`, `--bf16` put where the command
    line puts it (`trainer_options`): in the options that hold it themselves (MoEMB's), else in `training_args`."""
    bf16 = {"bf16": True} if "bf16" in mirrored_fields(options_class) else {"training_args": {"bf16": True}}
    return options_class(steps=2, batch_size=2, logging_steps=1, dtype="bfloat16", **bf16, **fields)


# Every train recipe (one of MoEMB's adaptive recipes): the case of `CASES` whose preset it trains and whose forward
# checks the folder it writes, the Trainer class it runs, and the run, given the model folder and the output folder.
RECIPE_RUNS = {
    "moe_vie": ("moe_vie", moe_vie.MoeVieTrainer, lambda model, out: moe_vie.train_moe_vie(
        model, shapes_examples(4), out, bf16_run(moe_vie.MoeVieTrainingOptions))),
    "moemb": ("moemb", moemb.MoEmbTrainer, lambda model, out: moemb.train_moemb(
        model, mmeb_pairs(), out, bf16_run(moemb.MoEmbTrainingOptions))),
    "moemb --smoes": ("moemb --smoes", moemb.MoEmbTrainer, lambda model, out: moemb.train_moemb(
        model, mmeb_pairs(), out, bf16_run(moemb.MoEmbTrainingOptions, smoes=SmoesSettings()))),
    "moemb --grpo": ("moemb", moemb_grpo.GatePolicyGRPOTrainer, lambda model, out: moemb_grpo.train_moemb_grpo(
        model, mmeb_pairs(), out, bf16_run(moemb_grpo.GrpoOptions, rollouts=2, execution="masked"))),
    "moemb --adaptive-recipe token_pruner": ("moemb", moemb.MoEmbTrainer, lambda model, out: moemb.train_moemb(
        model, mmeb_pairs(), out, bf16_run(moemb.MoEmbTrainingOptions,
                                           adaptive=AdaptiveRecipeOptions(recipe="token_pruner")))),
    "mote --lora-r 2": ("mote videollm", mote.MoteTrainer, lambda model, out: mote.train_mote(
        model, procedure_clips(), out, bf16_run(mote.MoteTrainingOptions, lora_r=2))),
    "mote": ("mote videollm", mote.MoteTrainer, lambda model, out: mote.train_mote(
        model, procedure_clips(), out, bf16_run(mote.MoteTrainingOptions))),
    "omnimoe_vl": ("omnimoe_vl", omnimoe_vl.OmniMoeVlTrainer, lambda model, out: omnimoe_vl.train_omnimoe_vl(
        model, vqa_examples(), out, bf16_run(omnimoe_vl.OmniMoeVlTrainingOptions))),
    "omnimoe_vl --smoes": ("omnimoe_vl --smoes", omnimoe_vl.OmniMoeVlTrainer, lambda model, out:
        omnimoe_vl.train_omnimoe_vl(model, vqa_examples(), out, bf16_run(
            omnimoe_vl.OmniMoeVlTrainingOptions, stage="II", smoes=SmoesSettings()))),  # Stage I freezes the routers
    "smoes qwen3.5-moe": ("smoes qwen3.5-moe", smoes.SmoesTrainer, lambda model, out: smoes.train_smoes(
        model, shapes_examples(4), out, bf16_run(smoes.SmoesTrainingOptions))),
    "smoes qwen3-vl-moe": ("smoes qwen3-vl-moe", smoes.SmoesTrainer, lambda model, out: smoes.train_smoes(
        model, shapes_examples(4), out, bf16_run(smoes.SmoesTrainingOptions))),
}  # fmt: skip


@dataclass
class TrainingStepRecord:
    """What the forwards of a run's training steps saw: the autocast state (enabled, dtype) of each module's forward,
    the dtype of every gate's logits (`recorded_gate_logit_dtypes`), and each step's loss."""

    autocast: list[tuple[bool, torch.dtype]] = field(default_factory=list)
    gate_logits: list[torch.dtype] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def record_training_steps(monkeypatch, trainer_class) -> TrainingStepRecord:
    """Records the training steps of `trainer_class`'s runs (`TrainingStepRecord`). The autocast state is read as the
    outermost forwards below the model's own begin: the Trainer's mixed precision wraps the forward of the model it is
    given (accelerate's `prepare_model`), outside which that model's own hooks run, and the fp32 islands inside turn
    autocast off for the modules they call."""
    record, original = TrainingStepRecord(), trainer_class.training_step

    def training_step(self, model, inputs, *args, **kwargs):
        depth = 0

        def entered(module, args):
            nonlocal depth
            if depth == 0:
                record.autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            depth += 1

        def left(module, args, output):
            nonlocal depth
            depth -= 1

        handles = []
        for name, module in model.named_modules():
            if name:
                handles += [module.register_forward_pre_hook(entered), module.register_forward_hook(left)]
        try:
            with recorded_gate_logit_dtypes(model) as dtypes:
                loss = original(self, model, inputs, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        record.gate_logits.extend(dtypes)
        record.losses.append(loss.item())
        return loss

    monkeypatch.setattr(trainer_class, "training_step", training_step)
    return record


def bf16_model_gate_logit_dtypes(case: str) -> set[torch.dtype]:
    """The dtypes of the gate logits of `case`'s model loaded in bf16, under autocast: fp32 for the zoo's gates, while
    the SMoES hosts' transformers routers compute theirs in the weights' dtype as transformers does (their softmax is
    fp32; `Fp32RouterMixin`); MoTE has no gates."""
    if not routed(case):
        return set()
    return {torch.bfloat16} if case.startswith("smoes") else {torch.float32}


def saved_dtypes(folder) -> dict[str, str]:
    """The dtype of each tensor of `folder`'s weights, as safetensors names it ("BF16", "F32", "I64", ...)."""
    with safe_open(folder / "model.safetensors", "pt") as saved:
        return {key: saved.get_slice(key).get_dtype() for key in saved.keys()}


@pytest.mark.parametrize("recipe", list(RECIPE_RUNS))
def test_a_recipe_trained_in_bf16_runs_under_autocast_saves_bf16_and_loads_back(recipe, folders, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    case, trainer_class, train = RECIPE_RUNS[recipe]
    preset, step, _ = CASES[case]
    steps = record_training_steps(monkeypatch, trainer_class)
    train(folders[preset], tmp_path / "out")

    assert len(steps.losses) == 2 and all(math.isfinite(loss) for loss in steps.losses), steps.losses
    assert steps.autocast and set(steps.autocast) == {(True, torch.bfloat16)}, set(steps.autocast)
    assert set(steps.gate_logits) == bf16_model_gate_logit_dtypes(case), set(steps.gate_logits)

    # bf16 but for the fp32 buffers (step counters and flags keep their integer and boolean dtypes)
    floating = {key: dtype for key, dtype in saved_dtypes(tmp_path / "out").items() if dtype in ("BF16", "F32")}
    kept = {key for key in floating if key.rsplit(".", 1)[-1] in FP32_BUFFERS}
    assert {floating[key] for key in kept} <= {"F32"}
    assert {dtype for key, dtype in floating.items() if key not in kept} == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"

    reloaded = load(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.dtype == torch.bfloat16
    with torch.no_grad():  # the training forward: MoEMB's SMoES losses are computed in training only
        loss, _ = step(reloaded.train(), tmp_path / "out")
    assert torch.isfinite(loss)


def test_a_recipe_loaded_in_bf16_starts_within_bf16_tolerance_of_fp32(folders, tmp_path):
    """MoE-ViE's first training loss with the weights loaded in bf16 and the forwards under autocast, against fp32's
    on the same batch: the bf16 weights' rounding (the recipe steps above keep fp32 weights) adds no more than bf16's
    tolerance."""
    dataset, folder = shapes_examples(8), folders["tiny-moe_vie"]
    common = dict(steps=1, batch_size=4, learning_rate=1e-3, logging_steps=1)
    fp32 = moe_vie.train_moe_vie(folder, dataset, tmp_path / "fp32", moe_vie.MoeVieTrainingOptions(**common))
    options = moe_vie.MoeVieTrainingOptions(**common, dtype="bfloat16", training_args={"bf16": True})
    bf16 = moe_vie.train_moe_vie(folder, dataset, tmp_path / "bf16", options)
    assert bf16["initial_loss"] == pytest.approx(fp32["initial_loss"], rel=BF16_LOSS_RTOL)
    assert load(tmp_path / "fp32").dtype == torch.float32


def test_a_bad_dtype_is_refused_naming_the_choices():
    from moezoo.training.precision import load_dtype

    assert load_dtype(None) == {} and load_dtype("bfloat16") == {"dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        load_dtype("bf16")


def test_grpo_policy_log_probs_under_bf16_autocast(model, batch):  # fixtures of test_moemb_grpo: heads drawn at random
    """GRPO's objective reads the policy's log-probabilities of forced actions: under bf16 autocast they are fp32,
    within bf16's tolerance of fp32's, and reach the same efficiency heads."""
    from moezoo.training.moemb_grpo import replayed_log_prob, sample_rollouts

    actions = sample_rollouts(model, batch, 1, 1.0, "masked", torch.Generator().manual_seed(0)).actions[0]
    heads = [parameter for parameter in model.parameters() if parameter.requires_grad]
    results = {}
    for precision in ("fp32", "bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            log_prob = replayed_log_prob(model, batch, actions, 1.0, "masked")
        gradients = torch.autograd.grad(log_prob.sum(), heads, allow_unused=True)
        results[precision] = log_prob.detach(), [gradient is not None for gradient in gradients]
    (log_prob32, graded32), (log_prob16, graded16) = results["fp32"], results["bf16"]
    assert log_prob16.dtype == torch.float32
    torch.testing.assert_close(log_prob16, log_prob32, rtol=BF16_LOSS_RTOL, atol=1e-2)
    assert graded16 == graded32 and any(graded32)


@pytest.mark.parametrize("recipe", ["token_pruner", "skip_gate", "adamoe", "layer_skip"])
def test_an_adaptive_recipe_step_under_bf16_autocast(recipe, inputs):  # `inputs`: test_moemb_trained_gates'
    """MoEMB's trained gates (`--adaptive-recipe`): the embeddings and the budget objective of one step are within
    bf16's tolerance of fp32's, and reach the same gate parameters."""
    from test_moemb_trained_gates import recipe_model

    from moezoo.training.moemb_adaptive import RECIPES

    results = {}
    for precision in ("fp32", "bf16"):
        model, training = recipe_model(recipe)
        with recorded_gate_logit_dtypes(model) as dtypes, torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled=precision == "bf16"
        ):
            embeddings, record = training.embed(model.train(), inputs, step=1, total=2)
            rates = training.rates([record])
            budget = training.budget_loss([record], rates, step=1, total=2, active=RECIPES[recipe].actions)
        assert set(dtypes) == {torch.float32}, dtypes  # the routers', and the recipe's gates' logits
        (embeddings.float().sum() + budget).backward()
        graded = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
        results[precision] = embeddings.detach().float(), budget.detach(), graded
    (embeddings32, budget32, graded32), (embeddings16, budget16, graded16) = results["fp32"], results["bf16"]
    assert budget16.dtype == torch.float32
    torch.testing.assert_close(embeddings16, embeddings32, rtol=BF16_LOSS_RTOL, atol=2e-2)
    torch.testing.assert_close(budget16, budget32, rtol=BF16_LOSS_RTOL, atol=1e-3)
    assert graded16 == graded32 and graded32
