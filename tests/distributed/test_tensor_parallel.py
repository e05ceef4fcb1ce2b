"""Tensor and expert parallelism with 2 spawned ranks (gloo) on tiny random checkpoints (DeepSeek-V3's MLA split
by query heads among them): greedy tokens
identical to one process and prompt logprobs within 1e-4, with chunked prefill and a pool small enough to
force preemption (recompute, and swap for one model), the pool free afterwards; configurations that cannot be
split are refused naming the field."""
import pytest

from conftest import TINY_MOE_CONFIGS, assert_all_blocks_free, make_prompts, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams

CONFIGS = {
    "llama": lambda: tiny_dense_config("llama"),
    "qwen3": lambda: tiny_dense_config("qwen3", num_key_value_heads=1),  # 1 KV head: replicated on both ranks
    **TINY_MOE_CONFIGS,
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"}
NUM_NEW = 32
# chunks of at most 24 tokens; 12 blocks of 16 for 8 sequences of up to 40 + 32 tokens: preemption is forced
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=24, num_kv_blocks=12)


def generate(path: str, prompts, **engine_args):
    llm = LLM(path, **ENGINE, **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_all_blocks_free(llm.engine)
        preempted = llm.engine.get_stats()
        assert preempted.num_preemptions_recompute + preempted.num_preemptions_swap > 0
        return outputs
    finally:
        llm.engine.shutdown()


def prompt_logprobs(output) -> list[float]:
    return [output.prompt_logprobs[i][t].logprob for i, t in enumerate(output.prompt_token_ids) if i]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each model's checkpoint and one process's outputs, made on first use."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            save_random_model(CONFIGS[arch](), path)
            prompts = make_prompts(8, seed=3)
            preemption = {"preemption_mode": "swap"} if arch == "llama" else {}
            cache[arch] = path, prompts, preemption, generate(path, prompts, **preemption)
        return cache[arch]
    return get


CASES = [(arch, False) for arch in CONFIGS] + [(arch, True) for arch in CONFIGS if arch in MOE]


@pytest.mark.parametrize("arch, expert_parallel", CASES, ids=[f"{a}-{'ep2' if ep else 'tp2'}" for a, ep in CASES])
def test_two_ranks_match_one_process(references, arch, expert_parallel):
    path, prompts, preemption, expected = references(arch)
    got = generate(path, prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **preemption)
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(prompt_logprobs(want), prompt_logprobs(out))) < 1e-4


DP_ARCHS = ["llama", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("arch", DP_ARCHS)
def test_data_parallel_attention_matches_one_process(references, arch):
    """DP=2 (+ EP for MoE): each rank attends its own sequences over its own pool of 12 blocks; MoE layers
    gather both ranks' tokens. Tokens and prompt logprobs as one process; both ranks took sequences."""
    path, prompts, _, expected = references(arch)
    llm = LLM(path, **ENGINE, data_parallel_size=2, enable_expert_parallel=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_all_blocks_free(llm.engine)
        assert all(n > 0 for n in llm.engine.kv.num_assigned) and llm.engine.kv.pool.num_blocks == 2 * 12
        assert llm.engine.get_stats().num_preemptions_recompute > 0
    finally:
        llm.engine.shutdown()
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(prompt_logprobs(want), prompt_logprobs(out))) < 1e-4


def test_unsplittable_configurations_are_refused(tmp_path):
    path = str(tmp_path)
    save_random_model(tiny_dense_config("llama"), path)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    ok = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2)  # the group was freed
    ok.engine.shutdown()


def test_eplb_rebalancing_mid_run_keeps_the_tokens(references):
    """EP=2 with 2 redundant experts, rebalanced every 4 steps from the last 8 steps' load: weights move
    between ranks between steps, and the tokens stay those of one process."""
    path, prompts, preemption, expected = references("qwen3_moe")
    llm = LLM(path, **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=2, eplb_step_interval=4, eplb_window_size=8)
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        history = llm.engine.runner.eplb.history
        placement = [moe.expert_map.placement for moe in llm.engine.runner.model.moe_layers]
    finally:
        llm.engine.shutdown()
    assert len(history) >= 3
    assert any(p.tolist() != [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]] for p in placement)  # moved from the start
    assert all(after <= before + 1e-9 for _, before, after in history)
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(prompt_logprobs(want), prompt_logprobs(out))) < 1e-4
