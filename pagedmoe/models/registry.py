import importlib

from torch import nn

# architecture name -> "module:Class", imported on first use
MODEL_REGISTRY = {
    "LlamaForCausalLM": "pagedmoe.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedmoe.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagedmoe.models.llama:Qwen3ForCausalLM",
    "MixtralForCausalLM": "pagedmoe.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "pagedmoe.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pagedmoe.models.qwen_moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "pagedmoe.models.olmoe:OlmoeForCausalLM",
    "DeepseekV3ForCausalLM": "pagedmoe.models.deepseek:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "pagedmoe.models.deepseek:DeepseekV2ForCausalLM",
    "GptOssForCausalLM": "pagedmoe.models.gpt_oss:GptOssForCausalLM",
}


def resolve_model_class(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            module_name, class_name = MODEL_REGISTRY[arch].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"architectures {config.architectures} not supported; known: {sorted(MODEL_REGISTRY)}")
