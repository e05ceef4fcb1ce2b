"""The OpenAI-compatible server: FastAPI routes over an AsyncLLMEngine, run by uvicorn."""
import time

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedmoe.engine.async_engine import AsyncLLMEngine
from pagedmoe.entrypoints.openai.cli_args import add_serve_args, main  # noqa: F401  (the `serve` subcommand)
from pagedmoe.entrypoints.openai.dashboard import dashboard_router
from pagedmoe.entrypoints.openai.errors import APIError, install_error_handlers
from pagedmoe.entrypoints.openai.metrics import ServerMetrics
from pagedmoe.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from pagedmoe.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from pagedmoe.entrypoints.openai.serving import ServingContext
from pagedmoe.entrypoints.openai.serving_chat import create_chat_completion
from pagedmoe.entrypoints.openai.serving_completion import create_completion
from pagedmoe.entrypoints.openai.serving_tokenize import detokenize, tokenize

DEFAULT_MAX_BODY_BYTES = 4 << 20


def build_app(engine_client: AsyncLLMEngine, api_key: str | None = None, model_name: str = "pagedmoe",
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    ctx = ServingContext(engine_client, model_name, ServerMetrics(engine_client, model_name))
    app = FastAPI(title="pagedmoe", summary="OpenAI-compatible API over the pagedmoe engine")
    app.include_router(_api_router(ctx))
    app.include_router(dashboard_router(ctx))
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _api_router(ctx: ServingContext) -> APIRouter:
    router, created = APIRouter(), int(time.time())

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @router.get("/v1/models")
    async def models():
        card = {"id": ctx.model_name, "object": "model", "created": created, "owned_by": "pagedmoe",
                "max_model_len": ctx.client.max_model_len}
        return {"object": "list", "data": [card]}

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(ctx, body)

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(ctx, body)

    @router.get("/health")
    async def health():
        if not ctx.client.is_healthy:
            raise APIError(503, f"engine is not running: {ctx.client.error!r}", code="engine_dead")
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
    return router


def run_server(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_waiting_requests: int = 512,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info", **engine_kwargs):
    client = AsyncLLMEngine.from_engine_args(model, max_waiting_requests, **engine_kwargs).start()
    try:
        app = build_app(client, api_key, served_model_name or model, max_body_bytes)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        client.shutdown()
