"""Past its attention, the last layer computes only the rows the step reads (as llama.cpp's output ids): each
finishing prompt's last row, every prompt row where prompt logprobs are asked, one row where a chunk samples
nothing. The other layers compute every row (their KV is needed); tokens and logprobs stay HF's."""
from conftest import (assert_all_blocks_free, hf_greedy, make_prompts, max_logprob_error, pagedmoe_prompt_logprobs,
                      save_random_model, tiny_moe_config)
from pagedmoe import LLM, SamplingParams


def mlp_rows(llm: LLM) -> tuple[list[int], list[int]]:
    """Rows entering the first and the last layer's MLP, one entry a forward."""
    layers = llm.engine.runner.model.layers
    first, last = [], []
    layers[0].mlp.register_forward_pre_hook(lambda _, args: first.append(args[0].shape[0]))
    layers[-1].mlp.register_forward_pre_hook(lambda _, args: last.append(args[0].shape[0]))
    return first, last


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_prefill_runs_the_last_mlp_on_its_sampled_rows(dense_model):
    path, hf_model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    first, last = mlp_rows(llm)
    prompts = make_prompts(3, seed=5, min_len=10, max_len=20)
    tokens = greedy(llm, prompts, max_tokens=3)
    assert first == [sum(map(len, prompts)), 3, 3] and last == [3, 3, 3]
    assert tokens == [hf_greedy(hf_model, p, 3) for p in prompts]
    assert_all_blocks_free(llm.engine)


def test_a_chunk_that_samples_nothing_runs_one_row(dense_model):
    path, hf_model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)
    first, last = mlp_rows(llm)
    prompt = make_prompts(1, seed=6, min_len=40, max_len=40)[0]
    assert greedy(llm, [prompt], max_tokens=2) == [hf_greedy(hf_model, prompt, 2)]
    assert first == [16, 16, 8, 1] and last == [1, 1, 1, 1]
    assert_all_blocks_free(llm.engine)


def test_prompt_logprobs_keep_every_prompt_row(dense_model):
    path, hf_model = dense_model
    prompts = make_prompts(2, seed=7, min_len=12, max_len=20)
    assert max_logprob_error(hf_model, prompts, pagedmoe_prompt_logprobs(path, prompts)) < 1e-4
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    first, last = mlp_rows(llm)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert last == first == [sum(map(len, prompts))]
    assert_all_blocks_free(llm.engine)


def test_the_last_moe_layer_routes_only_the_sampled_rows(tmp_path):
    hf_model = save_random_model(tiny_moe_config(), tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    first, last = mlp_rows(llm)
    prompts = make_prompts(2, seed=8, min_len=10, max_len=20)
    assert greedy(llm, prompts, max_tokens=2) == [hf_greedy(hf_model, p, 2) for p in prompts]
    assert first == [sum(map(len, prompts)), 2] and last == [2, 2]
    assert_all_blocks_free(llm.engine)
