"""Structured outputs and tool calling through the real server and the real OpenAI client, sampled at
temperature 1 from the bundled model: every constrained answer must parse and validate."""
import json
import os
import re
from typing import Literal

import httpx
import jsonschema
import pytest

from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from server_utils import API_KEY, HEADERS, MODEL, serve, server  # noqa: F401  (server: a server without tool flags)

MESSAGES = [{"role": "user", "content": "Describe a character of the play."}]
SAMPLED = {"temperature": 1.0, "max_tokens": 300, "seed": 7}
CHARACTER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 13, "maximum": 90},
        "wit": {"type": "number", "minimum": 0, "maximum": 10},
        "house": {"enum": ["Montague", "Capulet", "Prince"]},
        "friends": {"type": "array", "maxItems": 3,
                    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                               "loyal": {"type": "boolean"}},
                              "required": ["name", "loyal"]}},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
    },
    "required": ["name", "age", "house", "friends", "home"],
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
DUEL = {"type": "object", "properties": {"rival": {"enum": ["Tybalt", "Mercutio"]}, "at_dawn": {"type": "boolean"}},
        "required": ["rival"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "duel", "parameters": DUEL}}]
PARAMETERS = {"get_weather": WEATHER, "duel": DUEL}


@pytest.fixture(scope="module")
def bundled():
    options = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    with serve(DEFAULT_MODEL, app_options=options, num_kv_blocks=1024, max_num_seqs=32) as running:
        yield running


@pytest.fixture
def client(bundled):
    return bundled.openai()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=HEADERS, timeout=120)


def test_json_schema_response_format_always_validates(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=20, **SAMPLED, response_format={
        "type": "json_schema", "json_schema": {"name": "character", "schema": CHARACTER, "strict": True}})
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CHARACTER)


def test_json_object_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="ROMEO:", n=5, **SAMPLED,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert all(isinstance(json.loads(choice.text), dict) for choice in out.choices if choice.finish_reason == "stop")
    assert any(choice.finish_reason == "stop" for choice in out.choices)


def test_regex_always_matches(client):
    pattern = r"(ROMEO|JULIET): [a-z]{1,8}( [a-z]{1,8}){0,4}[.!?]"
    out = client.completions.create(model=MODEL, prompt="ROMEO:", n=20, **SAMPLED,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    for choice in out.choices:
        assert re.fullmatch(pattern, choice.text), choice.text


def test_choice_always_one_of(client):
    houses = ["Montague", "Capulet", "neither house"]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=20, **SAMPLED,
                                         extra_body={"guided_choice": houses})
    assert {choice.message.content for choice in out.choices} <= set(houses)


def test_guided_json_and_its_whitespace_pattern(client):
    out = client.completions.create(model=MODEL, prompt="ROMEO:", n=4, **SAMPLED, extra_body={
        "guided_json": WEATHER, "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " "})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), WEATHER)


def call_arguments(tool_call) -> dict:
    assert tool_call.type == "function" and tool_call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(tool_call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[tool_call.function.name])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "duel"}}])
def test_constrained_tool_calls_validate(client, tool_choice):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=6, tools=TOOLS, tool_choice=tool_choice,
                                         parallel_tool_calls=False, **SAMPLED)
    for choice in out.choices:  # as OpenAI and vLLM: a named function's choice ends with "stop"
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        assert choice.message.content is None
        [tool_call] = choice.message.tool_calls
        call_arguments(tool_call)
        assert tool_choice == "required" or tool_call.function.name == "duel"


def test_required_with_parallel_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=6, tools=TOOLS, tool_choice="required",
                                         **SAMPLED)
    for choice in out.choices:
        assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
        for tool_call in choice.message.tool_calls:
            call_arguments(tool_call)


def reassemble(chunks) -> tuple[dict, str]:
    """The tool calls of a streamed choice, put back together from their deltas as a client does."""
    calls, finish_reason = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "type": delta.type, "name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return calls, finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble(client, tool_choice):
    for seed in range(3):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, stream=True,
            parallel_tool_calls=False, **{**SAMPLED, "seed": seed}))
        calls, finish_reason = reassemble(chunks)
        assert finish_reason == ("tool_calls" if tool_choice == "required" else "stop") and list(calls) == [0]
        call = calls[0]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_auto_with_hermes_gives_content_when_the_model_calls_nothing(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=20, temperature=0)
    message = out.choices[0].message
    assert message.tool_calls is None and message.content == plain.choices[0].message.content
    assert out.choices[0].finish_reason == plain.choices[0].finish_reason


def test_tool_conversation_renders_through_the_template(bundled, client):
    from transformers import AutoTokenizer
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "duel", "arguments": '{"rival": "Tybalt"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "Tybalt is slain."}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    text = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "duel", "arguments": {"rival": "Tybalt"}}</tool_call>' in text
    assert "<tool_response>\nTybalt is slain.\n</tool_response>" in text and '"name": "get_weather"' in text
    assert out.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    tokenized = post(bundled, "/tokenize", {"messages": history, "tools": TOOLS}).json()
    assert tokenized["tokens"] == tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": WEATHER}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}, "max_tokens": 5}, "use_beam_search"),
])
def test_bad_constraints_are_400(bundled, body, param):
    response = post(bundled, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_auto_needs_the_server_flags(server):
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                   '--tool-call-parser to be set')
    ok = post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
                                               "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_bad_schema_does_not_disturb_other_requests(bundled, client):
    bad = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}
    assert post(bundled, "/v1/completions", {"prompt": "ROMEO:", **bad}).status_code == 400
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_langchain_with_structured_output(bundled):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Character(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=13, le=90)
        house: Literal["Montague", "Capulet"]

    chat = ChatOpenAI(model=MODEL, base_url=f"{bundled.url}/v1", api_key=API_KEY, temperature=1.0, max_tokens=200,
                      max_retries=0)
    for _ in range(3):
        character = chat.with_structured_output(Character).invoke("Describe a character of the play.")
        assert isinstance(character, Character) and 13 <= character.age <= 90


def test_litellm_completion(bundled):
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no download of litellm's price list
    import litellm
    answer = litellm.completion(model=f"openai/{MODEL}", api_base=f"{bundled.url}/v1", api_key=API_KEY,
                                messages=MESSAGES, max_tokens=300, temperature=1.0, response_format={
                                    "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), WEATHER)
    called = litellm.completion(model=f"openai/{MODEL}", api_base=f"{bundled.url}/v1", api_key=API_KEY,
                                messages=MESSAGES, max_tokens=300, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False)
    assert called.choices[0].finish_reason == "tool_calls"
    call_arguments(called.choices[0].message.tool_calls[0])
