import pytest
import torch
import torch.nn.functional as F
from conftest import assert_all_blocks_free, make_prompts, max_logprob_error

from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.attention import cpu_prefill
from pagedmoe.layers.attention.cpu_prefill import PagedPrefillKernel

BLOCK_SIZE, NUM_BLOCKS = 16, 40


def kernel_or_skip(dtype, march="native") -> PagedPrefillKernel:
    try:
        return PagedPrefillKernel(dtype, cpu_prefill.load_library(march=march))
    except RuntimeError as error:  # no compiler here: the runner keeps SDPA
        pytest.skip(str(error))


def reference(q, cache, table, seq_len, scale):
    """SDPA over the gathered context in float32: the queries are the last positions of the sequence."""
    num_kv_heads, num_queries = cache.shape[0] // 2, q.shape[0]
    context = cache[:, table].flatten(1, 2)[:, :seq_len].float()
    keys, values = context[:num_kv_heads], context[num_kv_heads:]
    mask = torch.ones(num_queries, seq_len, dtype=torch.bool).tril(seq_len - num_queries)
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len,num_queries", [(1, 1), (17, 17), (223, 223), (300, 45), (130, 1), (64, 64)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 4, 64), (4, 4, 128), (8, 1, 32)])
def test_matches_sdpa_over_the_gathered_context(dtype, seq_len, num_queries, march, num_heads, num_kv_heads,
                                                head_dim):
    """Chunked prefill (fewer queries than positions) and every GQA grouping, through the native build and
    the AVX2 one an AVX-512 machine would not run otherwise."""
    if march != "native" and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("an x86-64-v3 build runs on AVX2 machines only")
    kernel = kernel_or_skip(dtype, march)
    gen = torch.Generator().manual_seed(seq_len * 1000 + num_queries)
    cache = torch.randn(2 * num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:-(-seq_len // BLOCK_SIZE)]
    q = torch.randn(num_queries, num_heads, head_dim, generator=gen).to(dtype)
    out = kernel(q, cache, table, seq_len, head_dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), reference(q, cache, table, seq_len, head_dim ** -0.5), atol=tolerance,
                               rtol=tolerance)


def test_bad_inputs_name_what_is_wrong():
    kernel = kernel_or_skip(torch.float32)
    cache, q = torch.zeros(8, NUM_BLOCKS, BLOCK_SIZE, 64), torch.zeros(4, 12, 64)
    with pytest.raises(ValueError, match="seq_len"):
        kernel(q, cache, torch.arange(1), 3, 1.0)
    with pytest.raises(ValueError, match="block ids"):
        kernel(q, cache, torch.tensor([NUM_BLOCKS]), 4, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        kernel(q, cache, torch.arange(1), 17, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(torch.zeros(4, 12, 8), torch.zeros(8, NUM_BLOCKS, BLOCK_SIZE, 8), torch.arange(1), 4, 1.0)
    assert kernel.supports(64) and not kernel.supports(8)



class CountingKernel:
    """The runner's kernel, recording the seq_len of every call."""

    def __init__(self, kernel: PagedPrefillKernel):
        self.kernel, self.seq_lens = kernel, []

    def supports(self, head_dim: int) -> bool:
        return self.kernel.supports(head_dim)

    def __call__(self, q, cache, block_table, seq_len, scale, tables_checked=False):
        self.seq_lens.append(seq_len)
        return self.kernel(q, cache, block_table, seq_len, scale, tables_checked)


def test_prompts_attend_through_the_kernel_as_hf_scores_them(dense_model):
    """End to end: every prompt (and chunked-prefill chunk, with a small token budget) runs through the kernel,
    and the prompt logprobs match HF's within 1e-4, as they do through SDPA."""
    path, hf_model = dense_model
    prompts = make_prompts(4, seed=3, min_len=20, max_len=70)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=48)
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if llm.engine.runner.prefill_kernel is None or not llm.engine.runner.prefill_kernel.supports(head_dim):
        pytest.skip("no C++ compiler here, or a head_dim this build's panels do not divide: SDPA attends")
    kernel = llm.engine.runner.prefill_kernel = CountingKernel(llm.engine.runner.prefill_kernel)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    logprobs = [[out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))] for p, out in zip(prompts, outputs)]
    assert max_logprob_error(hf_model, prompts, logprobs) < 1e-4
    assert max(kernel.seq_lens) > 48  # a chunk attended earlier chunks' context in the cache
