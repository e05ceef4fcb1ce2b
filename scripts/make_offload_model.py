"""A random-weight Qwen3-MoE checkpoint whose routed experts far exceed the expert cache budgets it is served
with (`pagedmoe bench offload`), written shard by shard (one safetensors file a layer) so that building it
never holds more than one layer in memory:

    python scripts/make_offload_model.py OUT_DIR [--layers 16] [--experts 32] [--dtype bfloat16]

Default shape: hidden 1024, 16 layers, 16 heads / 4 KV heads of 64, 32 experts of intermediate 768, top-4,
vocab 32000, tied embeddings: 1.28B parameters, 1.21B of them in routed experts (2.25 GiB in bf16; 4.5 GiB in
float32), 0.23B active a token. A budget of 1/8, 1/4 or 1/2 of the expert bytes is 0.28, 0.56 or 1.1 GiB.
Weights are N(0, 0.02) as HF initialises them (norms 1), the tokenizer one word-level token per id."""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_bench_models import save_tokenizer  # noqa: E402


def offload_config(args) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                                       moe_intermediate_size=768, num_experts=args.experts, num_experts_per_tok=4,
                                       norm_topk_prob=True, num_hidden_layers=args.layers, num_attention_heads=16,
                                       num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                                       tie_word_embeddings=True, eos_token_id=None, dtype=args.dtype,
                                       architectures=["Qwen3MoeForCausalLM"])


def layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim, cfg.moe_intermediate_size
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
              "mlp.gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes |= {f"mlp.experts.{e}.gate_proj.weight": (inter, h), f"mlp.experts.{e}.up_proj.weight": (inter, h),
                   f"mlp.experts.{e}.down_proj.weight": (h, inter)}
    return shapes


def random_tensor(shape, generator, dtype) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def write_shard(tensors: dict, out: str, name: str, weight_map: dict):
    save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
    weight_map.update({key: name for key in tensors})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    cfg, dtype = offload_config(args), getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    generator, weight_map = torch.Generator().manual_seed(0), {}
    num_shards = cfg.num_hidden_layers + 1
    for layer in range(cfg.num_hidden_layers):
        tensors = {f"model.layers.{layer}.{k}": random_tensor(s, generator, dtype) for k, s in layer_shapes(cfg).items()}
        write_shard(tensors, args.out, f"model-{layer + 1:05d}-of-{num_shards:05d}.safetensors", weight_map)
    rest = {"model.embed_tokens.weight": random_tensor((cfg.vocab_size, cfg.hidden_size), generator, dtype),
            "model.norm.weight": random_tensor((cfg.hidden_size,), generator, dtype)}
    write_shard(rest, args.out, f"model-{num_shards:05d}-of-{num_shards:05d}.safetensors", weight_map)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    cfg.save_pretrained(args.out)
    save_tokenizer(cfg.vocab_size, args.out)
    print(f"wrote {args.out}: {cfg.num_hidden_layers} layers of {cfg.num_experts} experts ({args.dtype})")


if __name__ == "__main__":
    main()
