"""The toy architecture's catalogue entry, loaded with MOEZOO_EXTRA_PRESETS=toy_arch.presets."""

from pathlib import Path

from moezoo.registry import Architecture, Converter, Preset


ARCHITECTURES = [
    Architecture(
        name="moezoo_toy",
        title="Toy MoE",
        config="toy_arch.configuration_toy:ToyMoeConfig",
        models={
            "AutoModel": "toy_arch.modeling_toy:ToyMoeModel",
            "AutoModelForSequenceClassification": "toy_arch.modeling_toy:ToyMoeForSequenceClassification",
        },
        processor="toy_arch.processing_toy:ToyMoeProcessor",
        processor_parts={"AutoImageProcessor": "toy_arch.processing_toy:ToyMoeImageProcessor"},
        make_processor="toy_arch.processing_toy:make_toy_processor",
        pipeline_tag="feature-extraction",
        model_card=str(Path(__file__).with_name("model_card.md")),
    )
]

PRESETS = [
    Preset(name="tiny-moezoo_toy", architecture="moezoo_toy", config={}, description="toy, for tests"),
    Preset(
        name="toy-large", architecture="moezoo_toy",
        config={"hidden_size": 256, "num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2,
                "moe_intermediate_size": 128, "vocab_size": 1000},
        description="a bigger toy, from a per-expert checkpoint", base_checkpoints=("toy-org/toy-dense",),
        converter="toy-per-expert", license="apache-2.0",
    ),
]

CONVERTERS = [
    Converter(
        name="toy-per-expert",
        architecture="moezoo_toy",
        sources=("moezoo_toy_per_expert",),
        function="toy_arch.convert_toy:convert_per_expert",
        description="a toy checkpoint with per-expert tensors -> fused experts",
        add_arguments="toy_arch.convert_toy:add_arguments",
    )
]
