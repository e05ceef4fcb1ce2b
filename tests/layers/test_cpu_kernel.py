import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import X86_64_LEVELS, missing_for
from pagedmoe.layers.attention import cpu_kernel
from pagedmoe.layers.attention.cpu_kernel import PagedDecodeKernel


def reference(q, cache, block_tables, seq_lens, scale, window=0, sinks=None):
    """Gather each sequence's context (its last `window` positions if given) and attend to it one sequence at a
    time: SDPA, or with sinks HF's eager gpt-oss softmax (the sink logit concatenated, then dropped)."""
    num_kv_heads, out = cache.shape[0] // 2, []
    for s, seq_len in enumerate(seq_lens.tolist()):
        context = cache[:, block_tables[s]].flatten(1, 2)[:, :seq_len].float()
        context = context[:, max(0, seq_len - window):] if window else context
        keys, values = context[:num_kv_heads], context[num_kv_heads:]
        if sinks is None:
            o = torch.nn.functional.scaled_dot_product_attention(q[s, :, None].float(), keys, values, scale=scale,
                                                                 enable_gqa=True)
            out.append(o[:, 0])
            continue
        group = q.shape[1] // num_kv_heads
        logits = torch.einsum("hd,htd->ht", q[s].float(), keys.repeat_interleave(group, 0)) * scale
        probs = torch.softmax(torch.cat([logits, sinks[:, None].float()], -1), -1)[:, :-1]
        out.append(torch.einsum("ht,htd->hd", probs, values.repeat_interleave(group, 0)))
    return torch.stack(out)


def make_problem(num_seqs, num_kv_heads, group_size, block_size, head_dim, max_len, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_blocks = num_seqs * max_blocks + 3
    cache = torch.randn(2 * num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, num_kv_heads * group_size, head_dim, generator=g).to(dtype)
    return q, cache, block_tables.contiguous(), seq_lens


@settings(max_examples=25, deadline=None)
@given(num_seqs=st.integers(1, 6), num_kv_heads=st.integers(1, 3), group_size=st.sampled_from([1, 2, 4, 5]),
       block_size=st.sampled_from([1, 4, 16]), head_dim=st.sampled_from([8, 32, 64, 80, 96, 128]),
       max_len=st.integers(1, 70), seed=st.integers(0, 1000))
def test_matches_sdpa_over_gathered_context(num_seqs, num_kv_heads, group_size, block_size, head_dim, max_len,
                                            seed):
    q, cache, block_tables, seq_lens = make_problem(num_seqs, num_kv_heads, group_size, block_size, head_dim,
                                                   max_len, torch.float32, seed)
    out = PagedDecodeKernel(torch.float32)(q, cache, block_tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out, reference(q, cache, block_tables, seq_lens, head_dim ** -0.5),
                               atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(group_size=st.sampled_from([1, 3]), block_size=st.sampled_from([1, 4, 16]),
       head_dim=st.sampled_from([8, 64, 96]), max_len=st.integers(1, 70), window=st.integers(0, 40),
       has_sinks=st.booleans(), seed=st.integers(0, 1000))
def test_sliding_window_and_sinks_match_the_reference(group_size, block_size, head_dim, max_len, window,
                                                      has_sinks, seed):
    q, cache, block_tables, seq_lens = make_problem(4, 2, group_size, block_size, head_dim, max_len,
                                                   torch.float32, seed)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(seed)) * 3 if has_sinks else None
    out = PagedDecodeKernel(torch.float32)(q, cache, block_tables, seq_lens, 0.3, window=window, sinks=sinks)
    torch.testing.assert_close(out, reference(q, cache, block_tables, seq_lens, 0.3, window, sinks),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 80])  # the fast path and the generic loop
def test_any_thread_count_splits_the_items_and_gives_the_same_output(head_dim):
    """Each thread takes a run of whole items sized by their rows and prefetches along it: with 1 to 7 threads,
    lengths far apart and a sliding window, every item is computed once and the output is bit-identical."""
    q, cache, block_tables, seq_lens = make_problem(5, 2, 3, 4, head_dim, 120, torch.float32, seed=4)
    longest = block_tables.shape[1] * 4
    seq_lens = torch.tensor([longest, 1, 2, longest // 2 + 1, 3])
    kernel, threads = PagedDecodeKernel(torch.float32), torch.get_num_threads()
    try:
        for window in (0, 5):
            outs = []
            for n in (1, 2, 3, 7):
                torch.set_num_threads(n)
                outs.append(kernel(q, cache, block_tables, seq_lens, 0.125, window=window))
            assert all(torch.equal(outs[0], out) for out in outs[1:])
            torch.testing.assert_close(outs[0], reference(q, cache, block_tables, seq_lens, 0.125, window),
                                       atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_bad_sinks_raise_value_errors():
    q, cache, block_tables, seq_lens = make_problem(2, 2, 2, 4, 8, 10, torch.float32, seed=2)
    with pytest.raises(ValueError, match="sinks"):
        PagedDecodeKernel(torch.float32)(q, cache, block_tables, seq_lens, 1.0, sinks=torch.zeros(3))


def test_bfloat16_close_to_float32_reference():
    q, cache, block_tables, seq_lens = make_problem(5, 2, 3, 16, 64, 300, torch.bfloat16, seed=1)
    out = PagedDecodeKernel(torch.bfloat16)(q, cache, block_tables, seq_lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, cache, block_tables, seq_lens, 0.125), atol=1e-2, rtol=1e-2)


def test_bad_inputs_raise_value_errors():
    q, cache, block_tables, seq_lens = make_problem(2, 2, 2, 4, 8, 10, torch.float32, seed=2)
    kernel = PagedDecodeKernel(torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        PagedDecodeKernel(torch.float16)
    with pytest.raises(ValueError, match="must be torch.float32"):
        kernel(q.bfloat16(), cache, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        kernel(q, cache, block_tables, seq_lens + 100, 1.0)
    with pytest.raises(ValueError, match="block ids"):
        kernel(q, cache, block_tables + cache.shape[1], seq_lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(q.transpose(1, 2).contiguous().transpose(1, 2), cache, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(q[:, :, :4].contiguous(), cache, block_tables, seq_lens, 1.0)


def test_builds_once_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDMOE_CACHE_DIR", str(tmp_path))
    cpu_kernel.load_library.cache_clear()
    try:
        cpu_kernel.load_library()
        built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
        assert len(built) == 1
        cpu_kernel.load_library.cache_clear()
        cpu_kernel.load_library()
        assert list((tmp_path / "kernels").glob("*")) == built
    finally:
        cpu_kernel.load_library.cache_clear()


def test_a_failed_build_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDMOE_CACHE_DIR", str(tmp_path))
    cpu_kernel.load_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="cannot build"):
            cpu_kernel.load_library(compiler="/nonexistent/c++")
        assert not list((tmp_path / "kernels").glob("*"))
    finally:
        cpu_kernel.load_library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", list(X86_64_LEVELS))
def test_builds_for_avx2_and_avx512_targets_and_matches_sdpa(target, dtype):
    """The kernel as an AVX2 (x86-64-v3) or AVX-512 (x86-64-v4) machine builds it with -march=native; bf16 is
    converted in integer code, so neither needs bf16 instructions."""
    if reason := missing_for(target):
        pytest.skip(reason)
    kernel = PagedDecodeKernel(dtype, cpu_kernel.load_library(march=target))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for seed, head_dim in enumerate((32, 64, 80, 96, 128)):  # the specialized head sizes and the generic loop
        group_size = 5 if seed % 2 else 3  # 5: a pass of up to 4 heads and a pass of the rest
        q, cache, block_tables, seq_lens = make_problem(4, 2, group_size, 16, head_dim, 90, dtype, seed)
        out = kernel(q, cache, block_tables, seq_lens, head_dim ** -0.5)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), reference(q, cache, block_tables, seq_lens, head_dim ** -0.5),
                                   **tol)
        sinks = torch.linspace(-2, 2, q.shape[1])
        out = kernel(q, cache, block_tables, seq_lens, head_dim ** -0.5, window=20, sinks=sinks)
        torch.testing.assert_close(out.float(), reference(q, cache, block_tables, seq_lens, head_dim ** -0.5,
                                                          20, sinks), **tol)


def test_loading_the_kernel_keeps_denormals():
    """Linked with -ffast-math, GCC < 13 adds crtfastmath.o: loading would flush denormals process-wide."""
    cpu_kernel.load_library()
    assert (torch.tensor([1e-39]) * 1.0).item() != 0.0


def test_an_unusable_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PAGEDMOE_CACHE_DIR", str(tmp_path / "file"))
    cpu_kernel.load_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="cannot build or load"):
            cpu_kernel.load_library()
    finally:
        cpu_kernel.load_library.cache_clear()
