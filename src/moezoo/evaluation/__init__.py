"""Evaluation of the zoo's models, one module per architecture (`moe_vie`: zero-shot classification and
image/video-text retrieval, the protocol of the MoE-ViE paper)."""
