"""OmniMoE-VL in the catalogue: the paper's model, a mid-size one, the tiny preset, and the Qwen3 + SigLIP/SigLIP2
upcycling converter."""

from ..configuration.omnimoe_vl import TINY_OMNIMOE_VL
from ..registry import Architecture, Converter, ParameterClaim, Preset


MODELING = "moezoo.modeling.omnimoe_vl"
CONFIGURATION = "moezoo.configuration.omnimoe_vl"

ARCHITECTURES = [
    Architecture(
        name="omnimoe_vl",
        title="OmniMoE-VL",
        config=f"{CONFIGURATION}:OmniMoeVlConfig",
        models={
            "AutoModelForImageTextToText": f"{MODELING}:OmniMoeVlForConditionalGeneration",
            "AutoModel": f"{MODELING}:OmniMoeVlModel",
        },
        processor="moezoo.processors.omnimoe_vl:OmniMoeVlProcessor",
        make_processor="moezoo.processors.build_omnimoe_vl:make_omnimoe_vl_processor",
        pipeline_tag="image-text-to-text",
        model_card="omnimoe_vl.md",
        tags=("vision-language", "image-text-to-text", "depth-routing", "qwen3", "siglip"),
        sub_configs={
            "omnimoe_vl_vision": f"{CONFIGURATION}:OmniMoeVlVisionConfig",
            "omnimoe_vl_text": f"{CONFIGURATION}:OmniMoeVlTextConfig",
        },
    )
]

# Spec Appendix S.7, the paper's model (§5.1): SigLIP2-g/16-384 truncated to its last tap (37 of 40 blocks, spec D23)
# and Qwen3-8B, both with 8 experts on every even block (top-1 vision, top-2 language); 10 streams at blocks 1, 5, ...,
# 37 injected before language layers 1..10, top-4 depths. `OmniMoeVlConfig()` is the same model (without Qwen3's bos /
# eos ids), written out here so that the preset reads as the paper's table. 31 B parameters: count them on the meta
# device.
PAPER_OMNIMOE_VL = dict(
    vision_config=dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=37, num_attention_heads=16,
                       image_size=384, patch_size=16, moe_layers=list(range(0, 37, 2)), num_experts=8,
                       num_experts_per_tok=1),
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_experts=8,
                     num_experts_per_tok=2, mlp_only_layers=list(range(1, 36, 2)), max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     bos_token_id=151643, eos_token_id=151645),
    image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
    vision_feature_layers=list(range(1, 38, 4)), injection_layers=list(range(10)),
    num_query_prototypes=16, num_router_queries=8, depth_top_k=4, fusion_top_k=4, fusion_group_size=32,
    injection_rank=32, adapter_rank=32, projector_attn_dim=1024, projector_attn_heads=8, depth_score_hidden=1024,
    exploration_steps=12000,
)

# A mid-size model with the paper's projector on Qwen3-1.7B (tied embeddings) and SigLIP2-So400m/16-384 (27 blocks):
# what `moezoo convert` makes of these two with `--vision-feature-layers 1,4,7,10,13,16,19,22,25`, the paper's tapping
# rule scaled to the shallower tower (from block 1 at a fixed stride, stopping a few blocks before the end), so 9
# streams injected before language layers 1..9, top-4 depths; the tower is truncated to its last tap.
MID_OMNIMOE_VL = dict(
    PAPER_OMNIMOE_VL,
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=25, num_attention_heads=16,
                       image_size=384, patch_size=16, moe_layers=list(range(0, 25, 2)), num_experts=8,
                       num_experts_per_tok=1),
    text_config=dict(PAPER_OMNIMOE_VL["text_config"], hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     mlp_only_layers=list(range(1, 28, 2)), tie_word_embeddings=True),
    vision_feature_layers=list(range(1, 26, 3)), injection_layers=list(range(9)), tie_word_embeddings=True,
)

# The paper states "28B total / 9B activated" (§5.2, Table 2), which its stated configuration does not give (spec
# §4.3, D2): the parts below show where the claim comes closest (the language model's active layers without
# embeddings for "9B"; the language model, the projector and a dense vision tower for "28B").
PAPER_CLAIM = ParameterClaim(
    total=28_000_000_000, active=9_000_000_000, source="§5.2, Table 2",
    parts={
        "language model + lm_head": ("model.language_model", "lm_head"),
        "language model without embeddings": ("model.language_model.layers", "model.language_model.norm"),
        "vision tower": ("model.vision_tower",),
        "projector": ("model.projector",),
    },
)

PRESETS = [
    Preset(
        name="tiny-omnimoe_vl", architecture="omnimoe_vl", config=TINY_OMNIMOE_VL,
        description="6 vision blocks and 6 language layers (8 experts on even ones), 3 streams, top-2 of 3 depths; "
                    "tests and the demo",
        license="apache-2.0",
    ),
    Preset(
        name="omnimoe-vl-qwen3-8b", architecture="omnimoe_vl", config=PAPER_OMNIMOE_VL,
        description="the paper's model (§5.1): Qwen3-8B + SigLIP2-g/16-384 (37 of 40 blocks), 8 experts on even "
                    "blocks, 10 streams, top-4 depths",
        base_checkpoints=("Qwen/Qwen3-8B", "google/siglip2-giant-opt-patch16-384"), converter="omnimoe_vl-upcycle",
        license="apache-2.0", paper_claim=PAPER_CLAIM,
    ),
    Preset(
        name="omnimoe-vl-qwen3-1.7b", architecture="omnimoe_vl", config=MID_OMNIMOE_VL,
        description="mid-size: Qwen3-1.7B + SigLIP2-So400m/16-384 (25 of 27 blocks), 9 streams, top-4 depths; convert "
                    "with --vision-feature-layers 1,4,7,10,13,16,19,22,25",
        base_checkpoints=("Qwen/Qwen3-1.7B", "google/siglip2-so400m-patch16-384"), converter="omnimoe_vl-upcycle",
        license="apache-2.0",
    ),
]

CONVERTERS = [
    Converter(
        name="omnimoe_vl-upcycle",
        architecture="omnimoe_vl",
        sources=("qwen3",),
        function="moezoo.conversion.omnimoe_vl_upcycle:convert",
        plan="moezoo.conversion.omnimoe_vl_upcycle:plan_output",
        add_arguments="moezoo.conversion.omnimoe_vl_upcycle:add_arguments",
        description="dense Qwen3 (--from) + SigLIP / SigLIP2 vision tower (--vision) -> OmniMoE-VL, both upcycled; "
                    "equal to the LLaVA-style composition at initialisation",
    )
]
