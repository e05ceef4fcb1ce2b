"""logit_bias, allowed_token_ids, bad_words and logits_processors through the engine (float32, bundled model),
the grammar bitmask's unpacking against xgrammar's own, and a grammar's rows over draft tokens."""
import pytest
import torch
import xgrammar

from conftest import assert_all_blocks_free
from pagedmoe import DEFAULT_MODEL, LLM, SamplingParams
from pagedmoe.layers.sampler import unpack_bitmask
from pagedmoe.structured_output.compiler import GrammarCompiler
from pagedmoe.structured_output.grammar import Grammar
from pagedmoe.structured_output.params import StructuredOutputsParams
from pagedmoe.worker.logits_constraints import banned_bad_words

PROMPT = "KING:"


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, dtype="float32")


def greedy(llm, **params):
    out = llm.generate(PROMPT, SamplingParams(**{"temperature": 0, "max_tokens": 12, **params}), use_tqdm=False)[0]
    assert_all_blocks_free(llm.engine)
    return out.outputs[0]


def test_logit_bias_moves_greedy_and_is_clamped(llm):
    plain = greedy(llm)
    target = 66
    assert target not in plain.token_ids
    assert set(greedy(llm, logit_bias={target: 100}).token_ids) == {target}
    assert greedy(llm, logit_bias={str(target): 1e9}).token_ids == greedy(llm, logit_bias={target: 100}).token_ids
    assert greedy(llm, logit_bias={plain.token_ids[0]: -100}).token_ids[0] != plain.token_ids[0]


def test_allowed_token_ids(llm):
    out = greedy(llm, allowed_token_ids=[66, 67, 68])
    assert set(out.token_ids) <= {66, 67, 68} and len(out.token_ids) == 12


def test_bad_words_never_appear(llm):
    plain = greedy(llm, max_tokens=24)
    word = plain.text.split()[1]
    out = greedy(llm, max_tokens=24, bad_words=[word])
    assert word not in out.text.split() and out.text != plain.text


def test_bad_words_ban_the_last_token_after_the_prefix():
    assert banned_bad_words([[5], [7, 8, 9]], [1, 7, 8]) == [5, 9]
    assert banned_bad_words([[7, 8, 9]], [1, 7]) == []


def test_logits_processor_sees_the_output_so_far(llm):
    seen = []

    def only_a_after_three(output_ids, logits):
        seen.append(list(output_ids))
        if len(output_ids) >= 3:
            logits = torch.full_like(logits, float("-inf"))
            logits[66] = 0.0
        return logits

    plain = greedy(llm)
    out = greedy(llm, logits_processors=[only_a_after_three])
    assert out.token_ids[:3] == plain.token_ids[:3] and set(out.token_ids[3:]) == {66}
    assert seen[:4] == [[]] + [plain.token_ids[:i] for i in range(1, 4)]


def test_request_excluding_every_token_fails_alone(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={66: float("-inf")})
    ok = SamplingParams(temperature=0, max_tokens=4)
    bad = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[66],
                         structured_outputs=StructuredOutputsParams(choice=["b"]))
    outs = llm.generate([PROMPT, PROMPT], [bad, ok], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "no token may be sampled" in outs[0].error
    assert outs[1].outputs[0].token_ids == greedy(llm, max_tokens=4).token_ids
    assert_all_blocks_free(llm.engine)


def test_token_ids_checked_against_the_vocab(llm):
    for params in ({"logit_bias": {4096: 1.0}}, {"allowed_token_ids": [4096]}):
        with pytest.raises(ValueError, match=next(iter(params))):
            greedy(llm, **params)


def test_unpack_bitmask_matches_xgrammar():
    torch.manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32)
    logits = torch.randn(5, 100)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=100)
    got = logits.masked_fill(~unpack_bitmask(bitmask, 100), float("-inf"))
    assert torch.equal(got, expected)


def test_grammar_rows_walk_the_drafts_and_roll_back(llm):
    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(tokenizer, 2048)
    grammar = Grammar(compiler.xgr, compiler.compile(StructuredOutputsParams(choice=["abc", "abd"])), [0])
    a, b, c, x = (tokenizer.convert_tokens_to_ids(t) for t in "abcx")
    bitmask = torch.full((4, 64), -1, dtype=torch.int32)
    grammar.fill_rows(bitmask, 0, [a, x, c])  # x is refused: rows after it are never kept
    allowed = unpack_bitmask(bitmask, 2048)
    assert allowed[0][a] and not allowed[0][x] and not allowed[0][b]
    assert allowed[1][b] and not allowed[1][a] and not allowed[1][c]  # after "a"
    assert torch.equal(allowed[2], allowed[1]) and torch.equal(allowed[3], allowed[1])
    assert grammar.accept(a) and not grammar.accept(x)  # rolled back: at the start again
