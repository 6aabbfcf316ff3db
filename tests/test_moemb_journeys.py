"""MoEMB used the way transformers and PEFT users do: an unmerged LoRA adapter saved and reloaded, and a Trainer run
resumed from its checkpoint, keep the expert adapters (which PEFT does not know); the train command's seed makes it
reproducible."""

import shutil

import torch
from safetensors.torch import load_file
from transformers import TrainingArguments

from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.moemb import MoEmbProcessor
from moezoo.training.expert_lora import EXPERT_LORA_FILE, expert_adapters
from moezoo.training.moemb import (
    LoraOptions,
    MoEmbCollator,
    MoEmbLoraModel,
    MoEmbTrainer,
    MoEmbTrainingOptions,
    apply_lora,
    load_mmeb_dataset,
    merge_lora,
    train_moemb,
)
from moezoo.training.moemb_synthetic import ShapeRetrieval


def probe_batch(processor):
    image = ShapeRetrieval().shapes.draw(3, torch.Generator().manual_seed(0))
    return processor(["a red circle", {"instruction": "Find it.", "images": [image]}])


def test_saved_lora_adapter_reloads_with_its_expert_adapters(tiny_moemb, tmp_path):
    processor = MoEmbProcessor.from_pretrained(tiny_moemb)
    batch = probe_batch(processor)
    peft_model = apply_lora(MoEmbForEmbedding.from_pretrained(tiny_moemb), LoraOptions(rank=2, alpha=4, dropout=0.0))
    torch.manual_seed(0)
    for adapter in expert_adapters(peft_model.get_base_model()).values():  # as if trained: the experts change
        torch.nn.init.normal_(adapter.lora_B, std=0.1)
    with torch.no_grad():
        adapted = peft_model.eval()(**batch).embeddings
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / EXPERT_LORA_FILE).is_file()

    reloaded = MoEmbLoraModel.from_pretrained(MoEmbForEmbedding.from_pretrained(tiny_moemb), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).embeddings, adapted, atol=0, rtol=0)
        torch.testing.assert_close(merge_lora(reloaded)(**batch).embeddings, adapted, atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in reloaded.parameters())  # loaded for inference, as PEFT's adapters


def test_trainer_resumes_with_the_expert_adapters_of_its_checkpoint(tiny_moemb, tmp_path):
    processor = MoEmbProcessor.from_pretrained(tiny_moemb)
    examples = load_mmeb_dataset(ShapeRetrieval().training_dataset(8, torch.Generator().manual_seed(0)))

    def trainer():
        model = apply_lora(MoEmbForEmbedding.from_pretrained(tiny_moemb), LoraOptions(rank=2, alpha=4, dropout=0.0))
        args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=5e-2, save_strategy="steps", save_steps=1, report_to="none",
                                 use_cpu=True, remove_unused_columns=False, disable_tqdm=True)  # fmt: skip
        return model, MoEmbTrainer(model=model, args=args, train_dataset=examples,
                                   data_collator=MoEmbCollator(processor), logit_scale=50.0)  # fmt: skip

    batch = probe_batch(processor)
    model, run = trainer()
    run.train()
    with torch.no_grad():
        expected = model.eval()(**batch).embeddings
    shutil.rmtree(tmp_path / "run" / "checkpoint-2")
    model, run = trainer()
    run.train(resume_from_checkpoint=True)  # from checkpoint-1, whose expert adapters have trained one step
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**batch).embeddings, expected, atol=1e-6, rtol=0)


def test_the_train_command_is_reproducible_with_its_seed(tiny_moemb, tmp_path):
    """The seed covers the adapters' random initialisation (before the Trainer exists), not only the training."""
    data = ShapeRetrieval().write_mmeb_training(tmp_path / "mmeb", 4, torch.Generator().manual_seed(3))
    options = MoEmbTrainingOptions(steps=1, batch_size=4, learning_rate=1e-2, warmup_steps=0, logging_steps=1,
                                   lora=LoraOptions(rank=2, alpha=4, dropout=0.0))  # fmt: skip
    weights = []
    for run in range(2):
        torch.manual_seed(run)  # whatever the caller's random state
        train_moemb(tiny_moemb, data, tmp_path / f"run{run}", options)
        weights.append(load_file(tmp_path / f"run{run}" / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(weights[1][name], tensor), name
