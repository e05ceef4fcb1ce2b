"""Pure ASGI middleware (BaseHTTPMiddleware would buffer streams and hide client disconnects)."""
import hmac
from urllib.parse import parse_qs

from starlette.datastructures import Headers

from pagedmoe.entrypoints.openai.errors import error_response


class ApiKeyMiddleware:
    """Bearer token check, in constant time, on every path except the probes in `OPEN_PATHS`
    (/health, /ping, /version), which load balancers and orchestrators call without credentials.
    A browser cannot send a header when it navigates, so the dashboard page alone also takes the key
    as `?api_key=KEY`; its script then sends the key as a header on its own fetches."""

    OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
    QUERY_KEY_PATHS = frozenset({"/dashboard"})

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and not self._authorized(scope):
            response = error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                      code="invalid_api_key")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").encode()
        if hmac.compare_digest(given, b"Bearer " + self.api_key):
            return True
        if scope["path"] not in self.QUERY_KEY_PATHS:
            return False
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return any(hmac.compare_digest(key.encode(), self.api_key) for key in query.get("api_key", []))


class BodySizeLimitMiddleware:
    """Reads the whole body up front (declared or chunked) and answers 413 past `max_bytes`;
    later receive() calls reach the server, so handlers still see the client disconnect."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        body = None if declared.isdigit() and int(declared) > self.max_bytes else b""
        more = body is not None
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False) and len(body) <= self.max_bytes
        if body is None or len(body) > self.max_bytes:
            response = error_response(413, f"request body larger than {self.max_bytes} bytes",
                                      code="request_too_large")
            return await response(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replayed
