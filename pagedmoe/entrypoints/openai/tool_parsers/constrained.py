"""Outputs the grammar already shaped: a named tool_choice generates the arguments themselves, "required"
generates a JSON array of {"name", "parameters"} objects."""
import json

from pagedmoe.entrypoints.openai.tool_parsers.base import (Extraction, ParsedCall, ToolParser,
                                                           call_from_object, skip_space)


class NamedToolParser(ToolParser):
    """The text is the call's arguments; they stream as they are generated. As OpenAI and vLLM, a forced
    function ends with finish_reason "stop"."""
    calls_finish_reason = "stop"

    def __init__(self, name: str):
        self.name = name

    def extract(self, text: str, final: bool = True) -> Extraction:
        return Extraction("", [ParsedCall(self.name, text)])


class RequiredToolParser(ToolParser):
    """Each array element becomes a call once complete. Output cut short (max_tokens) keeps the complete
    calls; an output without any stays content."""

    def extract(self, text: str, final: bool = True) -> Extraction:
        calls = [call_from_object(value, ("parameters",)) for value in complete_elements(text)]
        calls = [call for call in calls if call is not None]
        return Extraction(text if final and not calls else "", calls)


def complete_elements(text: str) -> list:
    """The elements of a JSON array that are complete in text (which may be cut anywhere)."""
    decoder, values = json.JSONDecoder(), []
    position = _after(text, 0, "[")
    while position is not None:
        try:
            value, position = decoder.raw_decode(text, skip_space(text, position))
        except json.JSONDecodeError:
            break
        values.append(value)
        position = _after(text, position, ",")
    return values


def _after(text: str, position: int, token: str) -> int | None:
    position = skip_space(text, position)
    return position + len(token) if text.startswith(token, position) else None

