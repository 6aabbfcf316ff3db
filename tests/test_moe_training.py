"""The MoE core in training: PEFT LoRA on fused experts, the balancing callback, statistics, and a learning test."""

import copy
import textwrap

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from conftest import run_two_processes
from moezoo.demos.moe_core import TokenMoeModel, masked_mse
from moezoo.modeling.moe import MoeLayerSpec, SparseMoeBlock, init_moe_module, plot_routing_heatmap, record_routing
from moezoo.training.callbacks import RoutingBiasCallback
from moezoo.training.synthetic import MultimodalTokenTask


def small_model(implementation="moezoo", feature_dim=16, **spec_changes):
    task = MultimodalTokenTask(feature_dim=feature_dim, target_dim=8)
    spec = MoeLayerSpec(
        **({"hidden_size": 32, "num_experts": 6, "num_experts_per_tok": 2, "expert_intermediate_size": 16} | spec_changes)
    )
    torch.manual_seed(0)
    return task, TokenMoeModel(task.feature_dim, task.target_dim, spec, num_layers=2, experts_impl=implementation)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "moezoo"])
def test_lora_on_fused_experts_trains_and_merges_exactly(implementation):
    task, model = small_model(implementation)
    batch = task.batch(8, 12, torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_out = model(batch.features, batch.attention_mask)[0]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        assert torch.equal(peft_model(batch.features, batch.attention_mask)[0], base_out)  # adapters start as a no-op
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    frozen_before = {name: p.detach().clone() for name, p in peft_model.named_parameters() if not p.requires_grad}

    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(15):
        loss = masked_mse(peft_model(batch.features, batch.attention_mask)[0], batch.targets, batch.attention_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for name, p in peft_model.named_parameters():
        if name in frozen_before:
            assert torch.equal(p, frozen_before[name]), name

    with torch.no_grad():
        adapted = peft_model(batch.features, batch.attention_mask)[0]
        merged = peft_model.merge_and_unload()
        assert (merged(batch.features, batch.attention_mask)[0] - adapted).abs().max() < 1e-5
        assert not (adapted - base_out).abs().max() < 1e-3  # the adapters did change the model


def test_routing_statistics_by_group_and_heatmap(tmp_path):
    task, model = small_model()
    batch = task.batch(6, 10, torch.Generator().manual_seed(3))
    with torch.no_grad(), record_routing(model, group_names=task.modalities) as stats:
        stats.set_groups(batch.modality_ids)
        model(batch.features, batch.attention_mask)
        model(batch.features, batch.attention_mask)
    assert set(stats.counts) == {"blocks.0", "blocks.1"}
    valid_modalities = batch.modality_ids[batch.attention_mask.bool()]
    for counts in stats.counts.values():
        assert counts.shape == (3, 6)
        per_group = counts.sum(dim=1)
        for modality in range(3):  # two forwards, top-2: four assignments per valid token of each modality
            assert per_group[modality] == 4 * (valid_modalities == modality).sum()
    assert all(block.routing_recorder is None for block in model.blocks)
    path = plot_routing_heatmap(stats, tmp_path / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="group ids must lie in"):
        stats.set_groups(torch.full((2, 2), 5))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_router_learns_to_route_modalities_to_their_own_experts(precision):
    """The learning test behind the demo: after a short training each expert serves mostly one modality; also with
    each training forward under bf16 autocast (the Trainer's `--bf16`; `test_mixed_precision`)."""
    task, model = small_model(feature_dim=32, hidden_size=64, num_experts=12, expert_intermediate_size=64)
    held_out = task.batch(32, 16, torch.Generator().manual_seed(99))

    def specialization():
        with torch.no_grad(), record_routing(model, group_names=task.modalities) as stats:
            stats.set_groups(held_out.modality_ids)
            model(held_out.features, held_out.attention_mask)
        return min(stats.specialization().values())

    def mse():
        with torch.no_grad():
            return masked_mse(model(held_out.features, held_out.attention_mask)[0], held_out.targets,
                              held_out.attention_mask).item()

    before, mse_before = specialization(), mse()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(250):
        batch = task.batch(16, 16, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = masked_mse(model(batch.features, batch.attention_mask)[0], batch.targets, batch.attention_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = specialization()
    assert after > before + 0.2 and after > 0.8, (before, after)
    assert mse() < 0.3 * mse_before


# --- the balancing callback inside Trainer ------------------------------------------------------------------------


class BalancedToyConfig(PreTrainedConfig):
    model_type = "moezoo_balanced_toy"


class BalancedToyModel(PreTrainedModel):
    """A regression model with one sigmoid-routed, bias-balanced MoE block."""

    config_class = BalancedToyConfig

    def __init__(self, config):
        super().__init__(config)
        spec = MoeLayerSpec(hidden_size=16, num_experts=8, num_experts_per_tok=2, expert_intermediate_size=8,
                            router_type="sigmoid", routing_bias=True, bias_update_rate=1e-2)
        self.moe = SparseMoeBlock(config, spec, layer_idx=0)
        self.post_init()

    def _init_weights(self, module):
        init_moe_module(module, std=0.1)

    def forward(self, x, y):
        out, _ = self.moe(x)
        return {"loss": ((out - y) ** 2).mean()}


class CountingCallback(RoutingBiasCallback):
    """Records the counts each update sees, to check they span the whole gradient-accumulation step."""

    def __init__(self):
        super().__init__()
        self.seen_counts = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen_counts.append(int(model.moe.gate.tokens_per_expert.sum()))
        return super().on_step_end(args, state, control, model=model, **kwargs)


def test_balancing_callback_updates_once_per_optimizer_step(tmp_path):
    torch.manual_seed(0)
    model = BalancedToyModel(BalancedToyConfig())
    dataset = [{"x": torch.randn(4, 16) + 1.0, "y": torch.randn(4, 16)} for _ in range(24)]
    callback = CountingCallback()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                             max_steps=4, learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
    # 2 examples x 4 tokens x top-2 per micro-batch, 3 micro-batches per optimizer step
    assert callback.seen_counts == [2 * 4 * 2 * 3] * 4
    assert callback.updated_routers == 1
    assert model.moe.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.slow
def test_balancing_counts_are_summed_across_processes(tmp_path):
    """Two gloo processes route different data; both apply the step computed from the summed counts."""
    script = tmp_path / "balance.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        from moezoo.modeling.moe import MoeLayerSpec, TopKRouter, update_routing_biases
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        spec = MoeLayerSpec(hidden_size=4, num_experts=4, num_experts_per_tok=1, expert_intermediate_size=2,
                            router_type="sigmoid", routing_bias=True, bias_update_rate=0.1)
        router = TopKRouter(spec).train()
        with torch.no_grad():
            router.weight.copy_(torch.eye(4) * 10)
        # rank 0 sends 6 tokens to expert 0, rank 1 sends 2 tokens to expert 1
        x = torch.eye(4)[[0] * 6] if rank == 0 else torch.eye(4)[[1] * 2]
        router(x)
        update_routing_biases(router)
        torch.save(router.e_score_correction_bias, sys.argv[1] + f"/bias{rank}.pt")
        dist.destroy_process_group()
    """))
    run_two_processes(script, tmp_path)
    bias0, bias1 = torch.load(tmp_path / "bias0.pt"), torch.load(tmp_path / "bias1.pt")
    counts = torch.tensor([6.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    expected = -0.1 * (counts - counts.mean()) / counts.std(unbiased=False)
    assert torch.equal(bias0, bias1)
    assert torch.allclose(bias0.double(), expected, atol=1e-6)


@pytest.mark.slow
def test_each_process_keeps_its_own_counts_under_distributed_data_parallel(tmp_path):
    """DDP broadcasts rank 0's buffers before every forward: the counts of a micro-batch must survive the next one."""
    script = tmp_path / "ddp_counts.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from moezoo.modeling.moe import MoeLayerSpec, TopKRouter
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        spec = MoeLayerSpec(hidden_size=4, num_experts=4, num_experts_per_tok=1, expert_intermediate_size=2,
                            router_type="sigmoid", routing_bias=True)
        router = TopKRouter(spec).train()
        with torch.no_grad():
            router.weight.copy_(torch.eye(4) * 10)
        model = DistributedDataParallel(router)  # broadcast_buffers=True, the default
        # two micro-batches without no_sync: rank 0 sends 2 tokens to experts 0 then 2, rank 1 3 tokens to 1 then 3
        for expert in (0, 2) if rank == 0 else (1, 3):
            model(torch.eye(4)[[expert] * (rank + 2)])[1].sum().backward()
        torch.save(router.tokens_per_expert, sys.argv[1] + f"/counts{rank}.pt")
        dist.barrier()  # neither process tears gloo down while the other still uses it
        dist.destroy_process_group()
    """))
    run_two_processes(script, tmp_path)
    assert torch.load(tmp_path / "counts0.pt").tolist() == [2, 0, 2, 0]
    assert torch.load(tmp_path / "counts1.pt").tolist() == [0, 3, 0, 3]
