"""Small synthetic data sets made in-house, for tests and the demo (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
