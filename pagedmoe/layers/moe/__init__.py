from pagedmoe.layers.moe.fused_moe import expert_counts, fused_experts
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig, select_experts

__all__ = ["FusedMoE", "RouterConfig", "expert_counts", "fused_experts", "select_experts"]
