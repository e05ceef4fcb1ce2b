from torch import Tensor

from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig


class MoEBlock(FusedMoE):
    """A decoder layer's sparse MLP: FusedMoE that adds its routed-token counts to this step's
    expert_load row (the runner reads them after the forward; the layer keeps no state)."""

    def __init__(self, moe_index: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moe_index = moe_index

    def forward(self, x: Tensor, meta: AttentionMetadata | None = None) -> Tensor:
        load = None if meta is None or meta.expert_load is None else meta.expert_load[self.moe_index]
        return super().forward(x, load)


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def moe_index_of(config, layer_idx: int) -> int:
    return sum(is_sparse_layer(config, i) for i in range(layer_idx))


def softmax_router(config, renormalize: bool) -> RouterConfig:
    return RouterConfig(kind="softmax", top_k=config.num_experts_per_tok, renormalize=renormalize)
