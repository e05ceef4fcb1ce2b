from pagedmoe.models.llama import DecoderForCausalLM
from pagedmoe.models.moe_block import MoEBlock, softmax_router


class MixtralForCausalLM(DecoderForCausalLM):
    """Every layer sparse, softmax top-2 renormalised. Released checkpoints name the block
    `block_sparse_moe` and experts w1/w3/w2; transformers 5 writes `mlp` and fused 3-D experts."""
    weight_renames = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config, layer_idx: int):
        return MoEBlock(layer_idx, config.num_local_experts, config.hidden_size, config.intermediate_size,
                        softmax_router(config, renormalize=True))
