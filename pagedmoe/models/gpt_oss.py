from pagedmoe.layers.moe.routers import RouterConfig
from pagedmoe.models.llama import DecoderForCausalLM
from pagedmoe.models.moe_block import MoEBlock


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss: every layer sparse, top-k over the router's biased logits then a softmax over those k, the
    clamped SwiGLU (`swigluoai`) with biases on every expert; attention with biases, a learned sink per head
    and a sliding window on the layers HF's `layer_types` marks (every even one in the released configs).
    HF stores the experts [E, in, out] with gate and up interleaved; FusedMoE.load_weight converts them."""
    attention_sinks = True

    def make_mlp(self, config, layer_idx: int):
        return MoEBlock(layer_idx, config.num_local_experts, config.hidden_size, config.intermediate_size,
                        RouterConfig("topk_softmax", config.num_experts_per_tok), activation="swigluoai",
                        expert_bias=True, gate_bias=True)
