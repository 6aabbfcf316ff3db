"""MoE-ViE training: the global contrastive loss, video fine-tuning's freezing and distillation, the command, and a
learning test on synthetic coloured shapes (spec moe_vie.md §10 items 10-11)."""

import io
import json
import tarfile

import pytest
import torch
from transformers import TrainingArguments

from conftest import run_moezoo
from moezoo.evaluation.moe_vie import zero_shot_classification
from moezoo.modeling.moe.router import TopKRouter
from moezoo.modeling.moe.statistics import record_routing
from moezoo.modeling.moe_vie import MoeVieModel
from moezoo.processors.moe_vie import MoeVieProcessor
from moezoo.training.callbacks import RoutingBiasCallback
from moezoo.training.moe_vie import (
    MoeVieTrainingOptions,
    VideoDistillationTrainer,
    VideoTextCollator,
    frame_distillation_loss,
    freeze_for_video_finetuning,
    global_contrastive_loss,
    set_loss_type,
    train_moe_vie,
)
from moezoo.training.synthetic import ColouredShapes
from moezoo.zoo import create_from_preset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    create_from_preset("tiny-moe_vie", folder, seed=0)
    return folder


def shapes(colours=("red", "blue")):
    return ColouredShapes(image_size=16, colours=colours, held_out=())


@pytest.mark.parametrize("loss_type", ["softmax", "sigmoid"])
def test_single_process_global_loss_is_the_models_own_loss(tiny, loss_type):
    model = MoeVieModel.from_pretrained(tiny)
    set_loss_type(model, loss_type)
    processor = MoeVieProcessor.from_pretrained(tiny)
    examples = shapes().sample(6, torch.Generator().manual_seed(0))
    inputs = processor(text=[e.caption for e in examples], images=[e.image for e in examples], return_tensors="pt")
    outputs = model(**inputs, return_loss=True)
    assert torch.allclose(global_contrastive_loss(model, outputs.image_embeds, outputs.text_embeds), outputs.loss)


def test_frame_distillation_is_zero_for_identical_embeddings_and_two_for_opposite():
    frames = torch.randn(5, 24)
    assert frame_distillation_loss(frames, frames).abs() < 1e-6
    assert torch.isclose(frame_distillation_loss(frames, -frames), torch.tensor(2.0))


def test_video_finetuning_freezes_experts_routers_and_text_mlps(tiny, tmp_path):
    model = MoeVieModel.from_pretrained(tiny)
    processor = MoeVieProcessor.from_pretrained(tiny)
    counts = freeze_for_video_finetuning(model)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    buffers = {name: b.clone() for name, b in model.named_buffers() if "e_score_correction_bias" in name}
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert counts["frozen"] == sum(p.numel() for p in frozen.values())
    assert any(".mlp.experts." in name for name in frozen) and any(".mlp.gate." in name for name in frozen)
    assert any(name.startswith("text_model.") and ".mlp." in name for name in frozen)
    assert all(".mlp." not in name for name in trainable if ".encoder.layers." in name)  # the pooling head trains

    data = shapes().video_text_dataset(8, 3, torch.Generator().manual_seed(1))
    teacher = MoeVieModel.from_pretrained(tiny)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to="none", save_strategy="no", use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True, logging_steps=1)
    trainer = VideoDistillationTrainer(model=model, args=args, train_dataset=data, teacher=teacher,
                                       data_collator=VideoTextCollator(processor, num_frames=3),
                                       callbacks=[RoutingBiasCallback()])
    trainer.train()
    distillation = [log["distillation_loss"] for log in trainer.state.log_history if "distillation_loss" in log]
    # Logged beside the loss: zero at the first step, where the student is still the teacher.
    assert len(distillation) == 2 and distillation[0] == pytest.approx(0, abs=1e-6) and 0 < distillation[1] < 2
    for name, before in frozen.items():
        assert torch.equal(before, model.get_parameter(name)), name
    for name, before in buffers.items():
        assert torch.equal(before, model.get_buffer(name)), name  # frozen routers get no balancing update
    assert any(not torch.equal(before, model.get_parameter(name)) for name, before in trainable.items())
    assert all(torch.equal(p, teacher.get_parameter(n)) for n, p in teacher.named_parameters())  # teacher untouched


def test_train_command_writes_model_curves_heatmap_and_provenance(tiny, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i, example in enumerate(shapes().sample(12, torch.Generator().manual_seed(2))):
        example.image.save(data / f"{i}.png")
        rows.append({"path": f"{i}.png", "caption": example.caption})
    (data / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_moezoo("train", "moe_vie", "--model", tiny, "--data", data / "pairs.jsonl", "--out", tmp_path / "out",
                        "--image-column", "path", "--text-column", "caption", "--steps", "3", "--batch-size", "4",
                        "--lora-r", "2", "--loss", "sigmoid")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    for name in ("model.safetensors", "processor_config.json", "training_curves.png", "routing_heatmap.png"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()
    provenance = json.loads((out / "moezoo.json").read_text())
    assert provenance["training"]["steps"] == 3 and provenance["preset"] == "tiny-moe_vie"
    config = json.loads((out / "config.json").read_text())
    assert config["loss_type"] == "sigmoid"
    exported = run_moezoo("export", out, "--out", tmp_path / "hub")
    assert exported.returncode == 0, exported.stderr
    assert "## Training" in (tmp_path / "hub" / "README.md").read_text()


def test_train_command_rejects_missing_columns_and_tiny_datasets(tiny, tmp_path):
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"path": "x.png", "caption": "a"}) + "\n")
    result = run_moezoo("train", "moe_vie", "--model", tiny, "--data", tmp_path / "pairs.jsonl", "--out",
                        tmp_path / "out")
    assert result.returncode == 2 and "no column 'image'" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_moe_vie_learns_coloured_shapes(tiny, tmp_path, precision):
    """InfoNCE from scratch on 8 classes of synthetic coloured shapes: the image->text top-1 on training images
    rises far above chance (1/8), and the balancing keeps every expert in use; also with every forward under bf16
    autocast (the Trainer's `--bf16`; `test_mixed_precision`)."""
    data = shapes()
    dataset = data.image_text_dataset(2048, torch.Generator().manual_seed(0))
    options = MoeVieTrainingOptions(steps=500, batch_size=32, learning_rate=2e-3, weight_decay=0.0, warmup_steps=20,
                                    logging_steps=25, training_args={"bf16": precision == "bf16"})
    training = train_moe_vie(tiny, dataset, tmp_path / "trained", options)
    model = MoeVieModel.from_pretrained(tmp_path / "trained")
    processor = MoeVieProcessor.from_pretrained(tmp_path / "trained")
    examples = [dataset[i] for i in range(256)]
    result = zero_shot_classification(model, processor, [e["image"] for e in examples], [e["label"] for e in examples],
                                      data.class_names, templates=["a photo of a {}"], progress=False)
    assert result["top1"] > 0.8, result
    assert training["final_loss"] < 0.75 * torch.log(torch.tensor(32.0)).item()
    biases = [m.e_score_correction_bias for m in model.modules() if isinstance(m, TopKRouter)]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the balancing update ran
    batch = processor(images=[e["image"] for e in examples[:64]], return_tensors="pt")
    with torch.no_grad(), record_routing(model.vision_model) as stats:
        model.get_image_features(**batch)
    assert all((counts.sum(0) > 0).all() for counts in stats.counts.values())  # no expert ends with zero load


def test_webdataset_shards_and_gradient_checkpointing(tiny, tmp_path):
    examples = shapes().sample(8, torch.Generator().manual_seed(4))
    with tarfile.open(tmp_path / "shard-000.tar", "w") as shard:
        for i, example in enumerate(examples):
            for suffix, payload in (("png", None), ("txt", example.caption.encode())):
                if payload is None:
                    buffer = io.BytesIO()
                    example.image.save(buffer, "PNG")
                    payload = buffer.getvalue()
                entry = tarfile.TarInfo(f"{i:05d}.{suffix}")
                entry.size = len(payload)
                shard.addfile(entry, io.BytesIO(payload))
    options = MoeVieTrainingOptions(steps=2, batch_size=4, gradient_checkpointing=True, logging_steps=1)
    training = train_moe_vie(tiny, tmp_path / "shard-000.tar", tmp_path / "out", options)
    assert training["examples"] == 8 and (tmp_path / "out" / "model.safetensors").is_file()
