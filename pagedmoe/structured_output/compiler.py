import json
import re

from pagedmoe.structured_output.lark import is_lark, lark_to_ebnf
from pagedmoe.structured_output.params import StructuredOutputsParams


class GrammarCompiler:
    """Compiles a request's StructuredOutputsParams once per distinct grammar (xgrammar keeps a cache keyed
    by the grammar's text); xgrammar is imported on the first structured request, not at engine start."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams):
        try:
            return self._compile(params)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"structured_outputs.{params.kind}: {_reason(error)}") from None

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        if kind == "json":
            return self.compiler.compile_json_schema(_schema(params), any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}',
                                                     any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(params.choice))
        return self.compiler.compile_grammar(lark_to_ebnf(params.grammar) if is_lark(params.grammar) else params.grammar)


def _schema(params: StructuredOutputsParams) -> str:
    schema = json.loads(params.json_schema)
    if params.disable_additional_properties and isinstance(schema, dict):
        schema = _close_objects(schema)
    return json.dumps(schema)


def _close_objects(schema):
    """additionalProperties: false on every object schema that does not say (vLLM's option of that name)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _close_objects(v) for k, v in schema.items()}
    if closed.get("type") == "object" and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def choice_grammar(choices: list[str]) -> str:
    """One EBNF alternative per choice, each a string literal with JSON's escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(error: Exception) -> str:
    """xgrammar's message without its source-file prefix ("[12:00:00] /project/cpp/x.cc:94: ...")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
