"""Demo stage: a tiny MoE-ViE trained from scratch on synthetic coloured shapes.

16 colour-shape classes, of which 4 combinations (a red circle, a green square, a blue triangle, a yellow cross)
never appear in training. After a few minutes of InfoNCE training, zero-shot classification on those held-out
combinations is far above chance: the model composes colour and shape words it only saw apart. The routing heatmap,
grouped by the image's colour, shows the vision experts specialising.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..evaluation.moe_vie import retrieval, zero_shot_classification
from ..modeling.moe.statistics import plot_routing_heatmap, record_routing
from ..modeling.moe_vie import MoeVieModel
from ..processors.moe_vie import MoeVieProcessor
from ..terminal import console, print_table
from ..training.moe_vie import MoeVieTrainingOptions, train_moe_vie
from ..training.synthetic import ColouredShapes
from ..zoo import create_from_preset


TEMPLATES = ["a photo of a {}"]


def evaluate(model, processor, data: ColouredShapes) -> dict:
    """Zero-shot top-1 on unseen images of the seen and of the held-out combinations, and recall@1 of a retrieval
    set with one image per class (every caption has exactly one image)."""
    results = {}
    for split, seed in (("train", 11), ("held_out", 12)):
        examples = data.sample(256, torch.Generator().manual_seed(seed), split)
        results[split] = zero_shot_classification(
            model, processor, [e.image for e in examples], [e.label for e in examples], data.class_names,
            templates=TEMPLATES, progress=False,
        )["top1"]
    images = [data.draw(label, torch.Generator().manual_seed(100 + label)) for label in range(len(data.class_names))]
    ranked = retrieval(model, processor, images, [data.caption(label) for label in range(len(images))], ks=(1,),
                       progress=False)
    results["image_to_text_recall@1"] = ranked["image_to_text"]["recall@1"]
    results["text_to_image_recall@1"] = ranked["text_to_image"]["recall@1"]
    return results


@torch.no_grad()
def colour_routing(model, processor, data: ColouredShapes, path: Path) -> Path:
    examples = data.sample(96, torch.Generator().manual_seed(21), "all")
    batch = processor(images=[e.image for e in examples], return_tensors="pt")
    colours = torch.tensor([e.label // len(data.shapes) for e in examples])
    with record_routing(model.vision_model, group_names=data.colours) as stats:
        stats.set_groups(colours[:, None].expand_as(batch["pixel_attention_mask"]))
        model.get_image_features(**batch)
    return plot_routing_heatmap(stats, path, title="MoE-ViE vision experts by image colour")


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = ColouredShapes(image_size=16)
    held_out = ", ".join(data.class_names[label] for label in sorted(data.held_out))
    console.print(
        f"{len(data.class_names)} colour-shape classes at 16x16 px; never seen in training: {held_out}. "
        f"Chance is 1/{len(data.class_names)} = {1 / len(data.class_names):.3f}."
    )
    created = create_from_preset("tiny-moe_vie", out_dir / "created", seed=0, overwrite=True)
    model, processor = MoeVieModel.from_pretrained(created), MoeVieProcessor.from_pretrained(created)
    before = evaluate(model, processor, data)

    steps = 400 if quick else 1500
    options = MoeVieTrainingOptions(steps=steps, batch_size=32, learning_rate=2e-3, weight_decay=0.0,
                                    warmup_steps=50, logging_steps=max(1, steps // 40))
    dataset = data.image_text_dataset(8192, torch.Generator().manual_seed(0), split="train")
    console.print(f"training tiny-moe_vie from scratch: {steps} steps of InfoNCE, batch {options.batch_size}")
    train_moe_vie(created, dataset, out_dir / "trained", options, overwrite=True)
    model, processor = MoeVieModel.from_pretrained(out_dir / "trained"), MoeVieProcessor.from_pretrained(
        out_dir / "trained")
    after = evaluate(model, processor, data)
    print_table(
        "MoE-ViE on synthetic coloured shapes",
        ["metric", "before training", "after training", "chance"],
        [
            ["zero-shot top-1, seen combinations", before["train"], after["train"], 1 / 16],
            ["zero-shot top-1, held-out combinations", before["held_out"], after["held_out"], 1 / 16],
            ["image -> text recall@1 (16 images)", before["image_to_text_recall@1"], after["image_to_text_recall@1"],
             1 / 16],
            ["text -> image recall@1 (16 captions)", before["text_to_image_recall@1"],
             after["text_to_image_recall@1"], 1 / 16],
        ],
    )
    heatmap = colour_routing(model, processor, data, out_dir / "routing_by_colour.png")
    console.print(f"wrote {heatmap} and {out_dir / 'trained' / 'training_curves.png'}")
    return {"before": before, "after": after, "heatmap": heatmap}
