"""Greedy tokens and prompt logprobs against HF transformers (float32, tiny random Llama and Qwen3)."""
import pytest
import torch

from conftest import assert_all_blocks_free, hf_greedy, make_prompts
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers import cpu_ops, linear
from pagedmoe.layers.attention import cpu_kernel, metadata

NUM_NEW = 32
SCENARIOS = {
    "alone": dict(),
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "long_prefill": dict(long_prefill_token_threshold=8),
    "recompute": dict(num_kv_blocks=14, preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=14, preemption_mode="swap"),
}


@pytest.fixture(scope="module")
def reference(dense_model):
    path, model = dense_model
    prompts = make_prompts(8, seed=3, max_len=60)
    return path, prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(reference, scenario):
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if scenario == "alone":
        outputs = [llm.generate(x, params, use_tqdm=False)[0] for x in inputs]
    else:
        outputs = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    if scenario in ("recompute", "swap"):
        assert getattr(stats, f"num_preemptions_{scenario}") > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("prepack", [True, False])
def test_greedy_matches_hf_with_and_without_packed_weights(reference, monkeypatch, prepack):
    """Tiny weights fall under PACK_MIN_BYTES; lowered to 0, every linear runs on oneDNN packed weights (the
    CPU linear kernel, which replaces them where it applies, off)."""
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, prepack_weights=prepack, cpu_linear_kernel=False)
    assert (llm.engine.runner.model.lm_head.packed_weight is not None) == (
        prepack and torch.backends.mkldnn.is_available())
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("fused", [True, False])
def test_greedy_matches_hf_with_and_without_cpu_linear_kernel_and_fused_ops(reference, monkeypatch, fused):
    """Every linear on the tile-GEMM kernel (PACK_MIN_BYTES lowered to 0) and RMSNorm, rotary and greedy
    argmax on the fused pointwise kernels; or all of them in PyTorch."""
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(cpu_ops, "enabled", fused)
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_linear_kernel=fused, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    assert (model.lm_head.cpu_kernel is not None) == fused
    assert (model.layers[0].self_attn.qkv_proj.cpu_kernel is not None) == fused
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_matches_hf_with_and_without_cpu_attention_kernel(reference, kernel):
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_attention_kernel=kernel)
    assert (llm.engine.runner.decode_kernel is not None) == kernel
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


def test_falls_back_to_gather_when_the_kernel_cannot_build(reference, monkeypatch, caplog):
    def fail():
        raise RuntimeError("cannot build the CPU attention kernel: no compiler")
    monkeypatch.setattr(cpu_kernel, "load_library", fail)
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    assert llm.engine.runner.decode_kernel is None and "falls back" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]
    assert_all_blocks_free(llm.engine)


def test_greedy_matches_hf_one_sequence_per_decode_chunk(reference, monkeypatch):
    """Without the CPU kernel, decode chunks of one sequence each (CPU chunks by bytes), longest first."""
    monkeypatch.setattr(metadata, "CHUNK_BYTES", 1)
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_attention_kernel=False)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_hf(dense_model, chunk):
    path, model = dense_model
    prompts = make_prompts(4, seed=5, max_len=50)
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = output.prompt_logprobs[pos]
            assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            assert len(entry) >= 2
        first = output.outputs[0].logprobs[0]
        token = output.outputs[0].token_ids[0]
        assert abs(first[token].logprob - ref[-1, token].item()) < 1e-4 and first[token].rank == 1
    assert_all_blocks_free(llm.engine)
