"""Toy MoE model: token and patch embeddings, residual MoE layers from the core, mean pooling."""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling, SequenceClassifierOutput

from moezoo.modeling.moe.block import SparseMoeBlock
from moezoo.modeling.moe.initialization import init_moe_module
from moezoo.modeling.moe.pretrained import MoePreTrainedMixin

from .configuration_toy import ToyMoeConfig


class ToyMoePreTrainedModel(MoePreTrainedMixin, PreTrainedModel):
    config_class = ToyMoeConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        if not init_moe_module(module, self.config.initializer_range):
            super()._init_weights(module)


class ToyMoeModel(ToyMoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.patch_embed = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.blocks = nn.ModuleList(
            SparseMoeBlock(config, config.moe_spec(), layer_idx=i) for i in range(config.num_hidden_layers)
        )
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, **kwargs):
        parts, masks = [], []
        if input_ids is not None:
            parts.append(self.embed_tokens(input_ids))
            masks.append(attention_mask if attention_mask is not None else torch.ones_like(input_ids))
        if pixel_values is not None:  # (B, C, H, W) -> (B, patches, C * p * p)
            p = self.config.patch_size
            patches = pixel_values.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
            parts.append(self.patch_embed(patches))
            masks.append(torch.ones(patches.shape[:2], dtype=torch.long, device=patches.device))
        hidden = torch.cat(parts, dim=1)
        mask = torch.cat(masks, dim=1)
        for norm, block in zip(self.norms, self.blocks):
            hidden = hidden + block(norm(hidden), attention_mask=mask)[0]
        weights = mask[..., None].to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1)
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled)


class ToyMoeForSequenceClassification(ToyMoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = ToyMoeModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, labels=None, **kwargs):
        pooled = self.model(input_ids, attention_mask, pixel_values).pooler_output
        logits = self.classifier(pooled)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)
