"""SMoES, soft-modality-guided expert specialisation ("Soft Modality-Guided Expert Specialization in MoE-VLMs",
CVPR 2026), as a host-agnostic part of the MoE core: a training-time routing regulariser that changes no forward
output. A host provides each MoE layer's router logits (and top-k selection) and the tokens' hard modality; this
package computes the soft modality scores, keeps the per-layer buffers and bins, and returns the bin-level balance
and inter-bin mutual-information losses that replace the host's auxiliary loss.

    scores.py      the soft modality score estimators (attention, gaussian, hard)
    state.py       the per-layer buffers (`SmoesLayerState`) and the per-forward runtime (`SmoesRuntime`)
    bins.py        contiguous and adaptive expert bins
    losses.py      the bin-level balance loss and the inter-bin mutual information of one layer
    schedules.py   the alpha_MI warm-up and the re-binning schedule
    metrics.py     the modality specialisation index (MSI)
    placement.py   bins on expert-parallel devices, dispatch metrics, and the bin-aligned export permutation
    regularizer.py `apply_smoes`: one training step over all MoE layers
"""

from .bins import BINNING_TYPES, adaptive_bins, contiguous_bins, soft_dispatch_counts, text_preference
from .losses import BALANCE_MODES, bin_balance_loss, inter_bin_mutual_information
from .metrics import mean_modality_specialisation_index, modality_specialisation_index
from .placement import (
    DispatchMetrics,
    bin_aligned_order,
    check_placement,
    device_of_expert,
    dispatch_metrics,
    random_routing_dispatch,
    smoes_export_bin_aligned,
)
from .regularizer import SmoesLosses, apply_smoes, check_routers_trainable
from .schedules import mi_coefficient, rebins_after
from .scores import (
    NUM_MODALITIES,
    SCORE_TYPES,
    TEXT,
    VISION,
    attention_mixed_scores,
    gaussian_scores,
    hard_modality,
    one_hot_scores,
    residual_score_update,
)
from .state import ModalityMoments, SmoesLayerState, SmoesRuntime


__all__ = [
    "BALANCE_MODES",
    "BINNING_TYPES",
    "NUM_MODALITIES",
    "SCORE_TYPES",
    "TEXT",
    "VISION",
    "DispatchMetrics",
    "ModalityMoments",
    "SmoesLayerState",
    "SmoesLosses",
    "SmoesRuntime",
    "adaptive_bins",
    "apply_smoes",
    "attention_mixed_scores",
    "bin_aligned_order",
    "bin_balance_loss",
    "check_placement",
    "check_routers_trainable",
    "contiguous_bins",
    "device_of_expert",
    "dispatch_metrics",
    "gaussian_scores",
    "hard_modality",
    "inter_bin_mutual_information",
    "mean_modality_specialisation_index",
    "mi_coefficient",
    "modality_specialisation_index",
    "one_hot_scores",
    "random_routing_dispatch",
    "rebins_after",
    "residual_score_update",
    "smoes_export_bin_aligned",
    "soft_dispatch_counts",
    "text_preference",
]
