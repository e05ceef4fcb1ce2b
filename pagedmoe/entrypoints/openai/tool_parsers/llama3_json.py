"""Llama 3.x JSON tool calls: the whole output (optionally after <|python_tag|>) is one JSON object
{"name": ..., "parameters": {...}} or several separated by ";". Anything else is content. A possible
call is held back until the output ends, since it only parses once complete."""
from pagedmoe.entrypoints.openai.tool_parsers.base import Extraction, ToolParser, call_from_object, decode_objects

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str, final: bool = True) -> Extraction:
        body = text.lstrip()
        if not (body.startswith(PYTHON_TAG) or body.startswith("{")):
            maybe_tag = not final and PYTHON_TAG.startswith(body)
            return Extraction("" if maybe_tag else text)
        if not final:
            return Extraction("")
        calls = [call_from_object(value, ("parameters", "arguments"))
                 for value in decode_objects(body.removeprefix(PYTHON_TAG), ";") or [None]]
        return Extraction("", calls) if all(calls) else Extraction(text)
