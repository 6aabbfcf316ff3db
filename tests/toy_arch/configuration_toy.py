"""A toy MoE architecture for testing the Hub machinery before (and besides) the real architectures.

It imports the core with absolute `moezoo.` imports on purpose: the exporter must rewrite those too.
"""

from transformers import PreTrainedConfig

from moezoo.modeling.moe.spec import MoeLayerSpec


class ToyMoeConfig(PreTrainedConfig):
    model_type = "moezoo_toy"

    vocab_size: int = 32
    hidden_size: int = 16
    num_hidden_layers: int = 2
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 8
    num_channels: int = 3
    patch_size: int = 4
    initializer_range: float = 0.2

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.moe_spec()

    def moe_spec(self) -> MoeLayerSpec:
        return MoeLayerSpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            expert_intermediate_size=self.moe_intermediate_size,
        )
