"""FLOP counting against hand computations (dense and MoE active parameters), and the roofline arithmetic."""
import math

import pytest
import torch
import transformers

from conftest import VOCAB, tiny_dense_config
from pagedmoe.bench.roofline import bandwidth, matmul_peak, model_flops, read_bandwidth, roofline
from pagedmoe.models.registry import resolve_model_class

H, HEADS, KV_HEADS = 64, 4, 2  # conftest's tiny configs: hidden 64, 4 query heads, 2 KV heads


def pagedmoe_model(config):
    """The pagedmoe model of a config, uninitialised weights (only shapes are counted)."""
    config.architectures = config.architectures or [type(config).__name__.replace("Config", "ForCausalLM")]
    return resolve_model_class(config)(config)


def attention_params(head_dim: int) -> int:
    q = o = H * HEADS * head_dim
    k = v = H * KV_HEADS * head_dim
    return q + k + v + o


@pytest.mark.parametrize("arch, head_dim", [("llama", 16), ("qwen3", 32)])
def test_dense_counts_match_hand_computation(arch, head_dim):
    config = tiny_dense_config(arch)
    counts = model_flops(pagedmoe_model(config), config)
    per_layer = attention_params(head_dim) + 3 * H * 128  # + gate, up, down of intermediate 128
    assert counts.dense_params == 2 * per_layer
    assert counts.active_expert_params == counts.total_expert_params == 0
    assert counts.lm_head_params == VOCAB * H  # tied (qwen3) or not (llama): counted once, at sampled positions
    assert (counts.num_layers, counts.num_heads, counts.qk_dim, counts.v_dim) == (2, HEADS, head_dim, head_dim)


def qwen2_moe_config():
    return transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=3, num_attention_heads=HEADS,
                                       num_key_value_heads=KV_HEADS, intermediate_size=128, moe_intermediate_size=48,
                                       shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
                                       decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512)


def test_moe_counts_only_active_experts():
    config = qwen2_moe_config()
    counts = model_flops(pagedmoe_model(config), config)
    expert = 3 * H * 48
    sparse_layer_dense = H * 8 + 3 * H * 80 + H  # router, shared expert, shared expert gate
    assert counts.dense_params == 3 * attention_params(16) + 3 * H * 128 + 2 * sparse_layer_dense
    assert counts.active_expert_params == 2 * 2 * expert  # 2 sparse layers x top-2
    assert counts.total_expert_params == 2 * 8 * expert
    assert counts.matmul_params == counts.dense_params + counts.active_expert_params


def test_request_flops_is_the_sum_over_tokens():
    config = tiny_dense_config("llama")
    counts = model_flops(pagedmoe_model(config), config)
    prompt_len, output_len = 7, 4
    fed = prompt_len + output_len - 1
    by_token = sum(counts.token_flops(p, samples=p >= prompt_len - 1) for p in range(fed))
    assert counts.request_flops(prompt_len, output_len) == by_token
    matmul = 2 * counts.matmul_params * fed
    attention = 2 * 2 * HEADS * (16 + 16) * fed * (fed + 1) // 2
    assert by_token == matmul + attention + 2 * counts.lm_head_params * output_len
    assert counts.chunk_flops(3, 4, False) == sum(counts.token_flops(p, False) for p in range(3, 7))


def test_roofline_arithmetic_and_peak_figures():
    r = roofline(flops=4e9, elapsed_s=2.0, output_tokens=100, peak_flop_s=8e9)
    assert r["achieved_flop_s"] == 2e9 and r["roofline_pct"] == 25.0
    assert r["roofline_time_s"] == 0.5 and r["roofline_output_tok_s"] == 200.0 and r["output_tok_s"] == 50.0
    peak = matmul_peak(torch.float32, "cpu", size=64, repeats=2)
    assert peak["size"] == 64 and peak["dtype"] == "float32" and peak["threads"] == torch.get_num_threads()
    assert math.isclose(peak["peak_flop_s"], 2 * 64 ** 3 / peak["best_s"])


@pytest.mark.parametrize("flags, expected", [("avx2 fma", "float32"), ("avx2 fma avx512_bf16", "bfloat16")])
def test_bf16_peak_is_the_float32_one_without_native_bf16(monkeypatch, flags, expected):
    """Where bf16 is not native the kernels widen it to float32, so that peak is the ceiling."""
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", flags)
    assert matmul_peak(torch.bfloat16, "cpu", size=32, repeats=1)["dtype"] == expected


def test_decode_bytes_count_weights_touched_and_kv_read():
    config = qwen2_moe_config()
    counts = model_flops(pagedmoe_model(config), config)
    assert counts.expert_params == 3 * H * 48
    assert counts.kv_values_per_token == 3 * 2 * KV_HEADS * 16  # layers x (K, V) x KV heads x head_dim
    moved = counts.decode_bytes(num_steps=2, active_experts=10, context_tokens=100, element_size=2)
    weights = ((counts.dense_params + counts.lm_head_params) * 2 + counts.expert_params * 10) * 2
    assert moved == {"weight_bytes": weights, "kv_bytes": 100 * counts.kv_values_per_token * 2,
                     "bytes": weights + 100 * counts.kv_values_per_token * 2}


def test_bandwidth_arithmetic_and_read_peak():
    b = bandwidth({"bytes": 6e9, "weight_bytes": 5e9, "kv_bytes": 1e9}, elapsed_s=2.0, peak_bytes_s=6e9)
    assert b["achieved_bytes_s"] == 3e9 and b["bandwidth_pct"] == 50.0 and b["weight_bytes"] == 5e9
    read = read_bandwidth("cpu", nbytes=1 << 20, repeats=2)
    assert read["bytes"] == 1 << 20 and math.isclose(read["peak_bytes_s"], read["bytes"] / read["best_s"])


def test_packed_4bit_models_count_as_their_dense_form(tmp_path):
    """Packed 4-bit layers keep no dense weights to count (NVFP4 packs the experts and attention): the counts
    come from their shapes, the same as the dequantized model's."""
    from conftest import TINY_MOE_CONFIGS, save_random_model
    from pagedmoe import LLM
    from pagedmoe.layers.quantization.quantize import quantize_checkpoint
    config = TINY_MOE_CONFIGS["gpt_oss"]()
    save_random_model(config, tmp_path / "dense")
    quantize_checkpoint(str(tmp_path / "dense"), str(tmp_path / "q"), "nvfp4")
    counts = [model_flops(llm.engine.runner.model, llm.engine.config.hf_config) for llm in (
        LLM(str(tmp_path / "q"), dtype="float32", skip_tokenizer_init=True, quantization_mode=mode)
        for mode in ("packed", "dequantize"))]
    held = ("packed_params", "packed_bytes", "expert_bytes")
    assert all(getattr(counts[0], f) == getattr(counts[1], f) for f in vars(counts[0]) if f not in held)
    assert counts[0].expert_params > 0 and counts[1].expert_bytes == counts[1].packed_bytes == 0
    # packed: 4.5 bits a weight (codes and an E4M3 scale per 16) and NVFP4's float32 scale_2 per row
    model = LLM(str(tmp_path / "q"), dtype="float32", skip_tokenizer_init=True).engine.runner.model
    rows = sum(model.layers[0].mlp.fp4_experts[i][0].shape[0] for i in range(2))
    assert counts[0].expert_bytes == counts[0].expert_params * 4.5 / 8 + 4 * rows
    assert 0 < counts[0].packed_params <= counts[0].dense_params
