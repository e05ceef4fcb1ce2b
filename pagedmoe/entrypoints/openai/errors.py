"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}."""
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedmoe.engine.async_engine import EngineDeadError, QueueFullError

RETRY_AFTER_SECONDS = 1
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


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
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.code, e.headers)


async def _validation_error(request: Request, e: RequestValidationError):
    errors = e.errors()
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: {err.get('msg')}"
                        for err in errors)
    param = ".".join(location) or None
    return error_response(422, message or "invalid request body", param, "invalid_schema")


async def _http_error(request: Request, e: StarletteHTTPException):
    code = "not_found" if e.status_code == 404 else None
    return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)


async def _queue_full(request: Request, e: QueueFullError):
    return error_response(503, f"server busy: {e}; retry later", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


async def _engine_dead(request: Request, e: EngineDeadError):
    return error_response(503, str(e), code="engine_dead")


async def _internal_error(request: Request, e: Exception):
    return error_response(500, f"internal error: {e!r}", code="internal_error")
