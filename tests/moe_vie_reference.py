"""A fake official MoE-ViE checkpoint and a reference forward of the official model, for the conversion tests.

Both are written from spec moe_vie.md §2.3-2.4 and the key layout of §6.1 alone, in plain PyTorch, without
moezoo's modules: a conv patch embedding, 1-based 2D RoPE with x first and interleaved pairs, fused `in_proj`
attention, the sigmoid-router MoE formula with a selection-only bias, multi-head attention pooling, and text pooled
at argmax(input_ids). Converted models are compared against it.
"""

import math

import torch
from torch.nn import functional as F


# The sizes of the tiny configuration (spec §5.2), as an official checkpoint would have them.
TINY_DIMS = dict(
    width=32, layers=3, heads=4, patch=4, mlp=64, expert_mlp=16, routed=7, shared=1, coarse_k=1, split=4,
    moe_layers=[1, 2], pool_heads=2, pool_mlp=128, embed_dim=24, image_size=16,
    text_width=32, text_layers=2, text_heads=4, text_mlp=48, vocab=99, context=16,
)


def routed_top_k(dims):
    return dims["coarse_k"] * dims["split"] - dims["shared"]


def official_model_config(dims=TINY_DIMS):
    """The OpenCLIP model config (open_clip/model_configs/*.json format) of a checkpoint with these sizes."""
    return {
        "embed_dim": dims["embed_dim"],
        "vision_cfg": {
            "image_size": dims["image_size"], "layers": dims["layers"], "width": dims["width"],
            "heads": dims["heads"], "patch_size": dims["patch"], "use_rope2d": True, "use_cls_token": False,
            "use_ln_pre": True, "use_ln_post": False, "pool_type": "attn", "attn_pooler_heads": dims["pool_heads"],
            "num_of_expert": (dims["routed"] + dims["shared"]) // dims["split"], "split": dims["split"],
            "k": dims["coarse_k"], "moe_layers": dims["moe_layers"],
        },
        "text_cfg": {
            "context_length": dims["context"], "vocab_size": dims["vocab"], "width": dims["text_width"],
            "heads": dims["text_heads"], "layers": dims["text_layers"], "use_ln_post": False, "pool_type": "argmax",
        },
    }


def make_official_state_dict(dims=TINY_DIMS, seed=0, meta=False):
    """Random tensors in the official key layout (spec §6.1), scaled so that activations stay O(1); with `meta`,
    shapes only (for the full-size configurations)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        if meta:
            return torch.empty(*shape, device="meta")
        return torch.randn(*shape, generator=generator) * std

    def linear(prefix, n_in, n_out, bias=True):
        tensors = {f"{prefix}.weight": randn(n_out, n_in, std=n_in**-0.5)}
        if bias:
            tensors[f"{prefix}.bias"] = randn(n_out, std=0.05)
        return tensors

    def layer_norm(prefix, width):
        return {f"{prefix}.weight": 1 + randn(width, std=0.1), f"{prefix}.bias": randn(width, std=0.1)}

    def block(prefix, width, heads):
        return {
            **layer_norm(f"{prefix}.attn.ln", width),
            f"{prefix}.attn.attn.in_proj_weight": randn(3 * width, width, std=width**-0.5),
            f"{prefix}.attn.attn.in_proj_bias": randn(3 * width, std=0.05),
            **linear(f"{prefix}.attn.attn.out_proj", width, width),
            **layer_norm(f"{prefix}.mlp.ln", width),
        }

    def swiglu(prefix, width, hidden, bias=True):
        return {
            **linear(f"{prefix}.gate_proj", width, hidden, bias),
            **linear(f"{prefix}.up_proj", width, hidden, bias),
            **linear(f"{prefix}.down_proj", hidden, width, bias),
        }

    width, text_width, head_dim = dims["width"], dims["text_width"], dims["width"] // dims["heads"]
    state = {
        "logit_scale": torch.tensor(math.log(1 / 0.07)),
        "token_embedding.weight": randn(dims["vocab"], text_width, std=0.5),
        "positional_embedding": randn(dims["context"], text_width, std=0.1),
        "text_projection": randn(text_width, dims["embed_dim"], std=text_width**-0.5),
        "visual.conv1.weight": randn(width, 3, dims["patch"], dims["patch"], std=(3 * dims["patch"] ** 2) ** -0.5),
        **layer_norm("visual.ln_pre", width),
        "visual.attn_pool.probe": randn(1, 1, width),
        "visual.attn_pool.attn.in_proj_weight": randn(3 * width, width, std=width**-0.5),
        "visual.attn_pool.attn.in_proj_bias": randn(3 * width, std=0.05),
        **linear("visual.attn_pool.attn.out_proj", width, width),
        **layer_norm("visual.attn_pool.layernorm", width),
        **linear("visual.attn_pool.mlp.c_fc", width, dims["pool_mlp"]),
        **linear("visual.attn_pool.mlp.c_proj", dims["pool_mlp"], width),
        "visual.proj": randn(width, dims["embed_dim"], std=width**-0.5),
    }
    for i in range(dims["text_layers"]):
        state |= block(f"transformer.resblocks.{i}", text_width, dims["text_heads"])
        state |= swiglu(f"transformer.resblocks.{i}.mlp.mlp", text_width, dims["text_mlp"])
    for i in range(dims["layers"]):
        prefix = f"visual.transformer.resblocks.{i}"
        state |= block(prefix, width, dims["heads"])
        freqs = 1.0 / 10000 ** (torch.arange(0, head_dim // 2, 2) / (head_dim // 2))
        state[f"{prefix}.attn.attn.rope.freqs"] = freqs.to("meta") if meta else freqs
        if i in dims["moe_layers"]:
            routed, expert = dims["routed"], dims["expert_mlp"]
            state |= {
                f"{prefix}.mlp.moe.w1": randn(routed, 2 * expert, width, std=width**-0.5),
                f"{prefix}.mlp.moe.w2": randn(routed, width, expert, std=expert**-0.5),
                f"{prefix}.mlp.moe._gate_module.weight": randn(routed, width, std=width**-0.5),
                f"{prefix}.mlp.moe.expert_bias": randn(routed, std=0.3),
            }
            state |= swiglu(f"{prefix}.mlp.moe._shared_module", width, dims["shared"] * expert, bias=False)
        else:
            state |= swiglu(f"{prefix}.mlp.mlp", width, dims["mlp"])
    return state


# --- the reference forward ---------------------------------------------------------------------------------------


def _linear(x, state, prefix, bias=True):
    return F.linear(x, state[f"{prefix}.weight"], state[f"{prefix}.bias"] if bias else None)


def _layer_norm(x, state, prefix):
    return F.layer_norm(x, x.shape[-1:], state[f"{prefix}.weight"], state[f"{prefix}.bias"], eps=1e-5)


def _swiglu(x, state, prefix, bias=True):
    hidden = F.silu(_linear(x, state, f"{prefix}.gate_proj", bias)) * _linear(x, state, f"{prefix}.up_proj", bias)
    return _linear(hidden, state, f"{prefix}.down_proj", bias)


def _rotate(x, angles):
    """Interleaved RoPE: channels (2j, 2j+1) turn by angles[2j] (== angles[2j+1])."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles[..., 0::2].cos(), angles[..., 0::2].sin()
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def _attention(x, state, prefix, heads, angles=None, causal=False):
    batch, length, width = x.shape
    query, key, value = F.linear(x, state[f"{prefix}.in_proj_weight"], state[f"{prefix}.in_proj_bias"]).chunk(3, -1)
    query, key, value = (t.reshape(batch, length, heads, -1).transpose(1, 2) for t in (query, key, value))
    if angles is not None:
        query, key = _rotate(query, angles), _rotate(key, angles)
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    if causal:
        scores = scores + torch.full((length, length), float("-inf")).triu(1)
    out = (scores.softmax(-1) @ value).transpose(1, 2).reshape(batch, length, width)
    return _linear(out, state, f"{prefix}.out_proj")


def _moe(x, state, prefix, top_k):
    """y = sum_{e in topk(p + b)} (p_e / sum_topk p) E_e(x) + E_shared(x), p = sigmoid(W_r x)."""
    affinities = torch.sigmoid(x @ state[f"{prefix}._gate_module.weight"].t())  # (..., R)
    chosen = torch.topk(affinities + state[f"{prefix}.expert_bias"], top_k).indices
    gates = affinities.gather(-1, chosen)
    gates = gates / gates.sum(-1, keepdim=True)
    gate, up = torch.einsum("...h,rih->...ri", x, state[f"{prefix}.w1"]).chunk(2, dim=-1)
    every_expert = torch.einsum("...ri,rhi->...rh", F.silu(gate) * up, state[f"{prefix}.w2"])  # (..., R, H)
    chosen_outputs = every_expert.gather(-2, chosen[..., None].expand(*chosen.shape, x.shape[-1]))
    return (gates[..., None] * chosen_outputs).sum(-2) + _swiglu(x, state, f"{prefix}._shared_module", bias=False)


def _rope_angles(state, rows, cols):
    """(rows * cols, head_dim): [x angles ‖ y angles] of 1-based (col, row), each frequency twice, row-major."""
    freqs = state["visual.transformer.resblocks.0.attn.attn.rope.freqs"]
    angles = []
    for row in range(rows):
        for col in range(cols):
            x_angles, y_angles = (col + 1) * freqs, (row + 1) * freqs
            angles.append(torch.cat([x_angles.repeat_interleave(2), y_angles.repeat_interleave(2)]))
    return torch.stack(angles)


def reference_pooled_image_features(state, images, dims=TINY_DIMS):
    """Official vision tower on (B, 3, H, W) images -> attention-pooled features (B, width), before `proj`."""
    patch, heads, width = dims["patch"], dims["heads"], dims["width"]
    x = F.conv2d(images, state["visual.conv1.weight"], stride=patch)  # (B, width, rows, cols)
    rows, cols = x.shape[-2:]
    x = x.flatten(2).transpose(1, 2)  # row-major patches
    angles = _rope_angles(state, rows, cols)
    x = _layer_norm(x, state, "visual.ln_pre")
    for i in range(dims["layers"]):
        prefix = f"visual.transformer.resblocks.{i}"
        x = x + _attention(_layer_norm(x, state, f"{prefix}.attn.ln"), state, f"{prefix}.attn.attn", heads, angles)
        hidden = _layer_norm(x, state, f"{prefix}.mlp.ln")
        if i in dims["moe_layers"]:
            x = x + _moe(hidden, state, f"{prefix}.mlp.moe", routed_top_k(dims))
        else:
            x = x + _swiglu(hidden, state, f"{prefix}.mlp.mlp")
    # attention pooling: one learned probe attends over the patches
    pool = "visual.attn_pool"
    q_w, k_w, v_w = state[f"{pool}.attn.in_proj_weight"].chunk(3)
    q_b, k_b, v_b = state[f"{pool}.attn.in_proj_bias"].chunk(3)
    pool_heads = dims["pool_heads"]
    query = F.linear(state[f"{pool}.probe"], q_w, q_b).reshape(1, pool_heads, -1).transpose(0, 1)  # (h, 1, d)
    key = F.linear(x, k_w, k_b).reshape(x.shape[0], -1, pool_heads, width // pool_heads).transpose(1, 2)
    value = F.linear(x, v_w, v_b).reshape(x.shape[0], -1, pool_heads, width // pool_heads).transpose(1, 2)
    weights = (query @ key.transpose(-1, -2) * (width // pool_heads) ** -0.5).softmax(-1)  # (B, h, 1, N)
    pooled = _linear((weights @ value).transpose(1, 2).reshape(x.shape[0], 1, width), state, f"{pool}.attn.out_proj")
    hidden = _layer_norm(pooled, state, f"{pool}.layernorm")
    pooled = pooled + _linear(F.gelu(_linear(hidden, state, f"{pool}.mlp.c_fc")), state, f"{pool}.mlp.c_proj")
    return pooled[:, 0]


def reference_image_embeds(state, images, dims=TINY_DIMS):
    return reference_pooled_image_features(state, images, dims) @ state["visual.proj"]


def reference_video_embeds(state, videos, dims=TINY_DIMS):
    """Videos as lists of (T_i, 3, H, W) frame stacks: pooled frame features averaged, then projected."""
    return torch.stack(
        [reference_pooled_image_features(state, frames, dims).mean(0) @ state["visual.proj"] for frames in videos]
    )


def reference_text_embeds(state, input_ids, dims=TINY_DIMS):
    x = state["token_embedding.weight"][input_ids] + state["positional_embedding"][: input_ids.shape[1]]
    for i in range(dims["text_layers"]):
        prefix = f"transformer.resblocks.{i}"
        hidden = _layer_norm(x, state, f"{prefix}.attn.ln")
        x = x + _attention(hidden, state, f"{prefix}.attn.attn", dims["text_heads"], causal=True)
        x = x + _swiglu(_layer_norm(x, state, f"{prefix}.mlp.ln"), state, f"{prefix}.mlp.mlp")
    pooled = x[torch.arange(x.shape[0]), input_ids.argmax(-1)]  # the EOT token has the largest id
    return pooled @ state["text_projection"]


def reference_logits_per_image(state, image_embeds, text_embeds):
    image_embeds = F.normalize(image_embeds, dim=-1)
    text_embeds = F.normalize(text_embeds, dim=-1)
    return state["logit_scale"].exp() * image_embeds @ text_embeds.t()


def patchify(images, patch):
    """(B, C, H, W) -> NaFlex patches (B, rows * cols, patch * patch * C) in (py, px, c) order, row-major."""
    batch, channels, height, width = images.shape
    grid = images.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return grid.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // patch) * (width // patch), -1)
