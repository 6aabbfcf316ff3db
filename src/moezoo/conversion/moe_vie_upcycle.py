"""SigLIP / SigLIP2 -> a MoE-ViE-style model by dense-to-MoE upcycling, exact at initialisation (spec moe_vie.md §6.2).

The paper trains MoE-ViE from scratch; this is the team's extension. Each vision MLP of `moe_layers`,
`y = W2 act(W1 x + b1) + b2` with `I` hidden units, is cut into `granularity` (c) contiguous chunks of `I / c` units;
an MLP is exactly the sum over its hidden units, so it is the sum of its chunks. Then:

- the `n_shared_experts` (m) shared experts hold chunks `0..m-1` (fused into one MLP) and carry `b2`;
- routed expert `e` holds chunk `m + e mod (c - m)`: the first `c - m` routed experts (the *designated* ones) hold
  the remaining chunks once each, the others are copies;
- if `top_k` > `c - m`, the next `top_k - (c - m)` routed experts are *null* experts (their `down_proj` is zero);
- the router weight is zero, so every affinity is 1/2 and every renormalised gate is `1 / top_k`; the balancing bias
  is `router_bias` (delta) on the designated and null experts, so every token selects exactly those `top_k`;
- `routed_scaling_factor = top_k` turns the gates back into 1: the MoE output equals the dense MLP for every input.

Everything else (attention, norms, positions, pooling head, text tower, `logit_scale`, `logit_bias`) is copied,
and the model uses the SigLIP profile of the configuration (spec §5.1). `mode="noisy"` draws the router weight
from N(0, router_std^2) instead: routes are unchanged at first (delta dominates) but the gates differ, so equality
becomes approximate (relative deviation O(router_std * |x|)).

FixRes SigLIP checkpoints (`model_type: siglip`, e.g. google/siglip2-base-patch16-224) have a Conv2d patch embedding
(flattened to the linear one in (py, px, c) order, exact) and a fixed position grid; NaFlex SigLIP2 checkpoints
(`siglip2`) are converted as they are.
"""

import math
import re
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, SiglipModel, Siglip2Model
from transformers.image_utils import PILImageResampling
from transformers.utils.hub import convert_file_size_to_int

from ..configuration.moe_vie import MoeVieConfig
from ..hub.sources import TOKENIZER_FILES, locate
from ..modeling.moe.accounting import count_parameters
from ..modeling.moe_vie import MoeVieModel
from ..processors.build import make_moe_vie_processor
from .common import ConversionResult, option_name
from .cost import PlannedOutput
from .dtypes import add_dtype_argument, output_dtype, saved_tensors
from .streaming import (
    Build,
    ShardWriter,
    SourceCheckpoint,
    StreamedModel,
    TensorGroup,
    check_plan,
    copy_as,
    load_layer_by_layer,
    stream_groups,
)


SOURCE_CLASSES = {"siglip": SiglipModel, "siglip2": Siglip2Model}
SOURCE_MODEL_TYPES = tuple(SOURCE_CLASSES)
# The modules that read a submodule's weight outside its forward, kept in memory by the verification
# (`load_layer_by_layer`): the vision embeddings of SigLIP2 and of MoE-ViE's SigLIP profile resize the position
# embedding's weight themselves.
SOURCE_RESIDENT_MODULES = ("SiglipVisionEmbeddings", "Siglip2VisionEmbeddings")
MODES = ("exact", "noisy")
LICENSE = "apache-2.0"
_VISION_MLP = re.compile(r"vision_model\.encoder\.layers\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)")


def upcycle_siglip_checkpoint(source: str | Path | PreTrainedModel, **options) -> tuple[MoeVieModel, dict]:
    """Upcycle a SigLIP or SigLIP2 dual encoder into a `MoeVieModel`, loaded in memory (for tests and small models;
    `convert` streams the conversion without ever loading it).

    Args:
        source: a loaded `SiglipModel` / `Siglip2Model` (saved into a temporary folder first), or a folder that
            `AutoModel` loads as one.
        options: those of `upcycle_siglip_folder`.

    Returns:
        The model in eval mode and `upcycle_siglip_folder`'s report.
    """
    model = StreamedModel(MoeVieModel, "moe-vie-upcycling-")
    if not isinstance(source, PreTrainedModel):
        report = upcycle_siglip_folder(Path(source), model.folder, **options)
        return model.load(), report
    _check_source_model(source)
    with tempfile.TemporaryDirectory(prefix="moe-vie-upcycling-source-") as folder:
        source.save_pretrained(folder)
        report = upcycle_siglip_folder(Path(folder), model.folder, **options)
    report["source"] = source.config.name_or_path or type(source).__name__
    report["base_model"] = source.config.name_or_path or None
    return model.load(), report


def upcycle_siglip_folder(
    source: Path,
    output: Path,
    num_experts: int = 32,
    granularity: int = 4,
    top_k: int = 3,
    n_shared_experts: int = 1,
    moe_layers: list[int] | None = None,
    mode: str = "exact",
    router_std: float = 1e-3,
    router_bias: float = 1.0,
    seed: int = 0,
    verify: bool = True,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> dict:
    """Upcycle the SigLIP / SigLIP2 checkpoint folder `source` (config.json and safetensors) into a MoE-ViE folder at
    `output`, tensor by tensor. Every option and the whole tensor plan are checked on the `meta` device before a
    weight is read; the conversion then holds one dense MLP and its experts, and one output shard, at a time.

    Args:
        num_experts: experts per MoE layer, shared ones included (32 in MoE-ViE).
        granularity: how many experts one dense MLP is cut into (`c`; 4 in MoE-ViE); must divide its width.
        top_k: routed experts per token (`k_r`), at least `granularity - n_shared_experts`.
        n_shared_experts: shared experts (`m`), fewer than `granularity`.
        moe_layers: vision blocks to upcycle (default: all but the first, as in MoE-ViE).
        mode: `"exact"` (zero router) or `"noisy"` (router weight ~ N(0, router_std^2), seeded by `seed`).
        router_bias: the selection bias delta of the designated and null experts; >= 1 keeps the initial routes
            in noisy mode too, since affinities lie in (0, 1).
        verify: run both models on a synthetic batch with padding and report the largest differences; both run
            layer by layer (`streaming.load_layer_by_layer`).
        dtype: of the output (default: the source's); the balancing biases stay fp32 whatever it is.
        max_shard_size: the largest output shard (bytes or a string like `"5GB"`).

    Returns:
        A report: source, options, key accounting, parameter counts, licence and the measured `max_abs_diff`
        against the source.
    """
    checkpoint = SourceCheckpoint(source, "the source")
    _check_model_type(checkpoint.model_type)
    source_config = AutoConfig.from_pretrained(str(source))
    if not getattr(source_config.vision_config, "vision_use_head", True):
        raise ValueError("the source vision tower has no attention-pooling head (vision_use_head=False)")
    config, plan = _upcycled_config(source_config, num_experts, granularity, top_k, n_shared_experts, moe_layers)
    _check_options(mode, router_std, router_bias)
    router_std = router_std if mode == "noisy" else 0.0
    dtype = output_dtype(dtype, source)

    with torch.device("meta"):
        skeleton = MoeVieModel(config)
    kept_in_float32 = {name for name, _, float32_kept in saved_tensors(skeleton) if float32_kept}
    groups = _upcycling_groups(checkpoint.shapes, plan, config.vision_config.moe_layers, router_std, router_bias, seed)
    expected = {key: tuple(tensor.shape) for key, tensor in skeleton.state_dict().items()}
    check_plan([checkpoint], groups, (), expected, "the upcycled MoE-ViE model")

    writer = ShardWriter(output, convert_file_size_to_int(max_shard_size), dtype)
    for key, tensor in stream_groups([checkpoint], groups):
        writer.add(key, tensor, cast=key not in kept_in_float32)
    writer.finish()
    config.architectures = [MoeVieModel.__name__]
    config.dtype = dtype
    config.save_pretrained(output)

    differences = measure_differences(source, output) if verify else None
    vision = count_parameters(skeleton.vision_model)
    upcycled = sum(len(group.sources) for group in groups if len(group.sources) > 1)
    report = {
        "source": str(source),
        "source_model_type": checkpoint.model_type,
        "base_model": str(source),
        "license": LICENSE,
        "dtype": str(dtype).removeprefix("torch."),
        "label": "MoE-ViE-style, upcycled from a dense SigLIP checkpoint (not a MoE-ViE checkpoint of the paper)",
        "upcycling": {
            "mode": mode, "num_experts": num_experts, "n_shared_experts": n_shared_experts,
            "n_routed_experts": plan.routed, "granularity": granularity, "top_k": top_k,
            "router_bias": router_bias, "router_std": router_std, "seed": seed,
            "moe_layers": list(config.vision_config.moe_layers),
        },
        "key_accounting": {
            "source_tensors": len(checkpoint.shapes),
            "copied": len(checkpoint.shapes) - upcycled,
            "upcycled_into_experts": upcycled,
            "unexpected": [],  # every source tensor has a target, or check_plan failed before a weight was read
        },
        "parameters": {
            "total": sum(p.numel() for p in skeleton.parameters()),
            "vision_total": vision.total,
            "vision_active": vision.active,
        },
        "max_abs_diff": None if differences is None else max(differences.values()),
        "max_abs_diff_by_output": differences,
        "notes": [
            "At initialisation every token selects the designated experts; the balancing-bias updates spread the load "
            "during training.",
        ],
    }
    if checkpoint.model_type == "siglip":
        report["notes"].append(
            "Learned positions are resized like Siglip2 NaFlex (bilinear, antialiased); SigLIP's bicubic "
            "interpolate_pos_encoding differs at other resolutions, so outputs are identical at the native grid only."
        )
    return report


def _upcycled_config(source_config, num_experts, granularity, top_k, n_shared_experts, moe_layers):
    """The MoE-ViE config of a SigLIP config and the upcycling options, and the plan of which chunk each expert
    holds."""
    vision_source = source_config.vision_config
    if moe_layers is None:
        moe_layers = list(range(1, vision_source.num_hidden_layers))
    plan = _UpcyclingPlan(vision_source.intermediate_size, num_experts, granularity, top_k, n_shared_experts)
    return _moe_vie_config(source_config, plan, moe_layers), plan


def plan_output(source: Path, num_experts: int = 32, granularity: int = 4, top_k: int = 3, n_shared_experts: int = 1,
                moe_layers: list[int] | None = None, **_other_options) -> PlannedOutput:
    """What `convert` writes, from the source's config.json alone (`moezoo convert --dry-run`, the disk-space
    check)."""
    source_config = AutoConfig.from_pretrained(str(source))
    _check_model_type(source_config.model_type)
    config, _ = _upcycled_config(source_config, num_experts, granularity, top_k, n_shared_experts, moe_layers)
    return PlannedOutput(config, (Path(source),))


class _UpcyclingPlan:
    """Which dense chunk each expert holds; validates the options against the dense width."""

    def __init__(self, dense_width: int, num_experts: int, granularity: int, top_k: int, n_shared_experts: int):
        for name, value in (("num_experts", num_experts), ("granularity", granularity), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{option_name(name, value)} must be a positive integer")
        if isinstance(n_shared_experts, bool) or not isinstance(n_shared_experts, int) or n_shared_experts < 0:
            raise ValueError(f"{option_name('n_shared_experts', n_shared_experts)} must be a non-negative integer")
        if dense_width % granularity:
            raise ValueError(
                f"{option_name('granularity', granularity)} does not divide the dense MLP width {dense_width}: the experts would not "
                "hold equal chunks"
            )
        if n_shared_experts >= granularity:
            raise ValueError(
                f"{option_name('n_shared_experts', n_shared_experts)} must be smaller than "
                f"{option_name('granularity', granularity)}: the routed "
                "experts need at least one chunk of the dense MLP"
            )
        self.routed = num_experts - n_shared_experts
        self.designated = granularity - n_shared_experts
        if not self.designated <= top_k <= self.routed:
            raise ValueError(
                f"{option_name('top_k', top_k)} must lie between granularity - n_shared_experts = "
                f"{self.designated} (every token needs every chunk) and the number of routed experts num_experts - "
                f"n_shared_experts = {self.routed}"
            )
        self.top_k = top_k
        self.shared = n_shared_experts
        self.expert_width = dense_width // granularity

    def chunk(self, index: int) -> slice:
        return slice(index * self.expert_width, (index + 1) * self.expert_width)

    def routed_chunk(self, expert: int) -> int:
        return self.shared + expert % self.designated


def _check_options(mode: str, router_std: float, router_bias: float) -> None:
    if mode not in MODES:
        raise ValueError(f"{option_name('mode', mode)} is not one of {', '.join(map(repr, MODES))}")
    if not router_std >= 0:
        raise ValueError(f"{option_name('router_std', router_std)} must be >= 0")
    if not router_bias > 0:
        raise ValueError(f"router_bias must be > 0 so that the designated experts are selected, got {router_bias!r}")


def _check_source_model(source: PreTrainedModel) -> None:
    _check_model_type(source.config.model_type)
    if not (hasattr(source, "vision_model") and hasattr(source, "text_model")):
        raise ValueError(f"{type(source).__name__} is not a dual encoder: upcycle the full SiglipModel/Siglip2Model")


def _check_model_type(model_type: str) -> None:
    if model_type not in SOURCE_MODEL_TYPES:
        raise ValueError(
            f"cannot upcycle a {model_type!r} model: the sources are SigLIP (model_type 'siglip') and SigLIP2 "
            "('siglip2') dual encoders"
        )


def _moe_vie_config(source_config, plan: _UpcyclingPlan, moe_layers: list[int]) -> MoeVieConfig:
    """The SigLIP profile of spec §5.1 with the source's sizes and the MoE options."""
    vision, text = source_config.vision_config, source_config.text_config
    if source_config.model_type == "siglip":
        num_patches = (vision.image_size // vision.patch_size) ** 2
        image_size = vision.image_size
    else:
        num_patches = vision.num_patches
        image_size = math.isqrt(vision.num_patches) * vision.patch_size
    if text.projection_size != vision.hidden_size:
        raise ValueError(
            f"the source's text projection_size {text.projection_size} differs from the vision width "
            f"{vision.hidden_size}: its image and text embeddings cannot be compared"
        )
    return MoeVieConfig(
        projection_dim=None,
        loss_type="sigmoid",
        logit_scale_init_value=math.log(10),  # SigLIP's initialisation; the trained values are copied
        logit_bias_init_value=-10.0,
        max_logit_scale=None,
        text_projection_bias=True,
        vision_config=dict(
            hidden_size=vision.hidden_size, num_hidden_layers=vision.num_hidden_layers,
            num_attention_heads=vision.num_attention_heads, num_channels=vision.num_channels,
            patch_size=vision.patch_size, image_size=image_size, mlp_type="gelu", hidden_act=vision.hidden_act,
            intermediate_size=vision.intermediate_size, mlp_bias=True, moe_intermediate_size=plan.expert_width,
            n_routed_experts=plan.routed, n_shared_experts=plan.shared, num_experts_per_tok=plan.top_k,
            moe_layers=moe_layers, routed_scaling_factor=float(plan.top_k), position_embedding_type="learned",
            num_patches=num_patches, use_pre_layernorm=False, use_post_layernorm=True, patch_embedding_bias=True,
            attention_bias=True, layer_norm_eps=vision.layer_norm_eps,
            attention_dropout=float(vision.attention_dropout),
            pooling_num_attention_heads=vision.num_attention_heads, pooling_intermediate_size=vision.intermediate_size,
            pooling_hidden_act=vision.hidden_act,
        ),
        text_config=dict(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads, intermediate_size=text.intermediate_size, mlp_type="gelu",
            hidden_act=text.hidden_act, mlp_bias=True, max_position_embeddings=text.max_position_embeddings,
            is_causal=False, pooling_type="last", use_final_layer_norm=True, attention_bias=True,
            layer_norm_eps=text.layer_norm_eps, attention_dropout=float(text.attention_dropout),
            bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        ),
    )


def _upcycling_groups(shapes, plan, moe_layers, router_std, router_bias, seed) -> list[TensorGroup]:
    """What each source tensor becomes: the vision MLPs of `moe_layers` (their four tensors together) MoE tensors,
    the others copied or reshaped. The routers are drawn here, layer by layer in order, so that the result does not
    depend on the order the source's files hold the tensors in."""
    groups, dense_mlps = [], {}
    for key in shapes:
        match = _VISION_MLP.fullmatch(key)
        if match and int(match[1]) in moe_layers:
            dense_mlps.setdefault(int(match[1]), []).append(key)
        elif key == "vision_model.embeddings.patch_embedding.weight" and len(shapes[key]) == 4:
            groups.append(TensorGroup((key,), _conv_to_linear))
        elif key.startswith("text_model.head."):
            groups.append(copy_as(key, key.replace("text_model.head.", "text_projection.")))
        elif key == "logit_scale":
            groups.append(TensorGroup((key,), lambda tensors, device: {"logit_scale": tensors["logit_scale"].reshape(())}))
        else:
            groups.append(copy_as(key, key))
    generator = torch.Generator().manual_seed(seed)
    for layer in sorted(dense_mlps):
        prefix = f"vision_model.encoder.layers.{layer}.mlp"
        sources = tuple(f"{prefix}.{name}" for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
        hidden_size = shapes[f"{prefix}.fc1.weight"][1]
        router_weight = torch.randn(plan.routed, hidden_size, generator=generator) * router_std
        groups.append(TensorGroup(sources, _upcycled_mlp(prefix, plan, router_weight, router_bias)))
    return groups


def _conv_to_linear(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """FixRes SigLIP: Conv2d (H, C, p, p) -> Linear (H, p*p*C) in (py, px, c) order."""
    key = "vision_model.embeddings.patch_embedding.weight"
    return {key: tensors[key].permute(0, 2, 3, 1).reshape(tensors[key].shape[0], -1)}


def _upcycled_mlp(prefix: str, plan: _UpcyclingPlan, router_weight: torch.Tensor, router_bias: float) -> Build:
    """One dense GELU MLP (`fc1 (I, H)`, `fc2 (H, I)`, biases) -> router, routed experts and shared expert."""

    def build(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
        fc1, fc1_bias, fc2, fc2_bias = (tensors[f"{prefix}.{name}"]
                                        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))  # fmt: skip
        chunks = [plan.chunk(plan.routed_chunk(expert)) for expert in range(plan.routed)]
        down_proj = torch.stack([fc2[:, chunk] for chunk in chunks])  # (R, H, I_e)
        down_proj[plan.designated : plan.top_k] = 0  # the null experts
        down_proj_bias = fc2_bias.new_zeros(plan.routed, fc2.shape[0])
        selection_bias = torch.zeros(plan.routed, dtype=torch.float32, device=device)
        selection_bias[: plan.top_k] = router_bias  # the designated and null experts
        upcycled = {
            f"{prefix}.gate.weight": router_weight.to(device=device, dtype=fc1.dtype),
            f"{prefix}.gate.e_score_correction_bias": selection_bias,
            f"{prefix}.experts.up_proj": torch.stack([fc1[chunk] for chunk in chunks]),  # (R, I_e, H)
            f"{prefix}.experts.up_proj_bias": torch.stack([fc1_bias[chunk] for chunk in chunks]),
            f"{prefix}.experts.down_proj": down_proj,
            f"{prefix}.experts.down_proj_bias": down_proj_bias,
        }
        if plan.shared:
            shared = slice(0, plan.shared * plan.expert_width)
            upcycled |= {
                f"{prefix}.shared_expert.up_proj.weight": fc1[shared],
                f"{prefix}.shared_expert.up_proj.bias": fc1_bias[shared],
                f"{prefix}.shared_expert.down_proj.weight": fc2[:, shared],
                f"{prefix}.shared_expert.down_proj.bias": fc2_bias,
            }
        else:
            down_proj_bias[0] = fc2_bias  # the first designated expert, whose gate is 1 for every token
        return upcycled

    return build


@torch.no_grad()
def measure_differences(source: Path, converted: Path) -> dict[str, float]:
    """The source and the upcycled folder in fp32 on two images (the second padded, for SigLIP2) and two texts: the
    largest absolute differences. Both models run layer by layer (`load_layer_by_layer`), so the memory this takes
    does not grow with the depth."""
    source_class = SOURCE_CLASSES[AutoConfig.from_pretrained(str(source)).model_type]
    with tempfile.TemporaryDirectory(prefix="moe-vie-verification-") as offload:
        source_model = load_layer_by_layer(source_class, source, Path(offload) / "source",
                                           resident_modules=SOURCE_RESIDENT_MODULES, dtype=torch.float32)
        model = load_layer_by_layer(MoeVieModel, converted, Path(offload) / "converted",
                                    resident_modules=("MoeVieVisionEmbeddings",), dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        vision, text = source_model.config.vision_config, source_model.config.text_config
        patch, channels = vision.patch_size, vision.num_channels
        grid = model.config.vision_config.num_patches
        side = math.isqrt(grid)
        input_ids = torch.randint(0, text.vocab_size, (2, text.max_position_embeddings), generator=generator)
        if source_model.config.model_type == "siglip":
            images = torch.randn(2, channels, side * patch, side * patch, generator=generator)
            spatial_shapes = torch.tensor([[side, side], [side, side]])
            pixel_values = _patchify(images, patch)
            pixel_attention_mask = torch.ones(2, grid, dtype=torch.long)
            source_inputs = {"pixel_values": images}
        else:
            spatial_shapes = torch.tensor([[side, side], [max(1, side // 2), side]])
            pixel_values = torch.randn(2, grid, patch * patch * channels, generator=generator)
            pixel_attention_mask = (torch.arange(grid)[None] < spatial_shapes.prod(-1, keepdim=True)).long()
            source_inputs = {"pixel_values": pixel_values, "pixel_attention_mask": pixel_attention_mask,
                             "spatial_shapes": spatial_shapes}
        expected = source_model(input_ids=input_ids, **source_inputs)
        got = model(input_ids=input_ids, pixel_values=pixel_values, pixel_attention_mask=pixel_attention_mask,
                    spatial_shapes=spatial_shapes)
    return {
        name: float((getattr(got, name).float() - getattr(expected, name).float()).abs().max())
        for name in ("image_embeds", "text_embeds", "logits_per_image")
    }


def _patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, rows * cols, patch * patch * C) in (py, px, c) order, row-major."""
    batch, channels, height, width = images.shape
    grid = images.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return grid.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // patch) * (width // patch), -1)


# --- `moezoo convert --to moe_vie --from <siglip / siglip2 folder or Hub id>` -----------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--num-experts", type=int, default=32, help="experts per MoE layer, shared ones included")
    parser.add_argument("--granularity", type=int, default=4, help="experts one dense MLP is cut into")
    parser.add_argument("--top-k", type=int, default=3, help="routed experts per token")
    parser.add_argument("--n-shared-experts", type=int, default=1)
    parser.add_argument("--moe-layers", type=int, nargs="+", default=None, help="default: every block but the first")
    parser.add_argument("--mode", choices=MODES, default="exact")
    parser.add_argument("--router-std", type=float, default=1e-3, help="router init std of --mode noisy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder or Hub id (default: the source's)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest output shard, which the conversion holds in memory before writing it")
    add_dtype_argument(parser)
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip running the source model to measure max |Δ|")


def convert(source: Path, tokenizer: str | None = None, **options) -> ConversionResult:
    """The converter behind the command: the upcycled model, streamed into a temporary folder (the result's
    `StreamedModel`, which `moezoo convert` moves into its output), the source's tokenizer and matching preprocessing
    (NaFlex for `siglip2`, a fixed square for `siglip`, bilinear as SigLIP)."""
    # Found before the upcycling, so that a tokenizer that cannot be had fails at once.
    tokenizer_folder = source if tokenizer is None else locate(
        tokenizer, "the tokenizer", "pass --tokenizer with a local tokenizer folder", TOKENIZER_FILES
    )
    model = StreamedModel(MoeVieModel, "moe-vie-upcycling-")
    report = upcycle_siglip_folder(source, model.folder, **options)
    try:
        # SigLIP pools the last position of texts padded to the text tower's length (64), which the processor pads
        # to (`padding="max_length"`); SigLIP2's Gemma tokenizer does not know that length (Siglip2Processor passes
        # max_length=64 itself), so without it texts would not be padded and every text embedding would be wrong.
        text_tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_folder, model_max_length=model.config.text_config.max_position_embeddings
        )
    except (OSError, ValueError) as error:
        # The first line says what failed; transformers goes on to list every config class it knows (hundreds).
        reason = str(error).strip().partition("\n")[0]
        raise FileNotFoundError(
            f"no tokenizer in {tokenizer or source} ({reason}); pass --tokenizer with the source model's tokenizer"
        ) from error
    vision_config = model.config.vision_config
    image_options = {"resample": PILImageResampling.BILINEAR}
    if report["source_model_type"] == "siglip2":
        image_options |= {"resize_mode": "naflex", "max_num_patches": vision_config.num_patches}
    processor = make_moe_vie_processor(model.config, tokenizer=text_tokenizer, **image_options)
    return ConversionResult(model, processor, report)
