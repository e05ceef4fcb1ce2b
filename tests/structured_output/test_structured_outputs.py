"""Structured outputs offline (SamplingParams.structured_outputs, xgrammar): every sampled output of each kind
parses and matches its grammar, with n > 1, in a batch mixed with unconstrained requests (whose greedy tokens
stay exactly what they are alone), under speculative decoding (drafts the grammar refuses are rejected, and
greedy output is the same with and without speculation), and bad grammars are refused naming the field."""
import json
import re

import jsonschema_rs
import pytest

from conftest import assert_all_blocks_free
from pagedmoe import DEFAULT_MODEL, LLM, SamplingParams
from pagedmoe.sampling_params import GuidedDecodingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 18, "maximum": 90},
                         "role": {"enum": ["king", "queen", "fool"]},
                         "lines": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
                         "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                   "walls": {"type": "number", "minimum": 0,
                                                                             "maximum": 10}},
                                  "required": ["city", "walls"]}},
          "required": ["name", "age", "role", "home"]}
REGEX = r"(Lord|Lady) [A-Z][a-z]{2,8}, aged [1-9][0-9]"
CHOICES = ["yea", "nay", "perchance", "the quality of mercy"]
EBNF = 'root ::= line | line "; " line\nline ::= ("to be" | "not to be") " or " ("ROMEO" | "JULIET")'


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, dtype="float32", seed=0)


def sample(llm, kind: dict, n: int = 8, temperature: float = 1.0, **params) -> list[str]:
    p = SamplingParams(n=n, temperature=temperature, max_tokens=160, seed=1,
                       structured_outputs=StructuredOutputsParams(**kind), **params)
    out = llm.generate("KING LEAR:\n", p, use_tqdm=False)[0]
    assert_all_blocks_free(llm.engine)
    assert all(o.finish_reason == "stop" for o in out.outputs), [o.text for o in out.outputs]
    return [o.text for o in out.outputs]


def test_json_schema_every_sample_validates(llm):
    validator = jsonschema_rs.validator_for(SCHEMA)
    texts = sample(llm, {"json": SCHEMA}, n=12)
    for text in texts:
        validator.validate(json.loads(text))
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_json_schema_as_text_and_guided_decoding_name(llm):
    params = SamplingParams(temperature=0, max_tokens=160, guided_decoding=GuidedDecodingParams(json=json.dumps(SCHEMA)))
    text = llm.generate("KING LEAR:\n", params, use_tqdm=False)[0].outputs[0].text
    jsonschema_rs.validator_for(SCHEMA).validate(json.loads(text))


def test_regex_choice_grammar_json_object(llm):
    assert all(re.fullmatch(REGEX, t) for t in sample(llm, {"regex": REGEX}))
    choices = sample(llm, {"choice": CHOICES}, n=12)
    assert set(choices) <= set(CHOICES) and len(set(choices)) > 1
    line = r'(to be|not to be) or (ROMEO|JULIET)'
    assert all(re.fullmatch(f"{line}(; {line})?", t) for t in sample(llm, {"grammar": EBNF}))
    assert isinstance(json.loads(sample(llm, {"json_object": True}, n=1, temperature=0)[0]), dict)


def test_mixed_batch_keeps_unconstrained_greedy_tokens(llm):
    prompts = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n"]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=160,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts + ["KING LEAR:\n"] * 2, [plain] * 3 + [constrained] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        for o in out.outputs:
            jsonschema_rs.validator_for(SCHEMA).validate(json.loads(o.text))
    assert_all_blocks_free(llm.engine)


def test_greedy_is_the_argmax_of_the_allowed_tokens(llm):
    """Greedy under a grammar: each token is the most likely of the tokens the grammar allowed there."""
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = llm.generate("KING LEAR:\n", params, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES
    unconstrained = llm.generate("KING LEAR:\n", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = unconstrained[0].outputs[0].token_ids[0]
    assert (out.token_ids[0] == first) == any(c.startswith(llm.get_tokenizer().decode([first])) for c in CHOICES)


@pytest.mark.parametrize("kind, field", [({"json": {"type": "strin"}}, "structured_outputs.json"),
                                         ({"regex": "(ab"}, "structured_outputs.regex"),
                                         ({"grammar": "root ::= missing"}, "structured_outputs.grammar")])
def test_bad_grammar_refused_naming_the_field(llm, kind, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("KING:", SamplingParams(structured_outputs=StructuredOutputsParams(**kind)), use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_params_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="b"))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_speculation_under_a_grammar_is_lossless():
    """n-gram drafts from a prompt full of JSON: drafts the grammar refuses are rejected at verification,
    and greedy output is token-identical with and without speculation."""
    example = '{"name": "Lear", "age": 80, "role": "king", "lines": ["blow", "rage"], "home": {"city": "Dover", "walls": 3}}'
    prompt = f"{example}\n{example}\n"
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    plain = LLM(DEFAULT_MODEL, dtype="float32").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(DEFAULT_MODEL, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
        "adaptive": False})
    out = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    stats = spec.engine.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free(spec.engine)
