from pagedmoe.models.llama import MLP, DecoderForCausalLM
from pagedmoe.models.moe_block import MoEBlock, is_sparse_layer, moe_index_of, softmax_router


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = "head"

    def make_mlp(self, config, layer_idx: int):
        if not is_sparse_layer(config, layer_idx):
            return MLP(config.hidden_size, config.intermediate_size)
        return MoEBlock(moe_index_of(config, layer_idx), config.num_experts, config.hidden_size,
                        config.moe_intermediate_size, softmax_router(config, config.norm_topk_prob))


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2-MoE: softmax top-k plus a shared expert gated by sigmoid(shared_expert_gate(x))."""

    def make_mlp(self, config, layer_idx: int):
        if not is_sparse_layer(config, layer_idx):
            return MLP(config.hidden_size, config.intermediate_size)
        return MoEBlock(moe_index_of(config, layer_idx), config.num_experts, config.hidden_size,
                        config.moe_intermediate_size, softmax_router(config, config.norm_topk_prob),
                        shared_intermediate_size=config.shared_expert_intermediate_size, shared_expert_gate=True)
