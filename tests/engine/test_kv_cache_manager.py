from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmoe.engine.block_pool import BlockPool
from pagedmoe.engine.kv_cache_manager import KVCacheManager
from pagedmoe.engine.sequence import Request, Sequence
from pagedmoe.sampling_params import SamplingParams

BLOCK_SIZE = 4
OPS = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap", "prefix"]), st.integers(0, 50),
                         st.integers(1, 9)), max_size=80)


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    request = Request(str(seq_id), None, list(range(num_tokens)), SamplingParams())
    request.seqs = []
    return Sequence(seq_id, request, list(range(num_tokens)))


def check_invariants(kv: KVCacheManager, seqs: list[Sequence]):
    for pool, attr in ((kv.pool, "block_table"), (kv.host_pool, "host_block_table")):
        refs = [0] * pool.num_blocks
        for seq in seqs:
            for block_id in getattr(seq, attr):
                refs[block_id] += 1
        assert refs == pool.ref_counts
        assert all(r >= 0 for r in pool.ref_counts)
        assert all(pool.block_hashes[b] == h for h, b in pool.cached.items())
        assert set(pool.free_blocks) == {b for b, r in enumerate(pool.ref_counts) if r == 0}
    for seq in seqs:
        assert len(seq.block_table) in (0, -(-seq.num_computed_tokens // BLOCK_SIZE))


def _append(kv, seq, num_new):
    if seq.host_block_table and kv.can_swap_in(seq, num_new):
        kv.swap_in(seq)
    if seq.host_block_table:
        return
    seq.token_ids += [seq.seq_id % 3] * (seq.num_computed_tokens + num_new - len(seq.token_ids))
    if kv.allocate_slots(seq, num_new):
        seq.num_computed_tokens += num_new


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_block_accounting_invariants(ops):
    kv = KVCacheManager(num_blocks=12, num_host_blocks=6, block_size=BLOCK_SIZE, offload=True, num_disk_blocks=4)
    seqs = []
    for op, pick, num in ops:
        seq = seqs[pick % len(seqs)] if seqs else None
        if op == "new" or seq is None:
            seqs.append(_seq(len(seqs) + 100, 0))
            _append(kv, seqs[-1], num)
        elif op == "append":
            _append(kv, seq, num)
        elif op == "fork" and not seq.host_block_table:
            child = seq.fork(len(seqs) + 100, 1)
            kv.fork(seq, child)
            seqs.append(child)
        elif op == "free":
            kv.free(seq)
            seqs.remove(seq)
        elif op == "swap" and seq.block_table and kv.can_swap_out(seq):
            kv.swap_out(seq)
        elif op == "prefix" and len(seq.token_ids) > 1:
            twin = _seq(len(seqs) + 100, 0)
            twin.token_ids = list(seq.token_ids)
            cached = kv.find_cached_prefix(twin)
            num_new = len(twin.token_ids) - len(cached) * BLOCK_SIZE
            if kv.allocate_slots(twin, num_new, cached):
                twin.num_computed_tokens = len(twin.token_ids)
            seqs.append(twin)
        kv.take_transfers()
        check_invariants(kv, seqs)
        assert len(kv.disk.hashes) <= 4
    for seq in seqs:
        kv.free(seq)
    assert kv.pool.num_free_blocks == 12 and kv.host_pool.num_free_blocks == 6
    assert not any(kv.pool.ref_counts) and not any(kv.host_pool.ref_counts)


def test_copy_on_write_only_for_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, num_host_blocks=1, block_size=4)
    parent = _seq(1, 6)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(2, 1)
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)
    assert kv.take_transfers().copy == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    assert kv.allocate_slots(parent, 1) and not kv.take_transfers().copy


def test_pool_lru_order():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.free(b)
    pool.free(a)
    assert pool.allocate() == b and pool.allocate() == a


def test_static_mode_reserves_contiguous_run_at_admission():
    kv = KVCacheManager(num_blocks=10, num_host_blocks=1, block_size=4, enable_caching=False,
                        static_reserve=lambda seq: len(seq.token_ids) + 9)
    a, b = _seq(1, 3), _seq(2, 3)
    assert kv.allocate_slots(a, 3) and a.block_table == [0, 1, 2]
    a.num_computed_tokens = 3
    for _ in range(9):
        a.token_ids.append(1)
        assert kv.allocate_slots(a, 1) and a.block_table == [0, 1, 2]
        a.num_computed_tokens += 1
    assert kv.allocate_slots(b, 3) and b.block_table == [3, 4, 5]
    kv.free(a)
    c, d = _seq(3, 15), _seq(4, 7)
    assert kv.pool.num_free_blocks == 7 and not kv.allocate_slots(c, 15)  # external fragmentation
    assert kv.allocate_slots(d, 7) and d.block_table == [6, 7, 8, 9]
