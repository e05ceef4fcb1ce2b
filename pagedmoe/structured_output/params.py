import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json (a schema, dict or JSON text), regex, choice,
    grammar (EBNF / GBNF, or Lark) or json_object constrains what a request may generate.
    disable_any_whitespace (default True here, False in vLLM): JSON is written compactly, because a small model
    sampling at temperature 1 can otherwise fill max_tokens with whitespace the grammar allows."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None  # accepted for vLLM scripts; xgrammar is the one backend

    def __post_init__(self):
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set, got "
                             f"{kinds or 'none'}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        if self.backend not in (None, "auto", "xgrammar"):
            logger.info("structured_outputs.backend %r ignored: pagedmoe runs xgrammar", self.backend)
        self._check_kind()

    def _check_kind(self):
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got {self.json!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def json_schema(self) -> str:
        return self.json if isinstance(self.json, str) else json.dumps(self.json)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name
