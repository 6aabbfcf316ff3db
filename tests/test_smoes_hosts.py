"""SMoES on the zoo's own models (issue 19 item 1): MoEMB's native Qwen3.5-MoE design (Gated DeltaNet + gated
attention, the attention score carried through the GDN layers) and OmniMoE-VL's language experts, through the core's
`SmoesHost` and `enable_smoes`. Against the same models without SMoES: forward outputs equal for every setting
(E1-style), the training loss equal with SMoES off (E2-style), the SMoES terms added as the formula says; the
settings and buffers round-trip through a saved folder; bad settings fail at configuration time naming the field; the
train commands take `--smoes`; a few steps of each host raise MSI above the run without SMoES."""

import argparse
import copy
import json

import pytest
import torch

from moezoo.configuration.moemb import TINY_MOEMB, MoEmbConfig
from moezoo.configuration.omnimoe_vl import TINY_OMNIMOE_VL, OmniMoeVlConfig
from moezoo.configuration.smoes_settings import SmoesSettings
from moezoo.modeling.moe.block import SparseMoeBlock
from moezoo.modeling.moe.losses import load_balancing_loss
from moezoo.modeling.moe.smoes import contiguous_bins, smoes_export_bin_aligned
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.modeling.omnimoe_vl import OmniMoeVlForConditionalGeneration
from moezoo.modeling.smoes.zoo import enable_smoes
from moezoo.training.smoes import modality_routing
from moezoo.training.smoes_hosts import LogsSmoesTerms, add_smoes_arguments, smoes_settings_from_args


TINY = dict(smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=1.0, smoes_bal_coef=0.01)
SETTINGS = {
    "attention": dict(smoes_score_type="attention"),
    "gaussian": dict(smoes_score_type="gaussian"),
    "hard": dict(smoes_score_type="hard"),
    "fixed-intra-bin-mean": dict(smoes_binning="fixed", smoes_bal_mode="intra_bin", smoes_layer_reduction="mean"),
}


def settings(**fields) -> SmoesSettings:
    return SmoesSettings(**TINY | fields)


def with_smoes(base, **fields):
    model = copy.deepcopy(base)
    enable_smoes(model, settings(**fields))
    return model


def smoes_buffers(model) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers() if ".smoes." in name}


# --- the hosts ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moemb():
    torch.manual_seed(0)
    model = MoEmbForEmbedding(MoEmbConfig(**TINY_MOEMB, router_trainable=True))
    model.set_experts_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def moemb_inputs():
    """Two items of vision_start + 4 image tokens + vision_end + text + <emb>, the second left-padded by two."""
    ids = torch.tensor([[1, 2, 122, 120, 120, 120, 120, 123, 3, 4, 5, 124], [0, 0, 122, 120, 120, 120, 120, 123, 6, 7,
                                                                            8, 124]])  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    return dict(input_ids=ids, attention_mask=(ids != 0).long(), pixel_values=torch.randn(32, 96, generator=generator),
                image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))  # fmt: skip


@pytest.fixture(scope="module")
def omnimoe():
    torch.manual_seed(0)
    model = OmniMoeVlForConditionalGeneration(OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL)))
    model.set_experts_implementation("eager")
    # Past exploration, the training route is content routing: training forwards are deterministic.
    model.model.projector.depth_router.routing_step.fill_(model.config.exploration_steps)
    return model.eval()


@pytest.fixture(scope="module")
def omnimoe_inputs():
    ids = torch.tensor([[1, 2, 151] + [150] * 16 + [152, 3, 4, 5, 6], [0, 0, 151] + [150] * 16 + [152, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    generator = torch.Generator().manual_seed(1)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(2, 3, 64, 64, generator=generator),
                labels=ids.masked_fill((ids >= 150) | (mask == 0), -100))  # fmt: skip


# --- E1, E2 and the losses -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETTINGS)
def test_moemb_embeddings_equal_the_model_without_smoes_for_every_setting(moemb, moemb_inputs, name):
    model = with_smoes(moemb, **SETTINGS[name])
    with torch.no_grad():
        expected = moemb(**moemb_inputs).embeddings
        assert torch.equal(model(**moemb_inputs).embeddings, expected)  # eval: no SMoES at all
    assert int(model.model.language_model.smoes.step) == 0
    model.train()
    outputs = model(**moemb_inputs)
    assert torch.equal(outputs.embeddings.detach(), expected)  # dropout 0: training mode computes the same
    assert int(model.model.language_model.smoes.step) == 1 and outputs.smoes_mi.shape == (8,)
    loss = TINY["smoes_bal_coef"] * outputs.smoes_bal_loss + TINY["smoes_mi_coef"] * outputs.smoes_mi_loss
    torch.testing.assert_close(outputs.aux_loss, loss)
    outputs.aux_loss.backward()
    routers = [layer.mlp.gate.weight.grad for layer in model.model.language_model.layers]
    assert all(grad is not None and grad.abs().sum() > 0 and torch.isfinite(grad).all() for grad in routers)


def test_moemb_attention_score_is_carried_through_gated_deltanet_layers(moemb, moemb_inputs, monkeypatch):
    """Layers 0-2 are Gated DeltaNet: their routers see the hard label; the gated attention at layer 3 mixes it."""
    model = with_smoes(moemb, smoes_score_type="attention").train()
    runtime = model.model.language_model.smoes.runtime
    seen, stop = [], runtime.stop
    monkeypatch.setattr(runtime, "stop", lambda: (seen.append(dict(runtime.layer_scores)), stop()))
    model(**moemb_inputs)
    states = model.model.language_model.smoes.states
    hard = torch.nn.functional.one_hot((moemb_inputs["input_ids"] == 120).long(), 2).float()
    valid = moemb_inputs["attention_mask"].bool()
    assert all(torch.equal(seen[0][state][valid], hard[valid]) for state in states[:3])
    assert not torch.equal(seen[0][states[3]][valid], hard[valid])


@pytest.mark.parametrize("host", ["moemb", "omnimoe_vl"])
def test_attention_score_is_the_head_mean_of_the_attention_weights(host, moemb, moemb_inputs, omnimoe, omnimoe_inputs,
                                                                    monkeypatch):  # fmt: skip
    """The hooks' score at the first softmax-attention layer (MoEMB: 3, after three Gated DeltaNet layers; OmniMoE-VL:
    0) against spec §2.1.1 written out with the layer's own eager attention weights: M = (|x_attn| mean_h(A) M0 +
    |x| M0) / (|x_attn| + |x|), MRoPE and left padding included."""
    base, inputs, index, image_token = {
        "moemb": (moemb, moemb_inputs, 3, 120), "omnimoe_vl": (omnimoe, omnimoe_inputs, 0, 150),
    }[host]  # fmt: skip
    model = with_smoes(base, smoes_score_type="attention").train()
    model.set_attn_implementation("eager")
    runtime, layer = model.model.language_model.smoes.runtime, model.model.language_model.layers[index]
    seen, stop = {}, runtime.stop
    monkeypatch.setattr(runtime, "stop", lambda: (seen.update(runtime.layer_scores), stop()))
    layer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(x=args[0]), with_kwargs=True)
    layer.self_attn.register_forward_hook(lambda module, args, output: seen.update(x_attn=output[0], weights=output[1]))
    model(**inputs)
    hard = torch.nn.functional.one_hot((inputs["input_ids"] == image_token).long(), 2).float()
    mixed = seen["weights"].float().mean(dim=1) @ hard
    x_attn, x = seen["x_attn"].float().norm(dim=-1, keepdim=True), seen["x"].float().norm(dim=-1, keepdim=True)
    expected = (x_attn * mixed + x * hard) / (x_attn + x)
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(seen[layer.mlp.smoes][valid], expected[valid], atol=1e-6, rtol=0)


def test_moemb_with_smoes_off_is_the_model_without_it(moemb, moemb_inputs):
    """E2-style: `smoes_enabled=False` (buffers kept) trains as the model without SMoES: no SMoES term, the
    same embeddings, hence the same InfoNCE loss; the buffers stay as they are."""
    model = with_smoes(moemb, smoes_enabled=False).train()
    before = smoes_buffers(model)
    outputs = model(**moemb_inputs)
    with torch.no_grad():
        expected = moemb.train()(**moemb_inputs)
    moemb.eval()
    assert outputs.aux_loss is None and outputs.smoes_mi is None and outputs.router_logits is None
    assert torch.equal(outputs.embeddings.detach(), expected.embeddings)
    assert all(torch.equal(buffer, before[name]) for name, buffer in smoes_buffers(model).items())


@pytest.mark.parametrize("name", SETTINGS)
def test_omnimoe_logits_equal_the_model_without_smoes_for_every_setting(omnimoe, omnimoe_inputs, name):
    model = with_smoes(omnimoe, **SETTINGS[name])
    with torch.no_grad():
        expected = omnimoe(**omnimoe_inputs).logits
        assert torch.equal(model(**omnimoe_inputs).logits, expected)
        assert torch.equal(model.generate(**{k: v for k, v in omnimoe_inputs.items() if k != "labels"},
                                          max_new_tokens=3, do_sample=False),
                           omnimoe.generate(**{k: v for k, v in omnimoe_inputs.items() if k != "labels"},
                                            max_new_tokens=3, do_sample=False))  # fmt: skip
    model.train()
    outputs = model(**omnimoe_inputs)
    assert torch.equal(outputs.logits.detach(), expected)
    assert outputs.smoes_mi.shape == (3,) and int(model.model.language_model.smoes.step) == 1


def test_omnimoe_smoes_replaces_the_language_balancing_only(omnimoe, omnimoe_inputs):
    """E2-style: with SMoES off the training loss is the model's own, bit for bit; on, the language experts'
    load balancing gives way to the SMoES loss and everything else (LM loss, route objectives, the vision experts'
    balancing) stays."""
    reference = copy.deepcopy(omnimoe).train()
    with torch.no_grad():
        expected = reference(**omnimoe_inputs, output_router_logits=True)
    off = with_smoes(omnimoe, smoes_enabled=False).train()
    with torch.no_grad():
        assert torch.equal(off(**omnimoe_inputs, output_router_logits=True).loss, expected.loss)
    model = with_smoes(omnimoe).train()
    with torch.no_grad():
        outputs = model(**omnimoe_inputs, output_router_logits=True)
    text = omnimoe.config.text_config
    language_balancing = text.router_aux_loss_coef * load_balancing_loss(
        expected.router_logits, text.num_experts, text.num_experts_per_tok
    )
    smoes_loss = TINY["smoes_bal_coef"] * outputs.smoes_bal_loss + TINY["smoes_mi_coef"] * outputs.smoes_mi_loss
    torch.testing.assert_close(outputs.aux_loss, expected.aux_loss - language_balancing + smoes_loss)
    torch.testing.assert_close(outputs.loss, expected.loss - language_balancing + smoes_loss)
    # Without output_router_logits the base has no balancing term at all; SMoES' loss is added alone.
    with torch.no_grad():
        bare = model(**omnimoe_inputs)
    torch.testing.assert_close(bare.aux_loss, TINY["smoes_bal_coef"] * bare.smoes_bal_loss + bare.smoes_mi_loss)


def test_gradient_checkpointing_updates_the_buffers_once_with_the_same_gradients(moemb, moemb_inputs):
    grads = []
    for checkpointing in (False, True):
        model = with_smoes(moemb, smoes_score_type="attention").train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(**moemb_inputs).aux_loss.backward()
        assert int(model.model.language_model.smoes.step) == 1
        grads.append(torch.stack([layer.mlp.gate.weight.grad for layer in model.model.language_model.layers]))
    torch.testing.assert_close(grads[0], grads[1])
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant gradient checkpointing"):
        model(**moemb_inputs)


# --- save, load, export ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["moemb", "omnimoe_vl"])
def test_a_saved_folder_round_trips_the_settings_and_buffers(host, moemb, moemb_inputs, omnimoe, omnimoe_inputs,
                                                             tmp_path):  # fmt: skip
    base, inputs, model_class = {
        "moemb": (moemb, moemb_inputs, MoEmbForEmbedding),
        "omnimoe_vl": (omnimoe, omnimoe_inputs, OmniMoeVlForConditionalGeneration),
    }[host]
    model = with_smoes(base, smoes_score_type="gaussian").train()
    for _ in range(2):
        model(**inputs)  # the statistics, counts and bins move
    model.eval().save_pretrained(tmp_path)
    loaded = model_class.from_pretrained(tmp_path).eval()
    loaded.set_experts_implementation("eager")
    assert loaded.config.smoes == model.config.smoes == settings(smoes_score_type="gaussian").to_dict()
    saved = smoes_buffers(model)
    assert saved and all(torch.equal(buffer, saved[name]) for name, buffer in smoes_buffers(loaded).items())
    assert int(loaded.model.language_model.smoes.step) == 2
    with torch.no_grad():
        output = "embeddings" if host == "moemb" else "logits"
        assert torch.equal(getattr(loaded(**inputs), output), getattr(model(**inputs), output))


def test_moemb_export_is_bin_aligned_and_keeps_the_embeddings(moemb, moemb_inputs):
    model = with_smoes(moemb).train()
    state = model.model.language_model.smoes.states[3]
    state.bins.copy_(torch.tensor([1, 0, 1, 0, 0, 1, 1, 0]))
    with torch.no_grad():
        expected = model.eval()(**moemb_inputs).embeddings
        smoes_export_bin_aligned(model)
        torch.testing.assert_close(model(**moemb_inputs).embeddings, expected, atol=1e-6, rtol=0)
    assert torch.equal(state.bins, contiguous_bins(8, 2))


# --- bad input ---------------------------------------------------------------------------------------------------


def moemb_config(**changes) -> MoEmbConfig:
    return MoEmbConfig(**copy.deepcopy(TINY_MOEMB) | {"router_trainable": True} | changes)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: moemb_config(smoes=dict(smoes_num_bins=3)), r"SmoesSettings.smoes_num_bins=3 does not divide "
                                                             r"num_experts=8"),
        (lambda: moemb_config(router_trainable=False, smoes={}), r"MoEmbConfig.router_trainable=False freezes them"),
        (lambda: moemb_config(moe_variant="modality", router_trainable=None, text_config={
            **TINY_MOEMB["text_config"], "num_experts": 3, "num_experts_per_tok": 1}, smoes={}),
         r"MoEmbConfig.smoes needs a learned top-k router"),
        (lambda: moemb_config(text_config={**TINY_MOEMB["text_config"], "layer_types": ["linear_attention"] * 8},
                              smoes=dict(smoes_score_type="attention")),
         r"smoes_score_type='attention' needs a softmax-attention layer"),
        (lambda: moemb_config(smoes=dict(smoes_bins=2)), r"MoEmbConfig.smoes has unknown fields \['smoes_bins'\]"),
        (lambda: OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL), smoes=dict(smoes_num_bins=16)),
         r"smoes_num_bins=16 does not divide num_experts=8"),
        (lambda: OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL), smoes=dict(smoes_ema_beta=1.0)),
         r"SmoesSettings.smoes_ema_beta must be a probability"),
        (lambda: settings().check_host(8, 4, expert_groups=2), r"2 contiguous expert groups \(group-limited"),
    ],
)
def test_bad_settings_fail_at_configuration_time_naming_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_enable_smoes_refuses_what_it_cannot_run(moemb, omnimoe, omnimoe_inputs):
    frozen = copy.deepcopy(moemb)
    frozen.config.router_trainable = False
    with pytest.raises(ValueError, match="router_trainable=False freezes them"):
        enable_smoes(frozen, settings())
    assert frozen.config.smoes is None and frozen.model.language_model.smoes is None  # left as it was
    model = with_smoes(moemb)
    with pytest.raises(ValueError, match="has SMoES already"):
        enable_smoes(model, settings())
    with pytest.raises(ValueError, match="not a zoo model with an SMoES host"):
        enable_smoes(moemb.model.visual)
    # OmniMoE-VL's config cannot know which stage freezes the routers: the training forward refuses them.
    model = with_smoes(omnimoe).train()
    model.model.language_model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"smoes_mi_coef=1.0 and smoes_bal_coef=0.01 train the routers, but 3 router"):
        model(**omnimoe_inputs)


# --- learning ----------------------------------------------------------------------------------------------------


def routers_trained_for(model, batches, loss_of, learning_rate: float = 3e-2):
    """Train only the language routers (Adam) on `batches`; returns each step's mean MI over the MoE layers."""
    model.requires_grad_(False)
    blocks = [module for module in model.model.language_model.modules() if isinstance(module, SparseMoeBlock)]
    routers = [block.gate.weight for block in blocks]
    for router in routers:
        router.requires_grad_(True)
    optimizer = torch.optim.Adam(routers, lr=learning_rate)
    model.train()
    information = []
    for batch in batches:
        loss, mi = loss_of(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        information.append(mi)
    return information


def mean_msi(model, batches, modality, num_experts: int, top_k: int) -> float:
    from moezoo.modeling.moe.smoes.regularizer import per_token_rows
    from moezoo.training.smoes_hosts import evaluation_routing

    routing = evaluation_routing(model, batches, modality)
    selections = [[per_token_rows(logits, valid).topk(top_k, dim=-1).indices for logits in layers]
                  for layers, _, valid in routing]  # fmt: skip
    _, msi = modality_routing(selections, [m for _, m, _ in routing], [v for _, _, v in routing], num_experts)
    return sum(msi) / len(msi)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moemb_learns_modality_specialisation_with_smoes(tiny_moemb, precision):
    """Six InfoNCE steps on the synthetic image -> caption retrieval, routers trained: with SMoES the queries' MI
    rises and the MSI of held-out queries ends above the run without it; also with each forward and the loss under
    bf16 autocast (the Trainer's `--bf16`; `test_mixed_precision`)."""
    from moezoo.processors.moemb import MoEmbProcessor
    from moezoo.training.moemb import MoEmbCollator, info_nce_loss, load_mmeb_dataset
    from moezoo.training.moemb_synthetic import ShapeRetrieval
    from moezoo.training.smoes_hosts import token_type_modality

    collator = MoEmbCollator(MoEmbProcessor.from_pretrained(tiny_moemb))
    records = ShapeRetrieval().training_dataset(64, torch.Generator().manual_seed(0), directions=("image_to_text",))
    data = load_mmeb_dataset(records)
    batches = [collator([data[i] for i in range(start, start + 8)]) for start in range(0, 48, 8)]
    held_out = collator([data[i] for i in range(48, 64)])["query"]

    def loss_of(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            queries, targets = model(**batch["query"][0]), model(**batch["target"][0])
            loss = info_nce_loss(queries.embeddings, targets.embeddings, model.config.logit_scale)
        if queries.aux_loss is None:
            return loss, None
        return loss + queries.aux_loss + targets.aux_loss, queries.smoes_mi.mean().item()

    msi = {}
    for smoes in (False, True):
        torch.manual_seed(0)
        model = MoEmbForEmbedding.from_pretrained(tiny_moemb)
        if smoes:
            model.config.router_trainable = True
            enable_smoes(model, settings())
        information = routers_trained_for(model, batches, loss_of)
        msi[smoes] = mean_msi(model, held_out, token_type_modality((1, 2)), 8, 4)
    assert information[-1] > 2 * information[0], information
    assert msi[True] > msi[False] + 0.05, msi


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_omnimoe_learns_modality_specialisation_with_smoes(precision):
    """Six steps of the language-model loss on image questions, language routers trained: with SMoES the MI rises
    and the MSI of held-out samples ends above the run without it; also with each forward under bf16 autocast (the
    Trainer's `--bf16`; `test_mixed_precision`)."""
    from test_omnimoe_vl_training import examples

    from moezoo.processors.build_omnimoe_vl import make_omnimoe_vl_processor
    from moezoo.training.omnimoe_vl import OmniMoeVlCollator, image_token_modality

    config = OmniMoeVlConfig(**copy.deepcopy(TINY_OMNIMOE_VL))
    collator = OmniMoeVlCollator(make_omnimoe_vl_processor(config))
    samples = examples(32)
    batches = [collator(samples[start : start + 4]) for start in range(0, 24, 4)]
    held_out = [collator(samples[24:])]

    def loss_of(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            outputs = model(**batch)
        return outputs.loss, None if outputs.smoes_mi is None else outputs.smoes_mi.mean().item()

    msi = {}
    for smoes in (False, True):
        torch.manual_seed(0)
        model = OmniMoeVlForConditionalGeneration(config)
        model.model.projector.depth_router.routing_step.fill_(config.exploration_steps)
        if smoes:
            enable_smoes(model, settings())
        information = routers_trained_for(model, batches, loss_of)
        msi[smoes] = mean_msi(model, held_out, image_token_modality(model), 8, 2)
    assert information[-1] > 2 * information[0], information
    assert msi[True] > msi[False] + 0.05, msi


# --- the train commands ------------------------------------------------------------------------------------------


def test_smoes_options_need_smoes():
    parser = argparse.ArgumentParser()
    add_smoes_arguments(parser)
    assert smoes_settings_from_args(parser.parse_args([])) is None
    assert smoes_settings_from_args(parser.parse_args(["--smoes"])) == SmoesSettings()
    given = smoes_settings_from_args(parser.parse_args(["--smoes", "--smoes-num-bins", "2", "--smoes-score-type",
                                                        "attention", "--smoes-mi-coef", "0.5"]))  # fmt: skip
    assert given == SmoesSettings(smoes_num_bins=2, smoes_score_type="attention", smoes_mi_coef=0.5)
    with pytest.raises(ValueError, match="--smoes-num-bins, --smoes-mi-coef set SMoES up: add --smoes"):
        smoes_settings_from_args(parser.parse_args(["--smoes-num-bins", "2", "--smoes-mi-coef", "0.5"]))


SMOES_COMMAND = ["--smoes", "--smoes-num-bins", "2", "--smoes-ep-devices", "2", "--smoes-mi-coef", "1.0",
                 "--steps", "2", "--batch-size", "4", "--logging-steps", "1"]  # fmt: skip


def check_smoes_run(out, model_class, num_moe_layers: int) -> None:
    for name in ("smoes_msi.json", "routing_by_modality.png", "training_curves.png"):
        assert (out / name).is_file(), name
    msi = json.loads((out / "smoes_msi.json").read_text())
    assert len(msi["msi_per_layer"]) == num_moe_layers and 0 <= msi["msi"] <= 1
    training = json.loads((out / "moezoo.json").read_text())["training"]
    assert training["msi"] == msi["msi"] and training["smoes_step"] >= 2
    model = model_class.from_pretrained(out)
    assert model.config.smoes == settings(smoes_bal_coef=0.001).to_dict()
    assert int(model.model.language_model.smoes.step) == training["smoes_step"]


def test_train_moemb_with_smoes(tiny_moemb, tmp_path):
    from moezoo.training.moemb import add_train_arguments, run_train
    from moezoo.training.moemb_synthetic import ShapeRetrieval

    data = ShapeRetrieval().write_mmeb_training(tmp_path / "mmeb", 8, torch.Generator().manual_seed(3))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    command = ["--model", str(tiny_moemb), "--data", str(data), "--lora-r", "2", "--lora-alpha", "4", *SMOES_COMMAND]
    with pytest.raises(ValueError, match=r"GradCache \(--chunk-size\) runs each one twice"):
        run_train(parser.parse_args([*command, "--out", str(tmp_path / "no"), "--chunk-size", "2"]))
    assert run_train(parser.parse_args([*command, "--out", str(tmp_path / "out")])) == 0
    check_smoes_run(tmp_path / "out", MoEmbForEmbedding, num_moe_layers=8)
    assert MoEmbForEmbedding.from_pretrained(tmp_path / "out").config.router_trainable  # the routers trained


def test_train_omnimoe_vl_with_smoes(tmp_path):
    from test_omnimoe_vl_training import examples

    from moezoo.training.omnimoe_vl import add_train_arguments, run_train
    from moezoo.zoo import create_from_preset

    create_from_preset("tiny-omnimoe_vl", tmp_path / "tiny")
    with open(tmp_path / "train.jsonl", "w") as file:
        for index, example in enumerate(examples(4)):
            example["image"].save(tmp_path / f"{index}.png")
            file.write(json.dumps({"image": f"{index}.png", "question": example["question"],
                                   "answer": example["answer"]}) + "\n")  # fmt: skip
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    command = ["--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "train.jsonl"), *SMOES_COMMAND]
    with pytest.raises(ValueError, match="trains the language routers, which Stage I freezes"):
        run_train(parser.parse_args([*command, "--out", str(tmp_path / "stage1"), "--stage", "I"]))
    assert run_train(parser.parse_args([*command, "--out", str(tmp_path / "out"), "--stage", "II"])) == 0
    check_smoes_run(tmp_path / "out", OmniMoeVlForConditionalGeneration, num_moe_layers=3)


def test_the_trainers_log_the_smoes_terms_of_each_forward(moemb, moemb_inputs):
    class Recorder(LogsSmoesTerms):
        pass

    model = with_smoes(moemb).train()
    outputs = [model(**moemb_inputs), model(**moemb_inputs), moemb.train()(**moemb_inputs)]  # the last without SMoES
    moemb.eval()
    recorder = Recorder()
    torch.testing.assert_close(recorder.record_smoes_terms(outputs), outputs[0].aux_loss + outputs[1].aux_loss)
    names = {"smoes_loss", "smoes_bal_loss", "smoes_mi_loss"} | {f"smoes/mi_layer_{layer}" for layer in range(8)}
    assert set(recorder._step_totals) == names
    torch.testing.assert_close(recorder._step_totals["smoes/mi_layer_3"],
                               (outputs[0].smoes_mi[3] + outputs[1].smoes_mi[3]) / 2)  # fmt: skip
    assert Recorder().record_smoes_terms(outputs[2:]) is None


@pytest.mark.slow  # a fresh process (loading without moezoo)
def test_an_exported_smoes_model_loads_without_moezoo(omnimoe, omnimoe_inputs, tmp_path):
    """`moezoo export` of an OmniMoE-VL trained one step with SMoES: in a process without moezoo, transformers loads
    it from the flattened code with its SMoES settings and buffers, and its logits are the saved model's."""
    from conftest import run_python

    from moezoo.cli import main
    from moezoo.processors.build_omnimoe_vl import make_omnimoe_vl_processor

    model = with_smoes(omnimoe).train()
    model(**omnimoe_inputs)
    model.eval().save_pretrained(tmp_path / "created")
    make_omnimoe_vl_processor(model.config).save_pretrained(tmp_path / "created")
    inputs = {name: value for name, value in omnimoe_inputs.items() if name != "labels"}
    with torch.no_grad():
        torch.save({"inputs": inputs, "logits": model(**inputs).logits, "buffers": smoes_buffers(model)},
                   tmp_path / "expected.pt")  # fmt: skip
    # the command in this process: a fresh interpreter adds seconds of imports and checks nothing more
    created, exported = str(tmp_path / "created"), str(tmp_path / "exported")
    assert main(["export", created, "--out", exported, "--repo-id", "zoo/smoes"]) == 0
    run_python(f"""
        import torch, transformers
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForImageTextToText.from_pretrained({str(tmp_path / "exported")!r},
                                                                         trust_remote_code=True).eval()
        assert model.config.smoes["smoes_num_bins"] == 2 and int(model.model.language_model.smoes.step) == 1
        buffers = dict(model.named_buffers())
        assert all(torch.equal(buffers[name], value) for name, value in expected["buffers"].items())
        with torch.no_grad():
            torch.testing.assert_close(model(**expected["inputs"]).logits, expected["logits"], atol=1e-5, rtol=0)
    """, without_moezoo=True)
