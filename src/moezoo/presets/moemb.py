"""MoEMB in the catalogue: the paper's A3B and A10B embedders, a tiny preset, and the Qwen3.5 converter."""

from ..configuration.moemb import MOEMB_CONFIGS, TINY_MOEMB
from ..registry import Architecture, Converter, Preset


ARCHITECTURES = [
    Architecture(
        name="moemb",
        title="MoEMB",
        config="moezoo.configuration.moemb:MoEmbConfig",
        models={"AutoModel": "moezoo.modeling.moemb:MoEmbForEmbedding"},
        processor="moezoo.processors.moemb:MoEmbProcessor",
        processor_parts={"AutoImageProcessor": "moezoo.processors.moemb:MoEmbImageProcessor"},
        sub_configs={"moemb_text": "moezoo.configuration.moemb:MoEmbTextConfig"},
        sub_models={"moemb_text": "moezoo.modeling.moemb:MoEmbTextModel"},
        make_processor="moezoo.processors.build_moemb:make_moemb_processor",
        pipeline_tag="feature-extraction",
        model_card="moemb.md",
        tags=("embeddings", "sentence-transformers", "multimodal", "retrieval", "qwen3_5_moe"),
    )
]

QWEN3_5_SOURCES = {"MoEMB-A3B": "Qwen/Qwen3.5-35B-A3B", "MoEMB-A10B": "Qwen/Qwen3.5-122B-A10B"}

PRESETS = [
    Preset(
        name="tiny-moemb", architecture="moemb", config=TINY_MOEMB,
        description="8 layers (6 Gated DeltaNet + 2 attention), 8 experts top-4, 2-block vision tower; tests, demo",
        license="apache-2.0",
    ),
    *(
        Preset(
            name=name.lower(), architecture="moemb", config=config,
            description=f"{name}: the paper's embedder on {QWEN3_5_SOURCES[name]} (native MoE, router frozen)",
            base_checkpoints=(QWEN3_5_SOURCES[name],), converter="moemb-qwen3_5", license="apache-2.0",
            variant="native",
        )
        for name, config in MOEMB_CONFIGS.items()
    ),
]

CONVERTERS = [
    Converter(
        name="moemb-qwen3_5",
        architecture="moemb",
        sources=("qwen3_5_moe", "qwen3_5"),
        variants=("native", "upcycled", "modality"),
        function="moezoo.conversion.moemb_qwen3_5:convert",
        plan="moezoo.conversion.moemb_qwen3_5:plan_output",
        add_arguments="moezoo.conversion.moemb_qwen3_5:add_arguments",
        description="Qwen3.5-MoE -> MoEMB (native, exact); Qwen3.5 dense -> upcycled or modality-level MoEMB",
    ),
    Converter(
        name="moemb-prune-experts",
        architecture="moemb",
        sources=("moemb",),
        function="moezoo.conversion.moemb_expert_pruning:convert",
        plan="moezoo.conversion.moemb_expert_pruning:plan_output",
        add_arguments="moezoo.conversion.moemb_expert_pruning:add_arguments",
        description="MoEMB -> MoEMB with the E' most salient experts of every layer (REAP, MAN, MSAN, frequency, "
        "router probability)",
    ),
]
