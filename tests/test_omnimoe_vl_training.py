"""OmniMoE-VL training (spec omnimoe_vl.md §3, §9.8, §9.9, §9.11, §9.12, §9.14): one training step (finite loss,
gradients, the vision router's straight-through gradient, gradient checkpointing, PEFT LoRA on attention and on the
fused experts, TRL's SFTTrainer), the objectives' schedules and the routing step under gradient accumulation, stage
freezing, `moezoo train omnimoe_vl` with `--resume`, the learning tests on the synthetic depth tasks and the demo
stage."""

import argparse
import copy
import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import Trainer, TrainingArguments

from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from moezoo.modeling.omnimoe_vl_projector import annealed_scale
from moezoo.processors.build_omnimoe_vl import make_omnimoe_vl_processor
from moezoo.training.arguments import checkpoints_dir
from moezoo.training.omnimoe_vl import (
    ROUTING_OBJECTIVES,
    OmniMoeVlCollator,
    OmniMoeVlLoss,
    OmniMoeVlTrainer,
    OmniMoeVlTrainingOptions,
    RoutingStepCallback,
    add_train_arguments,
    conversation,
    load_omnimoe_vl_dataset,
    run_train,
    set_trainable,
    train_omnimoe_vl,
    with_lora,
)
from moezoo.training.omnimoe_vl_synthetic import (
    DepthTask,
    answers_from_the_depth,
    depth_task_config,
    prompt_route_distances,
    train_depth_task,
)
from moezoo.zoo import create_from_preset


QUESTIONS = ("what color is the car?", "is the car red?", "what is on the left?", "how many cars?")
ANSWERS = ("red", "yes", "a tree", "two")
DEFAULT_OBJECTIVES = {"query_budget", "query_entropy", "query_diversity", "router_query_diversity", "depth_balance"}


def tiny_config(**changes) -> OmniMoeVlConfig:
    return OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL) | changes)


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8))


def examples(count: int = 4) -> list[dict]:
    return [{"image": image(i), "question": QUESTIONS[i % 4], "answer": ANSWERS[i % 4]} for i in range(count)]


@pytest.fixture(scope="module")
def processor():
    return make_omnimoe_vl_processor(tiny_config())


@pytest.fixture(scope="module")
def batch(processor):
    return OmniMoeVlCollator(processor)(examples())


def model_with(seed: int = 0, **changes) -> OmniMoeVlForConditionalGeneration:
    torch.manual_seed(seed)
    return OmniMoeVlForConditionalGeneration(tiny_config(**changes)).train()


def after_exploration(model: OmniMoeVlForConditionalGeneration) -> OmniMoeVlForConditionalGeneration:
    """Past the exploration steps the training route is content routing: training forwards are deterministic."""
    model.model.projector.depth_router.routing_step.fill_(model.config.exploration_steps)
    return model


def unused_vision_blocks(model) -> tuple[str, ...]:
    """The tower's blocks after the last tap, which never reach the output (the tiny preset keeps them; a conversion
    truncates them, spec D23)."""
    blocks = range(max(model.config.vision_feature_layers), model.config.vision_config.num_hidden_layers)
    return tuple(f"model.vision_tower.encoder.layers.{i}." for i in blocks)


# --------------------------------------------------------------------------------------- §9.8 training smoke


def test_one_step_gives_a_finite_loss_and_a_gradient_to_every_trainable_parameter(batch):
    model = model_with(injection_gate_init=0.5)
    outputs = model(**batch, output_router_logits=True)
    assert torch.isfinite(outputs.loss)
    assert set(outputs.routing_losses) == DEFAULT_OBJECTIVES  # L_util and L_fac are off by default
    assert all(torch.isfinite(term) for term in outputs.routing_losses.values())
    outputs.loss.backward()
    skipped = unused_vision_blocks(model)
    for name, parameter in model.named_parameters():
        if not name.startswith(skipped):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    # The vision routers' gradient comes through the straight-through top-1 weight (spec D4).
    assert model.model.vision_tower.encoder.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert torch.isfinite(model(**batch).loss)


def test_at_gate_zero_the_injection_gets_exactly_zero_gradient_but_its_gate_does(batch):
    model = model_with()  # injection_gate_init = 0: the converted model equals the composition without injection
    model(**batch).loss.backward()
    injection = model.model.projector.injection
    for name, parameter in injection.named_parameters():
        if name != "gate":
            assert parameter.grad is None or not parameter.grad.any(), name
    assert injection.gate.grad.abs().sum() > 0


def test_the_optional_objectives_add_their_weighted_terms_to_the_loss(batch):
    weights = {"router_utility": 0.35, "adapter_factor": 1e-3}
    plain = after_exploration(model_with(injection_gate_init=0.5))
    extended = after_exploration(model_with(injection_gate_init=0.5, router_utility="grad",
                                            router_utility_coef=weights["router_utility"],
                                            adapter_factor_reg_coef=weights["adapter_factor"]))  # fmt: skip
    outputs = extended(**batch)
    assert set(outputs.routing_losses) == set(ROUTING_OBJECTIVES)
    assert all(outputs.routing_losses[name] > 0 for name in weights)
    extra = sum(weight * outputs.routing_losses[name] for name, weight in weights.items())
    torch.testing.assert_close(outputs.loss, plain(**batch).loss + extra)


def test_no_utility_supervision_when_the_loss_does_not_depend_on_the_route(batch):
    model = model_with(injection_gate_init=0.5, router_utility="grad", router_utility_coef=0.35)
    route = torch.tensor([[0.5, 0.5, 0.0]] * len(batch["input_ids"]))
    outputs = model(**batch, route_override={"fusion": route, "injection": route})
    assert "router_utility" not in outputs.routing_losses and "depth_balance" in outputs.routing_losses


def test_no_routing_objectives_in_eval_mode(batch):
    outputs = model_with().eval()(**batch)
    assert torch.isfinite(outputs.loss) and outputs.routing_loss is None and outputs.routing_losses is None


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(batch):
    plain = after_exploration(model_with(injection_gate_init=0.5, router_utility="grad", router_utility_coef=0.35))
    checkpointed = after_exploration(model_with(injection_gate_init=0.5, router_utility="grad",
                                                router_utility_coef=0.35))  # fmt: skip
    checkpointed.gradient_checkpointing_enable()
    losses = []
    for model in (plain, checkpointed):
        loss = model(**batch, output_router_logits=True).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    gradients = dict(checkpointed.named_parameters())
    for name, parameter in plain.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(gradients[name].grad, parameter.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_peft_lora_on_q_v_projections_and_on_the_fused_experts(batch):
    model = after_exploration(model_with(injection_gate_init=0.5))
    before = model(**batch).logits
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    peft_model = get_peft_model(model, config)
    outputs = peft_model(**batch)
    torch.testing.assert_close(outputs.logits, before)  # the adapters start as no-ops
    outputs.loss.backward()
    trainable = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert any("experts" in name for name in trainable) and any("q_proj" in name for name in trainable)
    # B starts at zero, so A's gradient is zero at the first step; B's is not (but after the last tap).
    skipped = tuple(f"base_model.model.{prefix}" for prefix in unused_vision_blocks(model))
    for name, parameter in trainable.items():
        if "lora_B" in name and not name.startswith(skipped):
            assert parameter.grad is not None and parameter.grad.any(), name


def test_with_lora_adapts_the_stages_experts_and_trains_projector_and_routers_in_full(batch):
    model = model_with(injection_gate_init=0.5)
    with pytest.raises(ValueError, match="Stages II-IV"):
        with_lora(model, "I", 2)
    peft_model = with_lora(model, "II", 2)
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    adapters = {name for name in trainable if "lora_" in name}
    assert adapters and all(".language_model." in name and ".experts." in name for name in adapters)
    in_full = trainable - adapters
    assert in_full == {f"base_model.model.{name}" for name in peft_model.trained_in_full}
    assert all(".projector." in name or name.endswith(".mlp.gate.weight") for name in in_full)
    peft_model(**batch).loss.backward()
    assert all(p.grad is not None for name, p in peft_model.named_parameters() if name in in_full)


def test_trl_sft_trainer_runs_two_steps_with_the_processor(processor, tmp_path):
    trl = pytest.importorskip("trl")

    class OmniMoeVlSFTTrainer(OmniMoeVlLoss, trl.SFTTrainer):
        """TRL's data preparation and collator (conversations with images, through the processor), the model's loss."""

    data = Dataset.from_dict({
        "messages": [conversation(q, a) for q, a in zip(QUESTIONS, ANSWERS)],
        "images": [[image(i)] for i in range(4)],
    })  # fmt: skip
    model = model_with(injection_gate_init=0.5)
    trainer = OmniMoeVlSFTTrainer(
        model=model, processing_class=processor, train_dataset=data,
        args=trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                           report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1),
        callbacks=[RoutingStepCallback()],
    )  # fmt: skip
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(np.isfinite(log["loss"]) for log in logs)
    assert all(log["routing_loss"] != 0 and log["aux_loss"] > 0 for log in logs)  # the model's loss, all terms
    assert int(model.model.projector.depth_router.routing_step) == 2


# ------------------------------------------------------------------------------------------- §9.9 schedules


@pytest.mark.parametrize("objective", ["query_budget", "query_entropy", "depth_balance"])
def test_annealed_weights_follow_their_linear_schedules(batch, objective):
    model = model_with()
    config = model.config
    coefficient = getattr(config, f"{objective}_coef")
    anneal = getattr(config, f"{objective}_anneal_steps")
    minimum = getattr(config, f"{objective}_min_scale")
    router = model.model.projector.depth_router
    expected = {0: 1.0, anneal // 2: 1 - (1 - minimum) * (anneal // 2) / anneal, anneal: minimum, 2 * anneal: minimum}
    for step, scale in expected.items():
        router.routing_step.fill_(step)
        outputs = model(**batch)
        weight, _ = model.model.projector.routing_objectives(outputs, outputs.loss)[objective]
        assert weight == pytest.approx(coefficient * scale, abs=1e-12), step
    assert annealed_scale(25, 0.05, 50) == pytest.approx(0.525)
    assert annealed_scale(0, 0.25, 0) == 0.25  # no annealing: the held value from the start


def test_constant_weights_do_not_change_with_the_step(batch):
    model = model_with()
    for step in (0, 1000):
        model.model.projector.depth_router.routing_step.fill_(step)
        outputs = model(**batch)
        objectives = model.model.projector.routing_objectives(outputs, outputs.loss)
        assert objectives["query_diversity"][0] == model.config.query_diversity_coef
        assert objectives["router_query_diversity"][0] == model.config.router_query_diversity_coef


def test_routing_step_advances_once_per_optimizer_step_under_gradient_accumulation(processor, tmp_path):
    model = model_with()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    trainer = OmniMoeVlTrainer(
        model=model, data_collator=OmniMoeVlCollator(processor), train_dataset=Dataset.from_list(examples(8)),
        args=TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                               gradient_accumulation_steps=2, report_to="none", save_strategy="no", use_cpu=True,
                               disable_tqdm=True, logging_steps=1, remove_unused_columns=False),
        callbacks=[RoutingStepCallback()],
    )  # fmt: skip
    trainer.train()
    assert len(forwards) == 6 and int(model.model.projector.depth_router.routing_step) == 3
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert all({"aux_loss", "routing_loss", *(f"routing/{name}" for name in DEFAULT_OBJECTIVES)} <= set(log)
               for log in logs)  # fmt: skip


# --------------------------------------------------------------------------------------- §9.14 stage freezing


def expected_stage_names(model, stage: str, train_projector: bool = True) -> set[str]:
    names = {name for name, _ in model.named_parameters()}
    projector = {name for name in names if name.startswith("model.projector.")}
    text_moe = {f"model.language_model.layers.{i}.mlp.{part}" for i in (0, 2, 4)
                for part in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")}  # fmt: skip
    vision_moe = {f"model.vision_tower.encoder.layers.{i}.mlp.{part}" for i in (0, 2, 4)
                  for part in ("gate.weight", "experts.up_proj", "experts.up_proj_bias", "experts.down_proj",
                               "experts.down_proj_bias")}  # fmt: skip
    optional = projector if train_projector else set()
    return {"I": projector, "II": text_moe | optional, "III": vision_moe | optional, "IV": names}[stage]


@pytest.mark.parametrize("stage, train_projector",
                         [("I", True), ("II", True), ("II", False), ("III", True), ("III", False), ("IV", True)])
def test_stages_train_exactly_their_parameters_and_the_frozen_ones_get_no_gradient(batch, stage, train_projector):
    model = model_with(injection_gate_init=0.5)
    trainable = set_trainable(model, stage, train_projector)
    assert trainable == sorted(expected_stage_names(model, stage, train_projector))
    model(**batch, output_router_logits=True).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.requires_grad == (name in trainable), name
        if name not in trainable:
            assert parameter.grad is None, name


def test_bad_stages_are_clear_errors():
    model = model_with()
    with pytest.raises(ValueError, match="stage must be one of I, II, III, IV"):
        set_trainable(model, "V")
    with pytest.raises(ValueError, match="Stage I trains the projector alone"):
        set_trainable(model, "I", train_projector=False)


# ----------------------------------------------------------------------------- data and `moezoo train omnimoe_vl`


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vqa")
    with open(folder / "train.jsonl", "w") as file:
        for index, example in enumerate(examples(6)):
            example["image"].save(folder / f"{index}.png")
            row = {"image": f"{index}.png", "question": example["question"], "answer": example["answer"],
                   "prompt_type": "colour" if index % 2 == 0 else "count"}  # fmt: skip
            file.write(json.dumps(row) + "\n")
    return folder / "train.jsonl"


def test_bad_data_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks answer"):
        load_omnimoe_vl_dataset(Dataset.from_dict({"image": ["a.png"], "question": ["why?"]}))
    with pytest.raises(ValueError, match=r"1 row\(s\) have no question \(rows 1,"):
        load_omnimoe_vl_dataset(Dataset.from_dict({"image": ["a.png", "b.png"], "question": ["why?", " "],
                                                   "answer": ["so", "so"]}))  # fmt: skip


def test_train_command_resumes_and_the_next_stage_continues_the_routing_step(data_file, tmp_path, monkeypatch):
    create_from_preset("tiny-omnimoe_vl", tmp_path / "tiny")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    command = ["--model", str(tmp_path / "tiny"), "--data", str(data_file), "--out", str(tmp_path / "stage1"),
               "--stage", "I", "--steps", "3", "--batch-size", "2", "--save-steps", "2", "--logging-steps", "1"]
    calls, original = [], OmniMoeVlTrainer.training_step

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(OmniMoeVlTrainer, "training_step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_train(parser.parse_args(command))
    assert [p.name for p in checkpoints_dir(tmp_path / "stage1").iterdir()] == ["checkpoint-2"]
    assert run_train(parser.parse_args([*command, "--resume"])) == 0
    out = tmp_path / "stage1"
    assert {"training_curves.png", "depth_routes.png", "model.safetensors"} <= {p.name for p in out.iterdir()}
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["routing_step"] == 3 and training["stage"] == "I" and training["learning_rate"] == 1e-3
    stage1 = OmniMoeVlForConditionalGeneration.from_pretrained(out)
    base = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "tiny").state_dict()
    trained = stage1.state_dict()
    assert all(torch.equal(trained[n], base[n]) for n in base if not n.startswith("model.projector."))
    assert not torch.equal(trained["model.projector.queries.query_bank"], base["model.projector.queries.query_bank"])

    # Stage II from Stage I's model: its schedules continue from step 3 (spec D11).
    stage2 = parser.parse_args(["--model", str(out), "--data", str(data_file), "--out", str(tmp_path / "stage2"),
                                "--stage", "II", "--steps", "2", "--batch-size", "2", "--freeze-projector",
                                "--router-utility", "0.35"])  # fmt: skip
    assert run_train(stage2) == 0
    training = json.loads((tmp_path / "stage2" / "moezoo.json").read_text())["training"]
    assert training["routing_step"] == 5
    config = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "stage2").config
    assert (config.router_utility, config.router_utility_coef) == ("grad", 0.35)


@pytest.mark.parametrize("stage, lora_r", [("I", 0), ("II", 2)])
def test_a_resumed_run_equals_an_uninterrupted_one(data_file, stage, lora_r, tmp_path, monkeypatch, capsys):
    """Exploration noise, usage EMA and routing step (Stage I explores from step 0), and LoRA with the projector and
    routers trained in full (Stage II), all continue from the checkpoint."""
    from test_train_resume import SAVE_STEPS, STEPS, check_resume_equals_an_uninterrupted_run

    from moezoo.training import omnimoe_vl

    create_from_preset("tiny-omnimoe_vl", tmp_path / "tiny")
    options = OmniMoeVlTrainingOptions(stage=stage, steps=STEPS, batch_size=2, learning_rate=1e-2, logging_steps=1,
                                       save_steps=SAVE_STEPS, lora_r=lora_r)  # fmt: skip

    def train(out, options):
        return train_omnimoe_vl(tmp_path / "tiny", data_file, out, options)

    logs = check_resume_equals_an_uninterrupted_run(monkeypatch, capsys, tmp_path, omnimoe_vl, OmniMoeVlTrainer,
                                                    train, options)  # fmt: skip
    assert all({"routing_loss", "aux_loss"} <= set(log) for log in logs)


def test_train_with_lora_merges_the_adapters_into_the_stages_experts(data_file, tmp_path):
    create_from_preset("tiny-omnimoe_vl", tmp_path / "tiny")
    options = OmniMoeVlTrainingOptions(stage="II", steps=2, batch_size=2, learning_rate=1e-2, lora_r=2)
    training = train_omnimoe_vl(tmp_path / "tiny", data_file, tmp_path / "lora", options)
    assert training["lora_r"] == 2
    base = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "tiny").state_dict()
    trained = OmniMoeVlForConditionalGeneration.from_pretrained(tmp_path / "lora").state_dict()
    assert trained.keys() == base.keys()  # merged: no adapter left
    changed = {name for name in base if not torch.equal(trained[name], base[name])}
    experts = {name for name in changed if ".language_model." in name and ".mlp.experts." in name}
    assert experts and all(name.startswith("model.projector.") or ".mlp." in name for name in changed)
    assert not any(".vision_tower." in name or ".self_attn." in name for name in changed)


# -------------------------------------------------------------------------------------- §9.11 and §9.12 learning


@pytest.mark.parametrize(("seed", "precision"), [(0, "fp32"), (1, "fp32"), (2, "fp32"), (0, "bf16")])
def test_a_fixed_depth_that_carries_the_answer_is_learned_and_routed_to(seed, precision):
    """§9.11: with exploration, accuracy >= 0.95 and argmax(mean w) == s* within 150 steps; also with training and
    evaluation under bf16 autocast (the Trainer's `--bf16`; `test_mixed_precision`), one seed of the three."""
    torch.manual_seed(seed)
    steps = 150
    model = OmniMoeVlForConditionalGeneration(depth_task_config(exploration_steps=int(0.6 * steps)))
    if precision == "bf16":
        # As accelerate does for the Trainer's `--bf16`: autocast entered and left by each forward. One context around
        # the whole loop would keep reusing its cache of the weights cast to bf16 at the first step.
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    task = DepthTask(selected_stream=2)
    history = train_depth_task(model, task, steps, seed=seed, eval_every=10,
                               stop=lambda result: answers_from_the_depth(result, task.selected_stream))  # fmt: skip
    assert answers_from_the_depth(history[-1], task.selected_stream), history


def follows_the_question(evaluation: dict) -> bool:
    """Spec §9.12's thresholds: accuracy >= 0.95, the route's argmax on the asked stream for >= 0.5 of samples, the
    asked stream in the route for >= 0.7."""
    return evaluation["accuracy"] >= 0.95 and evaluation["argmax_hit"] >= 0.5 and evaluation["support_hit"] >= 0.7


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_question_selects_the_depth(seed):
    """§9.12 within 600 steps (measured: 300-500): accuracy, argmax-hit and support-hit above their thresholds, and
    D_TV between questions asking for different streams > D_TV between paraphrases of one question."""
    torch.manual_seed(seed)
    steps = 600
    # The route learns to follow the question from the utility supervision L_util (measured: without it, seed 0
    # reaches 0.92 accuracy at best, its route mostly deaf to the question).
    model = OmniMoeVlForConditionalGeneration(
        depth_task_config(exploration_steps=int(0.6 * steps), router_utility="grad", router_utility_coef=0.35)
    )
    task = DepthTask(selected_stream=None)
    history = train_depth_task(model, task, steps, seed=seed, eval_every=50, stop=follows_the_question)
    assert follows_the_question(history[-1]), history
    distances = prompt_route_distances(model, task)
    assert distances["different_questions"] > distances["paraphrases"], distances


# --------------------------------------------------------------------------------------------------- the demo


def test_demo_stage_in_quick_mode(tmp_path):
    from moezoo.demos import omnimoe_vl

    result = omnimoe_vl.run(tmp_path, quick=True)
    assert answers_from_the_depth(result["fixed_depth"], omnimoe_vl.FIXED_STREAM), result
    assert (tmp_path / "depth_routes.png").is_file()
