"""Hermes / Qwen tool calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; the text
around them is content. A block whose JSON is not a call stays content, tags included."""
import json

from pagedmoe.entrypoints.openai.tool_parsers.base import Extraction, ToolParser, call_from_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def extract(self, text: str, final: bool = True) -> Extraction:
        result, position = Extraction(""), 0
        while (start := text.find(OPEN, position)) >= 0:
            result.content += text[position:start]
            end, reopened = text.find(CLOSE, start), text.find(OPEN, start + len(OPEN))
            if end < 0:
                position = start
                break
            if 0 <= reopened < end:  # an unclosed block: its text is content
                result.content, position = result.content + text[start:reopened], reopened
                continue
            call = _parse_block(text[start + len(OPEN):end])
            if call is None:
                result.content += text[start:end + len(CLOSE)]
            else:
                result.calls.append(call)
            position = end + len(CLOSE)
        result.content += text[position:] if final else text[position:len(text) - _open_tag_prefix(text, position)]
        return result


def _parse_block(body: str):
    try:
        return call_from_object(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


def _open_tag_prefix(text: str, position: int) -> int:
    """How many trailing characters (from position on) may be the start of an unfinished block."""
    if text.find(OPEN, position) >= 0:
        return len(text) - text.find(OPEN, position)
    for size in range(min(len(OPEN) - 1, len(text) - position), 0, -1):
        if OPEN.startswith(text[len(text) - size:]):
            return size
    return 0
