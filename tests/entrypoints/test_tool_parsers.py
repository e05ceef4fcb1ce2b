"""The tool-call parsers on hand-written model outputs, whole and streamed a few characters at a time."""
import json

import pytest

from pagedmoe.entrypoints.openai.tool_calls import ToolDeltaTracker
from pagedmoe.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedmoe.entrypoints.openai.tool_parsers.constrained import NamedToolParser, RequiredToolParser

HERMES = TOOL_PARSERS["hermes"]()
LLAMA = TOOL_PARSERS["llama3_json"]()
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def calls(extraction) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in extraction.calls]


def test_hermes_content_around_one_call():
    out = HERMES.extract(f"Let me look.\n{WEATHER}\nDone.")
    assert calls(out) == [("get_weather", {"city": "Verona", "days": 2})]
    assert out.content == "Let me look.\n\nDone."


def test_hermes_several_calls():
    out = HERMES.extract(f"{WEATHER}\n{TIME}")
    assert [name for name, _ in calls(out)] == ["get_weather", "get_time"] and out.content.strip() == ""


@pytest.mark.parametrize("block", ['<tool_call>{"name": "f", "arguments": {</tool_call>',
                                   '<tool_call>{"arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                   '<tool_call>{"name": "f"'])
def test_hermes_malformed_blocks_stay_content(block):
    out = HERMES.extract(f"a {block} b {TIME}")
    assert calls(out) == [("get_time", {})]
    assert out.content == f"a {block} b "


def test_hermes_without_tags_is_all_content():
    assert HERMES.extract("ROMEO: <tool no call").content == "ROMEO: <tool no call"


def test_llama3_json_single_call_and_python_tag():
    single = LLAMA.extract('{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert calls(single) == [("get_time", {"zone": "CET"})]
    out = LLAMA.extract('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": ";"}}')
    assert calls(out) == [("a", {}), ("b", {"x": ";"})] and out.content == ""


@pytest.mark.parametrize("text", ["Just words.", '{"name": "a", "parameters": {}', '{"city": "Verona"}',
                                  '{"name": "a", "parameters": {}} trailing'])
def test_llama3_json_anything_else_is_content(text):
    out = LLAMA.extract(text)
    assert out.content == text and out.calls == []


def test_required_array_keeps_complete_calls_of_a_cut_output():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [1, 2'
    out = RequiredToolParser().extract(text)
    assert calls(out) == [("a", {"x": 1})] and out.content == ""
    assert RequiredToolParser().extract('[{"name": "a", "para').content == '[{"name": "a", "para'


def stream(parser, text: str, step: int = 3) -> tuple[str, list[dict]]:
    """Feeds text in `step`-character pieces and reassembles the deltas as a client does."""
    tracker, content, tool_calls = ToolDeltaTracker(parser), "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = tracker.advance(text[:end], final=end == len(text))
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(tool_calls):
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                tool_calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
            tool_calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, tool_calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_stream_matches_the_whole(step):
    text = f"Let me look.\n{WEATHER}\n{TIME}\n<tool_call>{{bad}}</tool_call> done <tool_"
    content, tool_calls = stream(HERMES, text, step)
    whole = HERMES.extract(text)
    assert content == whole.content and content.endswith("done <tool_")
    assert [(c["name"], json.loads(c["arguments"])) for c in tool_calls] == calls(whole)
    assert len({c["id"] for c in tool_calls}) == 2


def test_hermes_stream_holds_back_a_possible_tag_only():
    tracker = ToolDeltaTracker(HERMES)
    assert tracker.advance("Hello <tool", final=False) == {"content": "Hello "}
    assert tracker.advance("Hello <tool_call>{", final=False) == {}
    assert tracker.advance("Hello <tools>", final=False) == {"content": "<tools>"}


@pytest.mark.parametrize("parser, text", [
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {"k": 1}}; {"name": "b", "parameters": {}}'),
    (LLAMA, "plain words, no call"),
    (RequiredToolParser(), '[{"name": "a", "parameters": {"k": "v"}}, {"name": "b", "parameters": {}}]'),
    (NamedToolParser("a"), '{"k": "value", "n": [1, 2, 3]}'),
])
def test_other_parsers_stream_matches_the_whole(parser, text):
    content, tool_calls = stream(parser, text, step=2)
    whole = parser.extract(text)
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in tool_calls] == [(c.name, c.arguments) for c in whole.calls]


def test_named_arguments_stream_as_they_grow():
    tracker = ToolDeltaTracker(NamedToolParser("f"))
    first = tracker.advance('{"a"', final=False)["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": '{"a"'} and first["index"] == 0
    assert tracker.advance('{"a": 1}', final=True) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
