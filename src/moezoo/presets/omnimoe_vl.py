"""OmniMoE-VL in the catalogue: the tiny preset and the Qwen3 + SigLIP/SigLIP2 upcycling converter."""

from ..configuration.omnimoe_vl import TINY_OMNIMOE_VL
from ..registry import Architecture, Converter, Preset


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

PRESETS = [
    Preset(
        name="tiny-omnimoe_vl", architecture="omnimoe_vl", config=TINY_OMNIMOE_VL,
        description="6 vision blocks and 6 language layers (8 experts on even ones), 3 streams, top-2 of 3 depths; "
                    "tests and the demo",
        license="apache-2.0",
    ),
]

CONVERTERS = [
    Converter(
        name="omnimoe_vl-upcycle",
        architecture="omnimoe_vl",
        sources=("qwen3",),
        function="moezoo.conversion.omnimoe_vl_upcycle:convert",
        add_arguments="moezoo.conversion.omnimoe_vl_upcycle:add_arguments",
        description="dense Qwen3 (--from) + SigLIP / SigLIP2 vision tower (--vision) -> OmniMoE-VL, both upcycled; "
                    "equal to the LLaVA-style composition at initialisation",
    )
]
