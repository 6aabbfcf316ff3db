"""SMoES in the catalogue: the Qwen3.5-MoE and Qwen3-VL-MoE hosts (one family, `smoes`), a tiny preset and the paper's
settings on a real checkpoint's layout for each (Qwen3.5-35B-A3B, Qwen3-VL-30B-A3B), and a converter from each
host's checkpoints (`moezoo convert --to smoes` picks it by the source's model type)."""

from ..registry import Architecture, Converter, Preset


MODELING = "moezoo.modeling.smoes.qwen3_5_moe"
MODELING_QWEN3_VL_MOE = "moezoo.modeling.smoes.qwen3_vl_moe"
CONFIGURATION = "moezoo.configuration.smoes"

ARCHITECTURES = [
    Architecture(
        name="smoes_qwen3_5_moe",
        title="SMoES Qwen3.5-MoE",
        config=f"{CONFIGURATION}:SmoesQwen3_5MoeConfig",
        # AutoModel gives the model without its LM head, as transformers' Qwen3.5-MoE does.
        models={"AutoModelForImageTextToText": f"{MODELING}:SmoesQwen3_5MoeForConditionalGeneration",
                "AutoModel": f"{MODELING}:SmoesQwen3_5MoeModel"},
        processor="moezoo.processors.smoes:SmoesQwen3_5MoeProcessor",
        make_processor="moezoo.processors.build_smoes:make_smoes_processor",
        pipeline_tag="image-text-to-text",
        model_card="smoes.md",
        tags=("vision-language", "image-text-to-text", "expert-specialisation", "qwen3_5_moe"),
        sub_configs={"smoes_qwen3_5_moe_text": f"{CONFIGURATION}:SmoesQwen3_5MoeTextConfig"},
        family="smoes",
    ),
    Architecture(
        name="smoes_qwen3_vl_moe",
        title="SMoES Qwen3-VL-MoE",
        config=f"{CONFIGURATION}:SmoesQwen3VLMoeConfig",
        models={"AutoModelForImageTextToText": f"{MODELING_QWEN3_VL_MOE}:SmoesQwen3VLMoeForConditionalGeneration",
                "AutoModel": f"{MODELING_QWEN3_VL_MOE}:SmoesQwen3VLMoeModel"},
        # Qwen3-VL-MoE's checkpoints ship Qwen3-VL's processor, which the Qwen3.5-MoE host's processor is.
        processor="moezoo.processors.smoes:SmoesQwen3_5MoeProcessor",
        make_processor="moezoo.processors.build_smoes:make_smoes_processor",
        pipeline_tag="image-text-to-text",
        model_card="smoes.md",
        tags=("vision-language", "image-text-to-text", "expert-specialisation", "qwen3_vl_moe"),
        sub_configs={"smoes_qwen3_vl_moe_text": f"{CONFIGURATION}:SmoesQwen3VLMoeTextConfig"},
        family="smoes",
    ),
]

# Spec §4, the tiny test model: 4 layers (Gated DeltaNet at 0 and 2, softmax attention at 1 and 3, so both paths of
# the attention estimator run), 8 experts top-2 in 2 bins on 2 devices, a 2-block vision tower; ~0.44 M parameters.
# alpha_MI is 0.1, not the paper's 1e-4: tiny runs have little task loss to compete with (spec R5).
TINY_SMOES = dict(
    text_config=dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=0.1, smoes_bal_coef=0.01,
    ),
    vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64),
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
)

# Qwen3.5-35B-A3B (its config.json: 40 layers, 30 Gated DeltaNet + 10 attention, 256 experts top-8 with a shared
# expert, a 27-block vision tower) with the paper's SMoES settings: 8 bins of 32 experts, tau 0.5 D, beta 0.99,
# alpha_bal 1e-3, alpha_MI 1e-4 (the `SmoesConfigMixin` defaults), Gaussian scores (the default on this hybrid host).
SMOES_QWEN3_5_35B_A3B = dict(
    text_config=dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
    ),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304),
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054,
)

# Spec §4, the tiny Qwen3-VL-MoE: 4 softmax-attention layers, 8 experts top-2 in 2 bins on 2 devices (no shared
# expert), a 2-block vision tower whose two blocks both feed DeepStack; attention scores (this host's default).
TINY_SMOES_QWEN3_VL_MOE = dict(
    text_config=dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
        smoes_num_bins=2, smoes_ep_devices=2, smoes_mi_coef=0.1, smoes_bal_coef=0.01,
    ),
    vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                       deepstack_visual_indexes=[0, 1]),
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
)

# Qwen3-VL-30B-A3B (its config.json: 48 softmax-attention layers, all MoE, 128 experts top-8 without a shared expert,
# 32 query and 4 key-value heads of 128, a 27-block vision tower feeding DeepStack at blocks 8, 16 and 24) with the
# paper's SMoES settings: 8 bins of 16 experts, tau 0.5 D, beta 0.99, alpha_bal 1e-3, alpha_MI 1e-4 (the
# `SmoesConfigMixin` defaults), attention scores (this host's default).
SMOES_QWEN3_VL_30B_A3B = dict(
    text_config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=262144,
        bos_token_id=151643, eos_token_id=151645,
        rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20],
                             mrope_interleaved=True),
    ),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24]),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
)

PRESETS = [
    Preset(
        name="tiny-smoes", architecture="smoes_qwen3_5_moe", config=TINY_SMOES,
        description="4 layers (2 Gated DeltaNet + 2 attention), 8 experts top-2 in 2 bins, 2-block vision tower; "
                    "tests and the demo",
        license="apache-2.0",
    ),
    Preset(
        name="smoes-qwen3.5-35b-a3b", architecture="smoes_qwen3_5_moe", config=SMOES_QWEN3_5_35B_A3B,
        description="Qwen3.5-35B-A3B with the paper's SMoES settings (8 bins, Gaussian scores, alpha_MI 1e-4)",
        base_checkpoints=("Qwen/Qwen3.5-35B-A3B",), converter="smoes-qwen3_5_moe", license="apache-2.0",
    ),
    Preset(
        name="tiny-smoes-qwen3-vl-moe", architecture="smoes_qwen3_vl_moe", config=TINY_SMOES_QWEN3_VL_MOE,
        description="4 attention layers, 8 experts top-2 in 2 bins, 2-block vision tower with DeepStack; tests",
        license="apache-2.0",
    ),
    Preset(
        name="smoes-qwen3-vl-30b-a3b", architecture="smoes_qwen3_vl_moe", config=SMOES_QWEN3_VL_30B_A3B,
        description="Qwen3-VL-30B-A3B with the paper's SMoES settings (8 bins, attention scores, alpha_MI 1e-4)",
        base_checkpoints=("Qwen/Qwen3-VL-30B-A3B-Instruct",), converter="smoes-qwen3_vl_moe", license="apache-2.0",
    ),
]

CONVERTERS = [
    Converter(
        name="smoes-qwen3_5_moe",
        architecture="smoes_qwen3_5_moe",
        sources=("qwen3_5_moe",),
        function="moezoo.conversion.smoes_qwen3_5_moe:convert",
        plan="moezoo.conversion.smoes_qwen3_5_moe:plan_output",
        add_arguments="moezoo.conversion.smoes_qwen3_5_moe:add_arguments",
        description="Qwen3.5-MoE VLM -> SMoES Qwen3.5-MoE (every tensor copied bit-exactly, SMoES buffers at their "
                    "initial values, optional calibration of the statistics)",
    ),
    Converter(
        name="smoes-qwen3_vl_moe",
        architecture="smoes_qwen3_vl_moe",
        sources=("qwen3_vl_moe",),
        function="moezoo.conversion.smoes_qwen3_vl_moe:convert",
        plan="moezoo.conversion.smoes_qwen3_vl_moe:plan_output",
        add_arguments="moezoo.conversion.smoes_qwen3_vl_moe:add_arguments",
        description="Qwen3-VL-MoE VLM -> SMoES Qwen3-VL-MoE (every tensor copied bit-exactly, SMoES buffers at their "
                    "initial values, optional calibration of the statistics)",
    ),
]
