"""Tool-call parsers for tool_choice "auto", chosen by --tool-call-parser (vLLM's names)."""
from pagedmoe.entrypoints.openai.tool_parsers.base import Extraction, ParsedCall, ToolParser
from pagedmoe.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedmoe.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "Extraction", "ParsedCall", "ToolParser"]
