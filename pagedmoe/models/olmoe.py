from pagedmoe.models.llama import DecoderForCausalLM
from pagedmoe.models.moe_block import MoEBlock, softmax_router


class OlmoeForCausalLM(DecoderForCausalLM):
    """Every layer sparse, softmax top-k without renormalisation; q/k RMSNorm over all heads, clip_qkv."""
    qk_norm = "full"

    def make_mlp(self, config, layer_idx: int):
        return MoEBlock(layer_idx, config.num_experts, config.hidden_size, config.intermediate_size,
                        softmax_router(config, bool(getattr(config, "norm_topk_prob", False))))
