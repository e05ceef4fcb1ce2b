"""Every MoE family against HF transformers in float32: greedy tokens, prompt logprobs, chunked
prefill, forced preemption, and expert-load statistics."""
import pytest
import torch
import transformers

from conftest import VOCAB, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers import linear

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, eos_token_id=None, bos_token_id=0, pad_token_id=0)


def moe_configs():
    return {
        "mixtral": transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=6,
                                              num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=48,
                                                 shared_expert_intermediate_size=80, num_experts=8,
                                                 num_experts_per_tok=2, norm_topk_prob=False,
                                                 decoder_sparse_step=1, mlp_only_layers=[1]),
        "qwen3_moe": transformers.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=128,
                                                 moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                                 norm_topk_prob=True, decoder_sparse_step=2),
        "olmoe": transformers.OlmoeConfig(**COMMON, intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                                          clip_qkv=4.0),
    }


NUM_NEW = 32


@pytest.fixture(scope="module", params=list(moe_configs()))
def moe_reference(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_random_model(moe_configs()[request.param], path, seed=2)
    prompts = make_prompts(8, seed=7, max_len=48)
    return str(path), model, prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("scenario", [dict(), dict(max_num_batched_tokens=20),
                                      dict(num_kv_blocks=12, preemption_mode="recompute")])
def test_moe_greedy_matches_hf(moe_reference, scenario):
    path, _, prompts, expected = moe_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **scenario)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if "num_kv_blocks" in scenario:
        assert llm.engine.get_stats().num_preemptions_recompute > 0
    assert_all_blocks_free(llm.engine)


def test_moe_greedy_matches_hf_on_packed_weights(moe_reference, monkeypatch):
    """Every linear and every expert on oneDNN pre-packed weights (tiny weights are not packed by default),
    with the fused CPU MoE kernel off: it replaces the packed expert copies where it applies."""
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    path, _, prompts, expected = moe_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_moe_kernel=False)
    if torch.backends.mkldnn.is_available():
        assert all(moe.packed_experts is not None for moe in llm.engine.runner.model.moe_layers)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("kernel", [True, False])
def test_moe_greedy_matches_hf_with_and_without_cpu_moe_kernel(moe_reference, monkeypatch, kernel):
    """The kernel runs the decode steps (and the small prefill chunks); larger batches take the expert loop.
    Tiny experts fall under PACK_MIN_BYTES; lowered to 0, every MoE layer gets the kernel."""
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    path, _, prompts, expected = moe_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_moe_kernel=kernel, max_num_batched_tokens=64)
    assert all((moe.cpu_experts is not None) == kernel for moe in llm.engine.runner.model.moe_layers)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


def test_moe_prompt_logprobs_and_expert_load(moe_reference):
    path, model, prompts, _ = moe_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        diffs = [abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
                 for i in range(1, len(prompt))]
        assert max(diffs) < 1e-4
    load = llm.engine.get_stats().expert_load
    moe_layers = llm.engine.runner.model.moe_layers
    assert len(load) == len(moe_layers) > 0
    num_tokens = sum(len(p) for p in prompts[:3])
    assert all(sum(row) == num_tokens * layer.router.top_k for row, layer in zip(load, moe_layers))
