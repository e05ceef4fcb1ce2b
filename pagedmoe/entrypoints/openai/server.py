"""The OpenAI-compatible server: FastAPI routes over an AsyncLLMEngine, run by uvicorn."""
import importlib.metadata
import time

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedmoe.engine.async_engine import AsyncLLMEngine
from pagedmoe.memory import freeze_startup_heap
from pagedmoe.worker.cpu_threads import default_num_threads
from pagedmoe.entrypoints.openai.cli_args import add_serve_args, main  # noqa: F401  (the `serve` subcommand)
from pagedmoe.entrypoints.openai.dashboard import dashboard_router
from pagedmoe.entrypoints.openai.errors import APIError, error_responses, install_error_handlers
from pagedmoe.entrypoints.openai.metrics import ServerMetrics
from pagedmoe.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from pagedmoe.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from pagedmoe.entrypoints.openai.serving import ServingContext
from pagedmoe.entrypoints.openai.serving_chat import create_chat_completion
from pagedmoe.entrypoints.openai.serving_completion import create_completion
from pagedmoe.entrypoints.openai.serving_tokenize import detokenize, tokenize
from pagedmoe.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 << 20
GENERATE_ERRORS = error_responses(400, 401, 404, 413, 500, 503)
TOKENIZER_ERRORS = error_responses(400, 401, 404, 413, 500)
READ_ERRORS = error_responses(401, 500)
PROBE_ERRORS = error_responses(500, 503)
STREAMED = {200: {"description": "The whole answer, or server-sent events when `stream` is true",
                  "content": {"text/event-stream": {}}}}
EMPTY_OK = {200: {"description": "Healthy (empty body)", "content": {}}}


def build_app(engine_client: AsyncLLMEngine, api_key: str | None = None, model_name: str = "pagedmoe",
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None) -> FastAPI:
    ctx = ServingContext(engine_client, model_name, ServerMetrics(engine_client, model_name),
                         auto_tool_parser(enable_auto_tool_choice, tool_call_parser))
    app = FastAPI(title="pagedmoe", summary="OpenAI-compatible API over the pagedmoe engine",
                  version=package_version())
    app.include_router(_api_router(ctx))
    app.include_router(_probe_router(ctx))
    app.include_router(dashboard_router(ctx))
    install_error_handlers(app)
    _document_400_not_422(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def auto_tool_parser(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> str | None:
    """vLLM's rule: tool_choice "auto" needs both flags; the first alone is a startup error."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not one of {sorted(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return tool_call_parser if enable_auto_tool_choice else None


def package_version() -> str:
    try:
        return importlib.metadata.version("pagedmoe")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _document_400_not_422(app: FastAPI):
    """FastAPI documents a 422 on every route with a body; this server answers those errors with 400."""
    build_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build_schema()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema
    app.openapi = openapi


def _api_router(ctx: ServingContext) -> APIRouter:
    router, created = APIRouter(), int(time.time())

    @router.post("/v1/completions", responses={**STREAMED, **GENERATE_ERRORS})
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @router.post("/v1/chat/completions", responses={**STREAMED, **GENERATE_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @router.get("/v1/models", responses=READ_ERRORS)
    async def models():
        card = {"id": ctx.model_name, "object": "model", "created": created, "owned_by": "pagedmoe",
                "max_model_len": ctx.client.max_model_len}
        return {"object": "list", "data": [card]}

    @router.post("/tokenize", responses=TOKENIZER_ERRORS)
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(ctx, body)

    @router.post("/detokenize", responses=TOKENIZER_ERRORS)
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(ctx, body)

    @router.get("/metrics", responses=READ_ERRORS, response_class=Response)
    async def metrics():
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
    return router


def _probe_router(ctx: ServingContext) -> APIRouter:
    """What load balancers poll, open even with --api-key: /health and vLLM's /ping and /version."""
    router, version = APIRouter(), {"version": package_version()}

    @router.get("/health", response_class=Response, responses={**EMPTY_OK, **PROBE_ERRORS})
    @router.get("/ping", response_class=Response, responses={**EMPTY_OK, **PROBE_ERRORS})
    @router.post("/ping", response_class=Response, responses={**EMPTY_OK, **PROBE_ERRORS})
    async def health():
        if not ctx.client.is_healthy:
            raise APIError(503, f"engine is not running: {ctx.client.error!r}", code="engine_dead")
        return Response(status_code=200)

    @router.get("/version", responses=error_responses(500))
    async def version_route():
        return version
    return router


def run_server(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_waiting_requests: int = 512,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info",
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None, **engine_kwargs):
    """Serves until Ctrl-C; if the engine dies, the server stops and the process exits non-zero, so a
    supervisor can restart it."""
    if engine_kwargs.get("num_threads") is None:
        engine_kwargs["num_threads"] = default_num_threads(serving=True)
    auto_tool_parser(enable_auto_tool_choice, tool_call_parser)  # bad flags fail before the model loads
    client = AsyncLLMEngine.from_engine_args(model, max_waiting_requests, **engine_kwargs)
    app = build_app(client, api_key, served_model_name or model, max_body_bytes, enable_auto_tool_choice,
                    tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    freeze_startup_heap()
    deaths = []
    client.on_death = lambda error: (deaths.append(error), setattr(server, "should_exit", True))
    try:
        client.start()
        server.run()
    except KeyboardInterrupt:
        pass  # Ctrl-C is the normal way to stop (uvicorn.run swallows it too)
    finally:
        client.shutdown()
    if deaths:
        raise SystemExit(f"pagedmoe serve: the engine died ({deaths[0]!r}); exiting")
