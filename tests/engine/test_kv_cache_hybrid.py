"""Hybrid KV (engine/kv_cache_hybrid.py): sliding-window layers keep a block table of their own whose blocks
wholly outside the window are freed. The accounting under random operations (prefix hits, forks, swaps), the
bound on the blocks a window holds, prefix hits that bring the window's blocks, and gpt-oss end to end: a
long sequence holds at most window / block_size + 1 window blocks while matching HF token for token."""
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model
from pagedmoe import LLM, SamplingParams
from pagedmoe.engine.kv_cache_hybrid import NULL_BLOCK, HybridKVCacheManager
from pagedmoe.engine.sequence import Request, Sequence

BLOCK_SIZE, WINDOW = 4, 6
OPS = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap", "prefix"]), st.integers(0, 50),
                         st.integers(1, 9)), max_size=80)


def _manager(num_blocks: int = 24, window: int = WINDOW, **kwargs) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, 12, BLOCK_SIZE, sliding_window=window, max_step_tokens=9, **kwargs)


def _seq(seq_id: int, token_ids: list[int]) -> Sequence:
    request = Request(str(seq_id), None, list(token_ids), SamplingParams())
    request.seqs = []
    return Sequence(seq_id, request, list(token_ids))


def _append(kv: HybridKVCacheManager, seq: Sequence, num_new: int):
    if seq.host_block_table and not kv.can_swap_in(seq, num_new):
        return
    swapped = bool(seq.host_block_table)
    if swapped:
        kv.swap_in(seq)
    seq.token_ids += [seq.seq_id % 3] * (seq.num_computed_tokens + num_new - len(seq.token_ids))
    if kv.allocate_slots(seq, num_new):
        seq.num_computed_tokens += num_new
    else:
        assert not swapped  # can_swap_in promised room for the step too


def check_invariants(kv: HybridKVCacheManager, seqs: list[Sequence]):
    for pool, attrs in ((kv.pool, ("block_table", "window_table")),
                        (kv.host_pool, ("host_block_table", "host_window_table"))):
        refs = [0] * pool.num_blocks
        for seq in seqs:
            for block_id in (b for attr in attrs for b in getattr(seq, attr) if b != NULL_BLOCK):
                refs[block_id] += 1
        assert refs == pool.ref_counts
        assert set(pool.free_blocks) == {b for b, r in enumerate(pool.ref_counts) if r == 0}
    for seq in seqs:
        table = seq.window_table or seq.host_window_table
        assert len(table) == len(seq.block_table or seq.host_block_table)
        assert all(b == NULL_BLOCK for b in table[:seq.num_window_freed])
        assert all(b != NULL_BLOCK for b in table[seq.num_window_freed:])
        assert seq.num_window_freed <= kv.num_dead_blocks(seq.num_computed_tokens)


def _apply(kv, seqs, op, pick, num):
    seq = seqs[pick % len(seqs)] if seqs else None
    if op == "new" or seq is None:
        seqs.append(_seq(len(seqs) + 100, []))
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
        twin = _seq(len(seqs) + 100, seq.token_ids)
        cached = kv.find_cached_prefix(twin)
        if kv.allocate_slots(twin, len(twin.token_ids) - len(cached) * BLOCK_SIZE, cached):
            twin.num_computed_tokens = len(twin.token_ids)
        seqs.append(twin)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_hybrid_block_accounting_invariants(ops):
    kv, seqs = _manager(), []
    for op, pick, num in ops:
        _apply(kv, seqs, op, pick, num)
        kv.take_transfers()
        check_invariants(kv, seqs)
    for seq in seqs:
        kv.free(seq)
    assert kv.pool.num_free_blocks == 24 and kv.host_pool.num_free_blocks == 12
    assert not any(kv.pool.ref_counts) and not any(kv.host_pool.ref_counts)


def test_a_decoding_window_holds_window_over_block_size_plus_one_blocks():
    kv = _manager(window=8)
    seq = _seq(1, [1, 2, 3])
    assert kv.allocate_slots(seq, 3)
    seq.num_computed_tokens = 3
    for step in range(60):
        seq.token_ids.append(step % 5)
        assert kv.allocate_slots(seq, 1)
        live = [b for b in seq.window_table if b != NULL_BLOCK]
        assert len(live) <= 8 // BLOCK_SIZE + 1
        assert len(seq.block_table) == len(seq.window_table) == seq.num_computed_tokens // BLOCK_SIZE + 1
        seq.num_computed_tokens += 1
        assert kv.pool.num_used_blocks == len(seq.block_table) + len(live)
    assert seq.num_window_freed == kv.num_dead_blocks(seq.num_computed_tokens - 1) > 10
    kv.free(seq)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_prefix_hit_brings_the_window_blocks_its_next_query_reads():
    kv = _manager(num_blocks=40, window=8)
    tokens = list(range(33))
    first = _seq(1, tokens)
    assert kv.allocate_slots(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    kv.free(first)
    twin = _seq(2, tokens)
    hits = kv.find_cached_prefix(twin)
    assert len(hits) == 8  # the last token is computed again
    assert kv.allocate_slots(twin, 1, hits)
    dead = kv.num_dead_blocks(32)
    assert twin.num_window_freed == dead == 6 and twin.window_table[:dead] == [NULL_BLOCK] * dead
    assert twin.window_table[dead:8] == first_window_blocks(kv, tokens, dead, 8)
    kv.free(twin)
    kv.pool.uncache(kv.pool.cached[twin.block_hashes[7] + b"/window"])  # the window block the query reads
    assert len(kv.find_cached_prefix(_seq(3, tokens))) < 8


def first_window_blocks(kv, tokens, start, end) -> list[int]:
    probe = _seq(9, tokens)
    kv.find_cached_prefix(probe)
    return [kv.pool.cached[probe.block_hashes[i] + b"/window"] for i in range(start, end)]


# gpt-oss end to end: a 32-token window over 16-token blocks, sequences several windows long.

LONG_WINDOW, NUM_NEW = 32, 48


@pytest.fixture(scope="module")
def long_window_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_window32")
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, intermediate_size=48, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=LONG_WINDOW,
                                       max_position_embeddings=512, eos_token_id=None, bos_token_id=0, pad_token_id=0)
    model = save_random_model(config, path, seed=3)
    prompts = make_prompts(3, seed=11, min_len=80, max_len=120)
    return str(path), prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


def _generate_watching_windows(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the most live window blocks a sequence held during a one-token (decode) step."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    tokens, most = {}, 0
    while engine.has_unfinished_requests():
        decoding = [s for s in engine.scheduler.running if len(s) - s.num_computed_tokens == 1]
        tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        most = max([most] + [sum(b != NULL_BLOCK for b in s.window_table) for s in decoding if s.window_table])
    return [tokens[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize("scenario", [dict(), dict(max_num_batched_tokens=40), dict(cpu_attention_kernel=False),
                                      dict(num_kv_blocks=24, preemption_mode="swap", max_num_batched_tokens=40),
                                      dict(num_kv_blocks=24, preemption_mode="recompute", max_num_batched_tokens=40)])
def test_gpt_oss_long_sequences_free_window_blocks_and_match_hf(long_window_model, scenario):
    path, prompts, expected = long_window_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **scenario)
    assert isinstance(llm.engine.kv, HybridKVCacheManager)
    tokens, most = _generate_watching_windows(llm, prompts)
    assert tokens == expected
    assert 0 < most <= LONG_WINDOW // 16 + 1
    stats = llm.engine.get_stats()
    assert (stats.num_preemptions_swap + stats.num_preemptions_recompute > 0) == ("num_kv_blocks" in scenario)
    assert_all_blocks_free(llm.engine)


def test_gpt_oss_repeated_long_prompt_hits_the_prefix_cache(long_window_model):
    path, prompts, expected = long_window_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[0]
    assert out.num_cached_tokens >= (len(prompts[0]) - 1) // 16 * 16 > 0
    assert_all_blocks_free(llm.engine)


def test_disabling_the_hybrid_manager_keeps_every_block(long_window_model):
    path, prompts, expected = long_window_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(llm.engine.kv, HybridKVCacheManager)
    assert llm.engine.runner.kv_cache.device_cache.shape[0] == 4
    hybrid = LLM(path, dtype="float32", skip_tokenizer_init=True).engine.runner.kv_cache.device_cache
    assert hybrid.shape[0] == 2  # a full layer and a sliding one share each slot
    assert _generate_watching_windows(llm, prompts)[0] == expected
