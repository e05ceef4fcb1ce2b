"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled by xgrammar and applied as a
token bitmask in the sampler."""
from pagedmoe.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
