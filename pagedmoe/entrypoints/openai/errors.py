"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}."""
import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedmoe.engine.async_engine import EngineDeadError, QueueFullError, RequestRejectedError

RETRY_AFTER_SECONDS = 1
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}
_DESCRIPTIONS = {400: "Invalid request: malformed JSON, a schema violation or a bad value (`param` names it)",
                 401: "Missing or wrong API key", 404: "Unknown model", 413: "Request body too large",
                 500: "Internal error", 503: "Engine dead, or the waiting queue is full (see Retry-After)"}
_UNION_MEMBER = re.compile(r"^(str|int|float|bool)$|\[")  # pydantic's loc tags for union members


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses=` entries documenting the error statuses a route can answer."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object for a status: the response body's, or a stream's error event's."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": _encodable(message), "type": kind, "param": param and _encodable(param),
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _encodable(text: str) -> str:
    """A lone surrogate quoted back from a request must not turn the error itself into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(error: ValueError) -> APIError:
    """The engine and SamplingParams start their messages with the offending field's name."""
    message = str(error)
    match = re.match(r"[a-z_]+", message)
    return APIError(400, message, param=match.group(0) if match else None, code="invalid_value")


def install_error_handlers(app: FastAPI):
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(RequestRejectedError, _request_rejected)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.code, e.headers)


async def _validation_error(request: Request, e: RequestValidationError):
    """400 like vLLM (not FastAPI's 422); `param` is the dotted path of the first failing field."""
    errors = e.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, _json_error_message(first, e.body), code="invalid_json")
    if isinstance(first.get("input"), bytes):  # FastAPI parses JSON only when the request says so
        return error_response(400, "the body must be a JSON object sent with Content-Type: application/json",
                              code="invalid_json")
    lines = (f"{_dotted(err) or 'body'}: {err.get('msg')}" for err in errors)
    message = "; ".join(dict.fromkeys(lines)) or "invalid request body"
    code = "invalid_unicode" if first.get("type") == "invalid_unicode" else "invalid_schema"
    return error_response(400, message, _dotted(first) or None, code)


def _dotted(error: dict) -> str:
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    loc += error.get("ctx", {}).get("path", [])  # set by protocol.RequestModel for malformed strings
    return ".".join(str(part) for part in loc if not _is_union_member(part))


def _is_union_member(part) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.search(part) is not None


def _json_error_message(error: dict, document) -> str:
    if isinstance(document, bytes):
        document = document.decode("utf-8", "replace")
    position = error["loc"][-1] if isinstance(error["loc"][-1], int) else 0
    decoded = json.JSONDecodeError(error.get("ctx", {}).get("error", "invalid JSON"), document or "", position)
    return f"invalid JSON body: {decoded.msg} at line {decoded.lineno} column {decoded.colno}"


async def _http_error(request: Request, e: StarletteHTTPException):
    if isinstance(e.__cause__, UnicodeDecodeError):
        return error_response(400, f"invalid JSON body: not UTF-8 ({e.__cause__.reason} at byte "
                                   f"{e.__cause__.start})", code="invalid_json")
    if isinstance(e.__cause__, RecursionError):
        return error_response(400, "invalid JSON body: nested too deeply", code="invalid_json")
    code = "not_found" if e.status_code == 404 else None
    return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)


async def _queue_full(request: Request, e: QueueFullError):
    return error_response(503, f"server busy: {e}; retry later", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


async def _engine_dead(request: Request, e: EngineDeadError):
    return error_response(503, str(e), code="engine_dead")


async def _request_rejected(request: Request, e: RequestRejectedError):
    return error_response(400, str(e), code="invalid_value")


async def _internal_error(request: Request, e: Exception):
    return error_response(500, f"internal error: {e!r}", code="internal_error")
