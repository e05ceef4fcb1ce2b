"""What every tool parser returns, and the JSON helpers they share."""
import json
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass
class Extraction:
    """`extract(text, final)` of a parser. Prefix-stable: for a longer text (or final=True) the content
    extends the earlier content and the calls extend the earlier calls (the last call's arguments may
    grow), so a stream can send the difference."""
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    calls_finish_reason = "tool_calls"  # a choice that ended by itself and made calls

    def extract(self, text: str, final: bool = True) -> Extraction:
        raise NotImplementedError


def call_from_object(value, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """{"name": str, <arguments key>: object} -> a call; anything else -> None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def decode_objects(text: str, separator: str) -> list | None:
    """JSON values separated by `separator` (whitespace around allowed) filling all of text, or None."""
    decoder, values, position = json.JSONDecoder(), [], skip_space(text, 0)
    while position < len(text):
        if values:
            if not text.startswith(separator, position):
                return None
            position = skip_space(text, position + len(separator))
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)
        position = skip_space(text, position)
    return values


def skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
