"""Lark grammars rewritten as xgrammar's EBNF: the pieces translate as stated, the result compiles, and
generation under a Lark grammar (the JSON grammar from vLLM's docs among them) gives text the same grammar
accepts."""
import json
import re

import pytest

from conftest import assert_all_blocks_free
from pagedmoe import DEFAULT_MODEL, LLM, SamplingParams
from pagedmoe.sampling_params import StructuredOutputsParams
from pagedmoe.structured_output.lark import is_lark, lark_to_ebnf, regex_to_ebnf

GREETING = r'''
?start: greeting (", " greeting)~0..2   // comments either way
greeting: ("hail"i | "hello") " " NAME -> hi   # aliases dropped
NAME: /[A-Z][a-z]{1,6}/ | "x".."z"
'''
JSON_LARK = r'''
?value: dict
      | list
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null
list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : string ":" value
string : ESCAPED_STRING
start: dict
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
'''


def test_pieces_translate():
    assert is_lark(GREETING) and not is_lark('root ::= "a"\nx ::= "b"')
    ebnf = lark_to_ebnf(GREETING)
    assert ebnf.splitlines()[0] == 'root ::= greeting ( ", " greeting ) {0,2}'
    assert '([hH] [aA] [iI] [lL])' in ebnf and "[x-z]" in ebnf and "->" not in ebnf
    assert regex_to_ebnf(r"/a\.b(?:c|d)\d+$/") == '("a" "." "b" ( "c" | "d" ) [0-9] +)'


@pytest.mark.parametrize("bad, reason", [("start: x{\"a\"}\n", "unexpected"), ("_sep{x}: x\nstart: \"a\"", "cannot read"), ("start: A\n%ignore WS\n", "%ignore"),
                                         ("rule: \"a\"\n", "start rule"), ("start: /a/i\n", "flags")])
def test_unsupported_lark_is_refused(bad, reason):
    with pytest.raises(ValueError, match=reason):
        lark_to_ebnf(bad)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, dtype="float32")


def generate(llm, grammar: str, n: int) -> list[str]:
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = llm.generate("KING:", params, use_tqdm=False)[0]
    assert_all_blocks_free(llm.engine)
    return [o.text for o in out.outputs if o.finish_reason == "stop"]


def test_generation_under_lark_grammars(llm):
    greeting = r"(?:[Hh][Aa][Ii][Ll]|hello) (?:[A-Z][a-z]{1,6}|[x-z])"
    texts = generate(llm, GREETING, 6)
    assert len(texts) == 6 and all(re.fullmatch(f"{greeting}(?:, {greeting}){{0,2}}", t) for t in texts)
    texts = generate(llm, JSON_LARK, 6)
    assert texts and all(isinstance(json.loads(t), dict) for t in texts)


def test_bad_lark_names_the_field(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar: .*%ignore"):
        generate(llm, "start: WORD\n%ignore WS\n%import common.WORD", 1)
