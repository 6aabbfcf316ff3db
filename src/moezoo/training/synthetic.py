"""Small synthetic data sets made in-house, for tests and the demo (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import ClassLabel, Dataset, Features, Sequence, Value
from datasets import Image as ImageFeature
from PIL import Image, ImageDraw
from torch import nn


@dataclass
class MultimodalTokenBatch:
    features: torch.Tensor  # (B, S, D) token features
    modality_ids: torch.LongTensor  # (B, S) which modality each token comes from
    attention_mask: torch.LongTensor  # (B, S) 1 = token, 0 = padding
    targets: torch.Tensor  # (B, S, D_out)


class MultimodalTokenTask:
    """Token sequences that mix modalities, each modality with its own hidden function to learn.

    A token of modality m has features `mu_m + z` (a modality signature plus noise) and the target `f_m(z)`, where
    `f_m` is a fixed random two-layer MLP per modality. One shared network can only fit all modalities by
    computing different functions for different modalities, which is what routed experts are for: a trained
    router sends each modality to its own experts. Sequences have random lengths (right padding), so padding-aware
    routing is exercised too.
    """

    def __init__(
        self,
        modalities: tuple[str, ...] = ("text", "image", "video"),
        feature_dim: int = 32,
        target_dim: int = 16,
        signature_scale: float = 0.6,
        seed: int = 0,
    ):
        self.modalities = modalities
        self.feature_dim = feature_dim
        self.target_dim = target_dim
        generator = torch.Generator().manual_seed(seed)
        self.signatures = signature_scale * torch.randn(len(modalities), feature_dim, generator=generator)
        self.teachers = nn.ModuleList()
        for _ in modalities:
            teacher = nn.Sequential(nn.Linear(feature_dim, 64), nn.Tanh(), nn.Linear(64, target_dim))
            for parameter in teacher.parameters():
                parameter.data = torch.randn(parameter.shape, generator=generator) * parameter.shape[-1] ** -0.5
            self.teachers.append(teacher.requires_grad_(False))

    @torch.no_grad()
    def batch(self, batch_size: int, max_length: int, generator: torch.Generator) -> MultimodalTokenBatch:
        num_modalities = len(self.modalities)
        modality_ids = torch.randint(0, num_modalities, (batch_size, max_length), generator=generator)
        lengths = torch.randint(max_length // 2, max_length + 1, (batch_size,), generator=generator)
        attention_mask = (torch.arange(max_length)[None, :] < lengths[:, None]).long()
        noise = torch.randn(batch_size, max_length, self.feature_dim, generator=generator)
        features = self.signatures[modality_ids] + noise
        targets = torch.zeros(batch_size, max_length, self.target_dim)
        for modality, teacher in enumerate(self.teachers):
            selected = modality_ids == modality
            targets[selected] = teacher(noise[selected])
        features = features * attention_mask[..., None]
        targets = targets * attention_mask[..., None]
        return MultimodalTokenBatch(features, modality_ids, attention_mask, targets)


SHAPE_COLOURS = {"red": (215, 45, 45), "green": (45, 170, 70), "blue": (50, 80, 220), "yellow": (225, 205, 40)}
SHAPES = ("circle", "square", "triangle", "cross")
MOTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass
class ShapeExample:
    image: Image.Image
    caption: str
    label: int  # index into ColouredShapes.class_names


class ColouredShapes:
    """Images of one coloured shape on a noisy background, captioned "a photo of a red square".

    Class `c * len(shapes) + s` is colour c with shape s. `held_out` combinations never appear in the training split,
    so zero-shot accuracy on them measures whether a model composes colour and shape words it learned apart.
    `clip()` makes short videos of a shape moving in one direction ("a red square moving left").
    """

    def __init__(
        self,
        image_size: int = 32,
        colours: tuple[str, ...] = tuple(SHAPE_COLOURS),
        shapes: tuple[str, ...] = SHAPES,
        held_out: tuple[tuple[str, str], ...] = (("red", "circle"), ("green", "square"), ("blue", "triangle"),
                                                 ("yellow", "cross")),
    ):
        self.image_size = image_size
        self.colours = colours
        self.shapes = shapes
        self.class_names = [f"{colour} {shape}" for colour in colours for shape in shapes]
        self.held_out = {self.class_names.index(f"{colour} {shape}") for colour, shape in held_out}
        self.seen = [label for label in range(len(self.class_names)) if label not in self.held_out]

    def caption(self, label: int) -> str:
        return f"a photo of a {self.class_names[label]}"

    def sample(self, count: int, generator: torch.Generator, split: str = "train") -> list[ShapeExample]:
        """`split`: "train" draws from the seen combinations, "held_out" from the unseen ones, "all" from both."""
        labels = {"train": self.seen, "held_out": sorted(self.held_out), "all": list(range(len(self.class_names)))}
        if split not in labels:
            raise ValueError(f"split must be one of {', '.join(labels)}, got {split!r}")
        pool = labels[split]
        picks = torch.randint(0, len(pool), (count,), generator=generator).tolist()
        return [ShapeExample(self.draw(pool[i], generator), self.caption(pool[i]), pool[i]) for i in picks]

    def draw(self, label: int, generator: torch.Generator, offset: tuple[int, int] = (0, 0)) -> Image.Image:
        colour = SHAPE_COLOURS[self.colours[label // len(self.shapes)]]
        shape = self.shapes[label % len(self.shapes)]
        size = self.image_size
        noise = torch.randint(90, 150, (size, size, 3), generator=generator, dtype=torch.uint8).numpy()
        image = Image.fromarray(noise)
        radius = int(torch.randint(size // 5, size // 3 + 1, (1,), generator=generator))
        cx, cy = (int(v) for v in torch.randint(radius, size - radius + 1, (2,), generator=generator))
        cx, cy = min(max(cx + offset[0], radius), size - radius), min(max(cy + offset[1], radius), size - radius)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        draw = ImageDraw.Draw(image)
        if shape == "circle":
            draw.ellipse(box, fill=colour)
        elif shape == "square":
            draw.rectangle(box, fill=colour)
        elif shape == "triangle":
            draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=colour)
        else:
            bar = max(1, radius // 3)
            draw.rectangle((cx - radius, cy - bar, cx + radius, cy + bar), fill=colour)
            draw.rectangle((cx - bar, cy - radius, cx + bar, cy + radius), fill=colour)
        return image

    def image_text_dataset(self, count: int, generator: torch.Generator, split: str = "train") -> Dataset:
        """A `datasets.Dataset` with `image`, `text` (the caption) and `label` columns."""
        examples = self.sample(count, generator, split)
        return Dataset.from_dict(
            {"image": [e.image for e in examples], "text": [e.caption for e in examples],
             "label": [e.label for e in examples]},
            features=Features({"image": ImageFeature(), "text": Value("string"),
                               "label": ClassLabel(names=self.class_names)}),
        )

    def video_text_dataset(self, count: int, num_frames: int, generator: torch.Generator) -> Dataset:
        """A `datasets.Dataset` of moving-shape clips: `frames` (lists of images) and `text` columns."""
        labels = torch.randint(0, len(self.class_names), (count,), generator=generator).tolist()
        motions = [list(MOTIONS)[i] for i in torch.randint(0, len(MOTIONS), (count,), generator=generator).tolist()]
        clips = [self.clip(label, motion, num_frames, generator) for label, motion in zip(labels, motions)]
        return Dataset.from_dict(
            {"frames": [frames for frames, _ in clips], "text": [caption for _, caption in clips]},
            features=Features({"frames": Sequence(ImageFeature()), "text": Value("string")}),
        )

    def clip(self, label: int, motion: str, num_frames: int, generator: torch.Generator):
        """A list of frames of shape `label` moving in direction `motion`, and its caption."""
        dx, dy = MOTIONS[motion]
        step = max(1, self.image_size // (2 * num_frames))
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        frames = [
            self.draw(label, torch.Generator().manual_seed(seed), offset=(dx * step * t, dy * step * t))
            for t in range(num_frames)
        ]
        return frames, f"a {self.class_names[label]} moving {motion}"
