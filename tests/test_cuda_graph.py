"""CUDA-graph bookkeeping, on the CPU: the captured sizes, the padding of a decode step up to one, and the
static buffers a replay reads (a padded step attends exactly like the eager step, and its padding rows
never touch real KV). Capture and replay themselves run on the device (scripts/gpu_bench.sh)."""
from types import SimpleNamespace

import pytest
import torch

from pagedmoe.layers.attention.metadata import AttentionMetadata, Workspace
from pagedmoe.worker.cuda_graph import DecodeBuffers, capture_sizes, make_decode_graphs, padded_size

CPU = torch.device("cpu")


def test_capture_sizes_follow_vllm_list():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(10_000)[-1] == 512


def test_a_step_pads_to_the_next_captured_size():
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 32)] == [1, 4, 8, 8, 16, 32]
    assert padded_size(33, sizes) is None  # above the largest: eager


def test_graphs_never_apply_on_cpu_or_eager():
    config = SimpleNamespace(device="cpu", enforce_eager=False, world_size=1)
    assert make_decode_graphs(config, None, None, None, True, False) is None
    config = SimpleNamespace(device="cuda", enforce_eager=True, world_size=1)
    assert make_decode_graphs(config, None, None, None, True, False) is None


def test_padded_static_step_attends_as_the_eager_step_and_leaves_kv_alone():
    pytest.importorskip("triton")
    from pagedmoe.layers.attention.triton_backend import build_triton_attention
    torch.manual_seed(0)
    block_size, num_blocks, heads, head_dim = 4, 12, 2, 16
    seq_lens, tables = torch.tensor([5, 9, 2]), torch.tensor([[3, 7, 0], [1, 4, 9], [11, 0, 0]])
    positions = seq_lens - 1
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    step = build_triton_attention(torch.ones(3, dtype=torch.long), seq_lens, tables, block_size, CPU, num_splits=2)
    meta = AttentionMetadata(slots, None, [], block_size, Workspace(torch.float32, CPU), triton=step)
    step.slot_mapping = slots
    buffers = DecodeBuffers(8, 6, CPU)
    buffers.fill(torch.tensor([5, 6, 7]), positions, meta, size=4)
    assert buffers.slot_mapping[:4].tolist() == slots.tolist() + [-1]
    assert buffers.seq_lens[:4].tolist() == [5, 9, 2, 0] and buffers.positions[3] == 0
    assert buffers.block_tables[:3, :3].tolist() == tables.tolist() and not buffers.block_tables[:, 3:].any()
    static = buffers.metadata(4, None, block_size, meta.workspace, num_splits=2).triton
    cache = torch.randn(2 * heads, num_blocks, block_size, head_dim)
    q, k, v = torch.randn(4, heads, head_dim), torch.randn(4, heads, head_dim), torch.randn(4, heads, head_dim)
    eager_cache, static_cache = cache.clone(), cache.clone()
    eager = step.attend(q[:3], k[:3], v[:3], eager_cache, 0.25)
    padded = static.attend(q, k, v, static_cache, 0.25)
    assert torch.equal(static_cache, eager_cache)  # the padding row wrote nothing
    torch.testing.assert_close(padded[:3], eager, rtol=0, atol=0)  # same kernel, same splits: bit-identical
    assert not padded[3].any()  # the padding row attended nothing


def test_a_smaller_step_after_a_larger_one_resets_the_padding():
    buffers = DecodeBuffers(8, 4, CPU)
    big = AttentionMetadata(torch.arange(6), None, [], 4, None)
    big.triton = SimpleNamespace(block_tables=torch.ones(6, 2, dtype=torch.int32),
                                 seq_lens=torch.full((6,), 7, dtype=torch.int32))
    buffers.fill(torch.arange(6), torch.arange(6), big, size=8)
    small = AttentionMetadata(torch.tensor([3]), None, [], 4, None)
    small.triton = SimpleNamespace(block_tables=torch.tensor([[2]], dtype=torch.int32),
                                   seq_lens=torch.tensor([1], dtype=torch.int32))
    buffers.fill(torch.tensor([9]), torch.tensor([0]), small, size=2)
    assert buffers.slot_mapping[:2].tolist() == [3, -1] and buffers.seq_lens[:2].tolist() == [1, 0]
    assert buffers.block_tables[0].tolist() == [2, 0, 0, 0]
