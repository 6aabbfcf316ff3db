"""MoE-ViE in the catalogue: the official B/16, L/16 and H/14 releases, a tiny preset, and two converters."""

import copy

from ..configuration.moe_vie import OFFICIAL_MOE_VIE_CONFIGS, TINY_MOE_VIE
from ..registry import Architecture, Converter, Preset


ARCHITECTURES = [
    Architecture(
        name="moe_vie",
        title="MoE-ViE",
        config="moezoo.configuration.moe_vie:MoeVieConfig",
        models={
            "AutoModel": "moezoo.modeling.moe_vie:MoeVieModel",
            "AutoModelForZeroShotImageClassification": "moezoo.modeling.moe_vie:MoeVieModel",
        },
        processor="moezoo.processors.moe_vie:MoeVieProcessor",
        processor_parts={"AutoImageProcessor": "moezoo.processors.moe_vie:MoeVieImageProcessor"},
        make_processor="moezoo.processors.build:make_moe_vie_processor",
        pipeline_tag="zero-shot-image-classification",
        model_card="moe_vie.md",
        tags=("clip", "vision", "zero-shot-image-classification", "video"),
        paper_counted_modules=("vision_model", "visual_projection"),
        sub_configs={
            "moe_vie_vision_model": "moezoo.configuration.moe_vie:MoeVieVisionConfig",
            "moe_vie_text_model": "moezoo.configuration.moe_vie:MoeVieTextConfig",
        },
    )
]

# The tiny preset is the spec's test configuration with a 128-token text vocabulary, so that the words of moezoo's
# synthetic data sets (colours, shapes, motions) are single tokens of its offline tokenizer.
TINY_PRESET_CONFIG = copy.deepcopy(TINY_MOE_VIE)
TINY_PRESET_CONFIG["text_config"].update(vocab_size=128, bos_token_id=126, eos_token_id=127)

PRESETS = [
    Preset(
        name="tiny-moe_vie", architecture="moe_vie", config=TINY_PRESET_CONFIG,
        description="3 vision layers (2 MoE: 1 shared + top-3 of 7 routed), 16 px images; tests and the demo",
        license="apache-2.0",
    ),
    *(
        Preset(
            name=name.lower().replace("moevie", "moe-vie"), architecture="moe_vie", config=config,
            description=f"the official {name} release (paper Tab. 14)", base_checkpoints=(f"facebook/{name}",),
            converter="moe-vie-official", license="cc-by-nc-4.0",
        )
        for name, config in OFFICIAL_MOE_VIE_CONFIGS.items()
    ),
]

CONVERTERS = [
    Converter(
        name="moe-vie-official",
        architecture="moe_vie",
        sources=("pytorch-pickle",),
        function="moezoo.conversion.moe_vie_official:convert",
        plan="moezoo.conversion.moe_vie_official:plan_output",
        add_arguments="moezoo.conversion.moe_vie_official:add_arguments",
        description="official MoE-ViE OpenCLIP .pt (read with weights_only=True) -> MoE-ViE, exact",
    ),
    Converter(
        name="moe-vie-upcycle",
        architecture="moe_vie",
        sources=("siglip", "siglip2"),
        function="moezoo.conversion.moe_vie_upcycle:convert",
        plan="moezoo.conversion.moe_vie_upcycle:plan_output",
        add_arguments="moezoo.conversion.moe_vie_upcycle:add_arguments",
        description="dense SigLIP (FixRes) / SigLIP2 (NaFlex) -> MoE-ViE-style MoE by upcycling, exact at init",
    ),
]
