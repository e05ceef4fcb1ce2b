"""The whole engine on the Triton kernels (interpreted on the CPU): greedy tokens of tiny Llama, Qwen3-MoE,
gpt-oss and DeepSeek-V3 checkpoints identical to the default path's (PyTorch attention + C++ kernels), in float32, through
chunked prefills (a query chunk over the sequence's cached KV), split-K decodes and swap preemption."""
import pytest
import transformers

from conftest import (VOCAB, assert_all_blocks_free, make_prompts, pagedmoe_greedy, save_random_model,
                      tiny_dense_config, tiny_moe_config)
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.attention import triton_backend

pytest.importorskip("triton")
NUM_NEW = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, eos_token_id=None, bos_token_id=0, pad_token_id=0)
CONFIGS = {
    "llama": lambda: tiny_dense_config("llama"),
    "qwen3-moe": tiny_moe_config,
    # sliding-window layers (their own block tables), sinks, swigluoai experts with biases
    "gpt-oss": lambda: transformers.GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=32, intermediate_size=48,
                                                 num_local_experts=8, num_experts_per_tok=2, sliding_window=4),
    # MLA's latent cache
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, first_k_dense_replace=1,
        n_shared_experts=1, num_experts_per_tok=3, q_lora_rank=None, n_group=1, topk_group=1),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(CONFIGS[request.param](), path)
    return str(path)


def test_triton_backends_match_default_path_greedy(model_path, monkeypatch):
    monkeypatch.setattr(triton_backend, "SPLIT_TOKENS", 16)  # decodes past 16 positions split their context
    steps = []
    attention = triton_backend.paged_attention
    monkeypatch.setattr(triton_backend, "paged_attention",
                        lambda q, k, v, step, *args: steps.append(step) or attention(q, k, v, step, *args))
    prompts = make_prompts(4, seed=5, min_len=10, max_len=30)
    engine_args = dict(max_num_batched_tokens=24, block_size=4, num_kv_blocks=20, preemption_mode="swap")
    expected = pagedmoe_greedy(model_path, prompts, NUM_NEW, **engine_args)
    assert not steps
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, attention_backend="triton",
              moe_backend="triton", **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)
    windowed = "gpt-oss" in model_path  # its window layers free their blocks: this pool never preempts it
    assert windowed or llm.engine.get_stats().num_preemptions_swap > 0
    assert any(step.num_splits > 1 for step in steps)
    assert any(bool((step.seq_lens > step.query_lens).any()) and step.max_query_len > 1 for step in steps)


def test_triton_backends_are_selected(model_path):
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, attention_backend="triton",
              moe_backend="triton", num_kv_blocks=8)
    runner = llm.engine.runner
    assert runner.triton_attention and runner.decode_kernel is None
    moe_layers = getattr(runner.model, "moe_layers", [])
    assert all(layer.triton_experts is not None and layer.cpu_experts is None for layer in moe_layers)
