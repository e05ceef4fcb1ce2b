"""Tool calling on /v1/chat/completions, as vLLM: what tool_choice makes of a request (a grammar, a parser
of the output), and the parsed calls as OpenAI's message fields and stream deltas."""
import uuid
from dataclasses import dataclass, field

from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.output_constraints import named_tool_schema, required_tools_schema
from pagedmoe.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from pagedmoe.entrypoints.openai.tool_parsers import TOOL_PARSERS, Extraction, ParsedCall, ToolParser
from pagedmoe.entrypoints.openai.tool_parsers.constrained import NamedToolParser, RequiredToolParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolPlan:
    schema: dict | None = None  # the JSON the output must match (named / required)
    parser: ToolParser | None = None  # None: the output is plain content


def plan_tools(body: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """auto_parser: the --tool-call-parser name when --enable-auto-tool-choice is on."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if choice != "none" and choice != "auto" and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    if isinstance(choice, NamedToolChoice):
        tool = _tool_named(body.tools, choice.function.name)
        return ToolPlan(named_tool_schema(tool), NamedToolParser(tool.function.name))
    if choice == "required":
        return ToolPlan(_required_schema(body), RequiredToolParser())
    if choice == "auto" and body.tools:
        if auto_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice", code="invalid_value")
        return ToolPlan(parser=TOOL_PARSERS[auto_parser]())
    return ToolPlan()


def _tool_named(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    offered = ", ".join(repr(t.function.name) for t in tools)
    raise APIError(400, f"tool_choice names function {name!r}, which is not in tools ({offered})",
                   param="tool_choice", code="invalid_value")


def _required_schema(body: ChatCompletionRequest) -> dict:
    try:
        return required_tools_schema(body.tools, body.parallel_tool_calls)
    except ValueError as e:
        raise APIError(400, str(e), param="tools", code="invalid_value") from e


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_message(extraction: Extraction) -> dict:
    """The assistant message of a finished choice."""
    if not extraction.calls:
        return {"role": "assistant", "content": extraction.content}
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in extraction.calls]
    return {"role": "assistant", "content": extraction.content if extraction.content.strip() else None,
            "tool_calls": calls}


def tool_finish_reason(parser: ToolParser, made_calls: bool, finish_reason: str | None) -> str | None:
    return parser.calls_finish_reason if made_calls and finish_reason == "stop" else finish_reason


@dataclass
class ToolDeltaTracker:
    """One streamed choice: sends what the parser's extraction of the text so far adds. Whitespace-only
    content waits for more text, and is dropped at the end when the choice made calls."""
    parser: ToolParser
    sent_content: int = 0
    sent_calls: list[ParsedCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    made_calls: bool = False

    def advance(self, text: str, final: bool) -> dict:
        extraction = self.parser.extract(text, final)
        self.made_calls = self.made_calls or bool(extraction.calls)
        delta = {}
        content = self._new_content(extraction.content, final)
        if content:
            delta["content"] = content
        calls = [self._call_delta(index, call) for index, call in enumerate(extraction.calls)]
        if any(calls):
            delta["tool_calls"] = [call for call in calls if call]
        return delta

    def _new_content(self, content: str, final: bool) -> str:
        new = content[self.sent_content:]
        if not new.strip() and not (final and not self.made_calls):
            return ""
        self.sent_content = len(content)
        return new

    def _call_delta(self, index: int, call: ParsedCall) -> dict | None:
        if index == len(self.sent_calls):
            self.ids.append(new_call_id())
            self.sent_calls.append(ParsedCall(call.name, call.arguments))
            return {"index": index, "id": self.ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
        sent = self.sent_calls[index]
        if len(call.arguments) == len(sent.arguments):
            return None
        new, sent.arguments = call.arguments[len(sent.arguments):], call.arguments
        return {"index": index, "function": {"arguments": new}}
