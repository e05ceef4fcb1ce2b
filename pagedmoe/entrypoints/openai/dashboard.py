"""/dashboard: one static page that polls /dashboard/stats, a JSON view of the engine snapshot.
With --api-key, open /dashboard?api_key=KEY: the page sends that key as a header on its polls."""
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from pagedmoe.entrypoints.openai.errors import error_responses
from pagedmoe.entrypoints.openai.serving import ServingContext

PAGE = Path(__file__).parent / "static" / "dashboard.html"
# Not response_class=HTMLResponse: FastAPI would then document the JSON errors as text/html too.
PAGE_RESPONSE = {200: {"description": "The dashboard page", "content": {"text/html": {"schema": {"type": "string"}}}}}


def dashboard_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    page = PAGE.read_text()

    @router.get("/dashboard", responses={**PAGE_RESPONSE, **error_responses(401, 500)})
    async def dashboard():
        return HTMLResponse(page)

    @router.get("/dashboard/stats", responses=error_responses(401, 500))
    async def stats():
        return dashboard_stats(ctx)
    return router


def dashboard_stats(ctx: ServingContext) -> dict:
    snap = ctx.client.snapshot
    s = snap.stats
    return {"time": snap.time, "model": ctx.model_name, "healthy": ctx.client.is_healthy,
            "running": s.num_running, "waiting": s.num_waiting, "swapped": s.num_swapped,
            "kv_blocks": {"total": s.num_kv_blocks_total, "used": s.num_kv_blocks_used,
                          "free": s.num_kv_blocks_free, "usage": s.kv_cache_usage},
            "block_states": snap.block_states,
            "prompt_tokens": s.num_prompt_tokens, "generation_tokens": s.num_generation_tokens,
            "finished_requests": s.num_finished_requests,
            "preemptions": s.num_preemptions_recompute + s.num_preemptions_swap,
            "prefix_cache": {"queries": getattr(s, "prefix_cache_queries", 0),
                             "hits": getattr(s, "prefix_cache_hits", 0)},
            "ttft": ctx.metrics.percentiles("ttft"), "itl": ctx.metrics.percentiles("itl"),
            "expert_load": snap.expert_load, "spec_decode": spec_decode_stats(s), "parallel": parallel_stats(s),
            "expert_cache": expert_cache_stats(s)}


def expert_cache_stats(stats) -> dict | None:
    cache = getattr(stats, "expert_cache", None)
    if cache is None:
        return None
    return {"hits": cache.hits, "misses": cache.misses, "bytes_loaded": cache.bytes_loaded,
            "slots": cache.num_slots, "resident": cache.resident, "prefetch_accuracy": cache.prefetch_accuracy}


def parallel_stats(stats) -> dict | None:
    parallel = getattr(stats, "parallel", None)
    if parallel is None:
        return None
    return {"world_size": parallel.world_size, "steps": parallel.num_steps, "comm_seconds": parallel.comm_seconds,
            "rank_expert_tokens": parallel.rank_expert_tokens, "expert_imbalance": parallel.expert_imbalance,
            "rank_seconds": parallel.rank_seconds}


def spec_decode_stats(stats) -> dict | None:
    spec = getattr(stats, "spec_decode", None)
    if spec is None:
        return None
    return {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
            "accepted_tokens": spec.num_accepted_tokens}
