"""What a request asks its output to match, as SamplingParams.structured_outputs: OpenAI's response_format,
vLLM's structured_outputs or its older guided_* fields, or the JSON a tool_choice implies. At most one."""
import contextlib

from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.protocol import ResponseFormat, SamplingRequest, Tool
from pagedmoe.sampling_params import StructuredOutputsParams

GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def structured_outputs(body: SamplingRequest,
                       tool_schema: dict | None = None) -> tuple[str | None, StructuredOutputsParams | None]:
    """(the request field that constrains the output, its params); raises ValueError naming the fields
    when more than one does."""
    sources = {"response_format": _from_response_format(body.response_format),
               "structured_outputs": body.structured_outputs and body.structured_outputs.to_params(),
               **_from_guided(body),
               "tool_choice": tool_schema and StructuredOutputsParams(json=tool_schema)}
    given = {name: params for name, params in sources.items() if params is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} cannot be combined: each constrains the output; give one")
    return next(iter(given.items()), (None, None))


@contextlib.contextmanager
def errors_named_after(source: str | None):
    """The engine refuses a bad schema, regex or grammar as structured_outputs: name the field sent."""
    try:
        yield
    except APIError as e:
        if source not in (None, "structured_outputs") and e.param == "structured_outputs":
            e.param, e.message = source, f"{source}: {e.message}"
        raise


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise ValueError("response_format.json_schema is required when type is json_schema")
    schema = response_format.json_schema.schema_
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)


def _from_guided(body: SamplingRequest) -> dict[str, StructuredOutputsParams]:
    """guided_json, guided_regex, ...: one entry named after the field(s) given, so conflicts name them."""
    given = {field: kind for field, kind in GUIDED_KINDS.items() if getattr(body, field) is not None}
    if not given:
        return {}
    kinds = {kind: getattr(body, field) for field, kind in given.items()}
    if len(kinds) > 1:
        raise ValueError(f"{' and '.join(given)} cannot be combined: each constrains the output; give one")
    return {next(iter(given)): StructuredOutputsParams(**kinds, whitespace_pattern=body.guided_whitespace_pattern)}


def named_tool_schema(tool: Tool) -> dict:
    """A named tool_choice generates the function's arguments."""
    return tool.function.parameters or EMPTY_PARAMETERS


def required_tools_schema(tools: list[Tool], parallel_tool_calls: bool) -> dict:
    """vLLM's: a non-empty array of {"name": one tool's name, "parameters": that tool's arguments}. Each
    tool's $defs move to the root, where their "#/$defs/..." references now point."""
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [_call_schema(t) for t in tools]}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    definitions = _lifted_definitions(schema["items"]["anyOf"])
    return {**schema, "$defs": definitions} if definitions else schema


def _call_schema(tool: Tool) -> dict:
    return {"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": dict(named_tool_schema(tool))},
            "required": ["name", "parameters"]}


def _lifted_definitions(call_schemas: list[dict]) -> dict:
    definitions = {}
    for call in call_schemas:
        for name, definition in call["properties"]["parameters"].pop("$defs", {}).items():
            if definitions.get(name, definition) != definition:
                raise ValueError(f"tools: two functions define $defs {name!r} differently; rename one")
            definitions[name] = definition
    return definitions
