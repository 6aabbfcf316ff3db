"""The shared sparse-MoE core: one implementation of routing and experts for every architecture of the zoo."""

from ...kernels.moezoo_experts import IMPLEMENTATION_NAME as SORTED_EXPERTS_IMPLEMENTATION
from ...kernels.triton_experts import IMPLEMENTATION_NAME as TRITON_EXPERTS_IMPLEMENTATION
from .accounting import ParameterCounts, count_parameters
from .balancing import balanced_routers, update_routing_biases
from .block import SparseMoeBlock
from .expert_parallel import DEDUP_EP_IMPLEMENTATION, AllToAllTraffic, DedupAllToAllEP
from .experts import GeluExperts, GeluMLP, SwiGLUExperts, SwiGLUMLP
from .initialization import init_moe_module
from .losses import load_balancing_loss, router_z_loss
from .pretrained import MoePreTrainedMixin
from .router import TopKRouter
from .spec import MoeLayerSpec
from .statistics import RoutingStatistics, plot_routing_heatmap, record_routing


__all__ = [
    "SORTED_EXPERTS_IMPLEMENTATION",
    "TRITON_EXPERTS_IMPLEMENTATION",
    "DEDUP_EP_IMPLEMENTATION",
    "AllToAllTraffic",
    "DedupAllToAllEP",
    "GeluExperts",
    "GeluMLP",
    "MoeLayerSpec",
    "MoePreTrainedMixin",
    "ParameterCounts",
    "RoutingStatistics",
    "SparseMoeBlock",
    "SwiGLUExperts",
    "SwiGLUMLP",
    "TopKRouter",
    "balanced_routers",
    "count_parameters",
    "init_moe_module",
    "load_balancing_loss",
    "plot_routing_heatmap",
    "record_routing",
    "router_z_loss",
    "update_routing_biases",
]
