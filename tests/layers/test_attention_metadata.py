import torch

from pagedmoe.layers.attention import metadata
from pagedmoe.layers.attention.metadata import MAX_SHORT_QUERY, Workspace, build_attention_metadata, rows_as_decodes

BLOCK = 4


def decode_metadata(seq_lens: list[int], num_cache_blocks: int = 64):
    kv_caches = torch.zeros(2, 6, num_cache_blocks, BLOCK, 8)  # 2 layers, 3 KV heads x (K, V)
    tables = [list(range(10 * i, 10 * i + -(-n // BLOCK))) for i, n in enumerate(seq_lens)]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_lens = torch.ones(len(seq_lens), dtype=torch.long)
    return build_attention_metadata(query_lens, torch.tensor(seq_lens), block_tables, torch.zeros(len(seq_lens)),
                                    kv_caches, BLOCK, Workspace(torch.float32, torch.device("cpu"))), tables


def test_decode_chunks_cover_every_sequence_longest_first(monkeypatch):
    block_bytes = 6 * BLOCK * 8 * 4
    monkeypatch.setattr(metadata, "CHUNK_BYTES", 12 * block_bytes)  # 12 blocks of context per chunk
    seq_lens = [5, 30, 17, 9, 30]
    meta, tables = decode_metadata(seq_lens)
    (group,) = meta.groups
    chunks = group.decode_chunks
    rows = [r for c in chunks for r in c.token_index.tolist()]
    assert sorted(rows) == list(range(len(seq_lens)))
    assert [seq_lens[r] for r in rows] == sorted(seq_lens, reverse=True)
    for chunk in chunks:
        seqs = chunk.token_index.tolist()
        num_blocks = -(-max(seq_lens[s] for s in seqs) // BLOCK)
        assert chunk.padding.shape == (1, len(seqs), 1, num_blocks * BLOCK)
        assert len(seqs) * num_blocks <= 12 or len(seqs) == 1
        index = chunk.context_index.view(6, len(seqs), num_blocks)
        for j, s in enumerate(seqs):
            real = len(tables[s])
            assert index[0, j, :real].tolist() == tables[s]
            assert index[5, j, :real].tolist() == [5 * 64 + b for b in tables[s]]
            assert chunk.padding[0, j, 0].tolist() == [p >= seq_lens[s] for p in range(num_blocks * BLOCK)]


def test_prefill_groups_have_no_decode_chunks():
    kv_caches = torch.zeros(1, 2, 8, BLOCK, 4)
    num_new = MAX_SHORT_QUERY + 1
    tables = torch.tensor([list(range(-(-num_new // BLOCK))), [1, 2, 0][:-(-num_new // BLOCK)]])
    meta = build_attention_metadata(torch.tensor([num_new, 1]), torch.tensor([num_new, 6]), tables,
                                    torch.zeros(num_new + 1), kv_caches, BLOCK,
                                    Workspace(torch.float32, torch.device("cpu")))
    decode, prefill = meta.groups
    assert decode.is_decode and len(decode.decode_chunks) == 1
    assert not prefill.is_decode and prefill.decode_chunks == []
    assert prefill.query_starts == [0] and prefill.query_lens == [num_new] and prefill.seq_lens == [num_new]


def test_short_queries_attend_as_one_decode_per_row():
    """A 3-row query (a speculating sequence's last token and two drafts) ending at position 9: rows with
    contexts of 8, 9 and 10 positions over its block table; the decode and the long query keep theirs."""
    query_lens, seq_lens = torch.tensor([1, 3, 12]), torch.tensor([5, 10, 12])
    tables = torch.tensor([[7], [8], [9]])
    query_lens, seq_lens, tables = rows_as_decodes(query_lens, seq_lens, tables)
    assert query_lens.tolist() == [1, 1, 1, 1, 12] and seq_lens.tolist() == [5, 8, 9, 10, 12]
    assert tables[:, 0].tolist() == [7, 8, 8, 8, 9]


def test_gather_rows_for_every_width_and_dtype():
    from pagedmoe.layers.attention.torch_backend import gather_rows
    index = torch.tensor([3, 0, 3, 2])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for width in (6, 7):
            rows = torch.randn(5, width).to(dtype)
            out = gather_rows(rows, index, torch.empty(4, width, dtype=dtype))
            assert torch.equal(out, rows[index])
