"""The whole engine on the Triton kernels (interpreted on the CPU): greedy tokens of the tiny Llama and
Qwen3-MoE checkpoints identical to the default path's (PyTorch attention + C++ kernels), in float32, through
chunked prefills (a query chunk over the sequence's cached KV), split-K decodes and swap preemption."""
import pytest

from conftest import (assert_all_blocks_free, make_prompts, pagedmoe_greedy, save_random_model, tiny_dense_config,
                      tiny_moe_config)
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.attention import triton_backend

pytest.importorskip("triton")
NUM_NEW = 6
CONFIGS = {"llama": lambda: tiny_dense_config("llama"), "qwen3-moe": tiny_moe_config}


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
    assert llm.engine.get_stats().num_preemptions_swap > 0
    assert any(step.num_splits > 1 for step in steps)
    assert any(bool((step.seq_lens > step.query_lens).any()) and step.max_query_len > 1 for step in steps)


def test_triton_backends_are_selected(model_path):
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, attention_backend="triton",
              moe_backend="triton", num_kv_blocks=8)
    runner = llm.engine.runner
    assert runner.triton_attention and runner.decode_kernel is None
    moe_layers = getattr(runner.model, "moe_layers", [])
    assert all(layer.triton_experts is not None and layer.cpu_experts is None for layer in moe_layers)
