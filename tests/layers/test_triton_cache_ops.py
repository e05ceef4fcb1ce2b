"""The Triton KV write and block copy (interpreted on CPU tensors) against the PyTorch copies: exact."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")
from pagedmoe.layers.attention.triton_cache_ops import copy_blocks, write_kv  # noqa: E402
from pagedmoe.worker.kv_cache import _copy_blocks  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(heads=st.integers(1, 4), row=st.sampled_from([3, 8, 24]), block_size=st.sampled_from([1, 4]),
       num_tokens=st.integers(1, 9), seed=st.integers(0, 1000))
def test_write_kv_matches_index_copy_and_skips_padding_slots(heads, row, block_size, num_tokens, seed):
    torch.manual_seed(seed)
    cache = torch.randn(heads, 10, block_size, row)  # at least one slot per token
    slots = torch.randperm(10 * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.3] = -1  # a CUDA graph's padding rows: never written
    rows = torch.randn(num_tokens, heads, row)
    expected = cache.clone()
    real = slots >= 0
    expected.view(heads, -1, row).index_copy_(1, slots[real], rows[real].transpose(0, 1))
    write_kv(cache, rows, slots)
    assert torch.equal(cache, expected)


@settings(max_examples=10, deadline=None)
@given(num_layers=st.integers(1, 2), num_kv_tensors=st.integers(1, 2), block_elems=st.sampled_from([4, 1100]),
       num_pairs=st.integers(0, 3), seed=st.integers(0, 1000))
def test_copy_blocks_matches_tensor_copy(num_layers, num_kv_tensors, block_elems, num_pairs, seed):
    """Copy-on-write pairs: distinct sources onto distinct fresh blocks (1100 elements: more than one chunk)."""
    torch.manual_seed(seed)
    cache = torch.randn(num_layers, num_kv_tensors, 8, block_elems)
    blocks = torch.randperm(8).tolist()
    pairs = list(zip(blocks[:num_pairs], blocks[num_pairs:2 * num_pairs]))
    expected = cache.clone()
    _copy_blocks(expected, expected, pairs)
    copy_blocks(cache, pairs)
    assert torch.equal(cache, expected)
