"""gpt-oss against HF transformers in float32: attention sinks, sliding-window layers (a 4-token window, so it
matters within every prompt, and a 20-token one that crosses block boundaries), biases everywhere, the
clamped SwiGLU experts and YaRN RoPE. Greedy tokens through prefill, chunked prefill, forced preemption and
the PyTorch decode path, and prompt logprobs."""
import pytest
import transformers

from conftest import (VOCAB, hf_greedy, make_prompts, max_logprob_error, pagedmoe_greedy, pagedmoe_prompt_logprobs,
                      save_random_model)
from pagedmoe import LLM, SamplingParams

NUM_NEW = 32


def gpt_oss_config(sliding_window: int, head_dim: int) -> transformers.GptOssConfig:
    """head_dim 32 takes the C++ decode kernel's generic loop, 64 its register-blocked path."""
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=head_dim, intermediate_size=48,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=sliding_window,
                                     max_position_embeddings=512, eos_token_id=None, bos_token_id=0,
                                     pad_token_id=0)


CONFIGS = {"window4": (4, 32), "window20": (20, 64)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gpt_oss_reference(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    config = gpt_oss_config(*CONFIGS[request.param])
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model = save_random_model(config, path, seed=2)
    prompts = make_prompts(8, seed=7, max_len=48)
    return str(path), model, prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("scenario", [dict(), dict(max_num_batched_tokens=20),
                                      dict(num_kv_blocks=12, preemption_mode="recompute"),
                                      dict(cpu_attention_kernel=False)])
def test_gpt_oss_greedy_matches_hf(gpt_oss_reference, scenario):
    path, _, prompts, expected = gpt_oss_reference
    assert pagedmoe_greedy(path, prompts, NUM_NEW, **scenario) == expected


def test_forced_preemption_happens(gpt_oss_reference):
    path, _, prompts, _ = gpt_oss_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=12, preemption_mode="recompute")
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NUM_NEW, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions_recompute > 0


def test_gpt_oss_prompt_logprobs_match_hf(gpt_oss_reference):
    path, model, prompts, _ = gpt_oss_reference
    logprobs = pagedmoe_prompt_logprobs(path, prompts[:4], max_num_batched_tokens=24)
    assert max_logprob_error(model, prompts[:4], logprobs) < 1e-4


@pytest.mark.parametrize("dropped", ["window", "sinks"])
def test_the_window_and_the_sinks_each_change_the_output(gpt_oss_reference, dropped):
    """Guards the tests above against a window or sinks that never act: without either, tokens differ."""
    path, _, prompts, expected = gpt_oss_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    for layer in llm.engine.runner.model.layers:
        if dropped == "window":
            layer.self_attn.attn.window = 0
        else:
            layer.self_attn.sinks = None
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] != expected
