"""The Triton paged attention kernel (run by Triton's interpreter on CPU tensors) against the PyTorch path:
decodes and chunked prefills over paged KV, GQA groups (also ones not a power of 2), head dims that are not,
block sizes, split-K over the context, sliding windows and sinks, and MLA's latent cache.

Tolerance: float32, 1e-5. The kernel's online softmax rescales and sums tile by tile, in another order than
the PyTorch path's softmax and matmuls, so results differ by float32 rounding (observed <= 1e-6 here); the
KV writes are copies and must be exact."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedmoe.layers.attention.metadata import Workspace, build_attention_metadata
from pagedmoe.layers.attention.mla import MLAPagedAttention
from pagedmoe.layers.attention.torch_backend import TorchPagedAttention

pytest.importorskip("triton")
from pagedmoe.layers.attention.triton_backend import build_triton_attention  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
CPU = torch.device("cpu")


@st.composite
def batches(draw):
    """(query_lens, seq_lens, block_tables, block_size, num_blocks): 1-3 sequences, each a decode or a query
    chunk ending its context, tables over distinct shuffled blocks."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    query_lens = [draw(st.sampled_from([1, 1, n, max(1, n // 2), min(n, 3)])) for n in seq_lens]
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = blocks_per_seq * len(seq_lens) + 1
    seed = draw(st.integers(0, 2 ** 16))
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:-1]
    return (torch.tensor(query_lens), torch.tensor(seq_lens), tables.view(len(seq_lens), blocks_per_seq),
            block_size, num_blocks)


def slots_of(query_lens, seq_lens, tables, block_size):
    seq_index = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens)
    query_starts = torch.cumsum(query_lens, 0) - query_lens
    positions = torch.arange(int(query_lens.sum())) - query_starts[seq_index] + (seq_lens - query_lens)[seq_index]
    return tables[seq_index, positions // block_size] * block_size + positions % block_size


def torch_and_triton_steps(batch, kv_caches, num_splits):
    query_lens, seq_lens, tables, block_size, _ = batch
    slots = slots_of(query_lens, seq_lens, tables, block_size)
    meta = build_attention_metadata(query_lens, seq_lens, tables, slots, kv_caches, block_size,
                                    Workspace(torch.float32, CPU))
    step = build_triton_attention(query_lens, seq_lens, tables, block_size, CPU, num_splits=num_splits)
    step.slot_mapping = slots
    return meta, step


@settings(max_examples=25, deadline=None)
@given(batch=batches(), head_dim=st.sampled_from([8, 24, 32]), num_kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3, 4]), num_splits=st.sampled_from([1, 2, 4]),
       window=st.sampled_from([0, 0, 3, 9]), with_sinks=st.booleans(), seed=st.integers(0, 1000))
def test_paged_attention_matches_pytorch(batch, head_dim, num_kv_heads, group, num_splits, window, with_sinks,
                                         seed):
    torch.manual_seed(seed)
    num_heads, num_tokens, num_blocks = num_kv_heads * group, int(batch[0].sum()), batch[4]
    kv_caches = torch.randn(1, 2 * num_kv_heads, num_blocks, batch[3], head_dim)
    q, k, v = (torch.randn(num_tokens, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    sinks = torch.randn(num_heads) if with_sinks else None
    triton_caches = kv_caches.clone()
    meta, step = torch_and_triton_steps(batch, kv_caches, num_splits)
    expected = TorchPagedAttention(0, num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window)(q, k, v, meta,
                                                                                                     sinks)
    got = step.attend(q, k, v, triton_caches[0], head_dim ** -0.5, window, sinks)
    assert torch.equal(triton_caches, kv_caches)
    torch.testing.assert_close(got, expected, **TOL)


@settings(max_examples=10, deadline=None)
@given(batch=batches(), num_heads=st.sampled_from([1, 3, 4]), latent=st.sampled_from([16, 24]),
       rope=st.sampled_from([4, 8]), num_splits=st.sampled_from([1, 4]), seed=st.integers(0, 1000))
def test_mla_latent_attention_matches_pytorch(batch, num_heads, latent, rope, num_splits, seed):
    torch.manual_seed(seed)
    num_tokens, num_blocks = int(batch[0].sum()), batch[4]
    kv_caches = torch.randn(1, 1, num_blocks, batch[3], latent + rope)
    q_latent, q_pe = torch.randn(num_tokens, num_heads, latent), torch.randn(num_tokens, num_heads, rope)
    new_latent, k_pe = torch.randn(num_tokens, latent), torch.randn(num_tokens, rope)
    triton_caches = kv_caches.clone()
    meta, step = torch_and_triton_steps(batch, kv_caches, num_splits)
    expected = MLAPagedAttention(0, num_heads, latent, rope, 0.2)(q_latent, q_pe, new_latent, k_pe, meta)
    got = step.attend_latent(torch.cat((q_latent, q_pe), -1), torch.cat((new_latent, k_pe), -1), triton_caches[0],
                             latent, 0.2)
    assert torch.equal(triton_caches, kv_caches)
    torch.testing.assert_close(got, expected, **TOL)


def test_splits_cover_long_decodes_and_reduce_exactly_once():
    """A decode over 64 positions in 16-key tiles, split 4 ways (one tile each) and 8 ways (four splits
    with no keys, whose empty partials the reduce must ignore): both equal the unsplit result."""
    torch.manual_seed(0)
    batch = (torch.tensor([1]), torch.tensor([64]), torch.arange(16).view(1, 16), 4, 16)
    kv_caches = torch.randn(1, 2, 16, 4, 16)
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    outs = []
    for splits in (1, 4, 8):
        step = torch_and_triton_steps(batch, kv_caches, splits)[1]
        outs.append(step.attend(q, k, v, kv_caches.clone()[0], 0.25))
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    torch.testing.assert_close(outs[2], outs[0], **TOL)
