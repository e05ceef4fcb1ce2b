import asyncio
import time

import httpx
import pytest

from server_utils import HEADERS, MODEL, server, wait_all_blocks_free, wait_until  # noqa: F401  (fixture)

LONG = {"model": MODEL, "prompt": "ROMEO: But soft", "max_tokens": 300, "ignore_eos": True}


async def _cancel_midway(http: httpx.AsyncClient, index: int) -> int:
    """Reads a few streamed chunks, then drops the connection."""
    chunks = 0
    async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True, "seed": index}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    return chunks


def test_cancelled_streams_free_their_blocks(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60) as http:
            return await asyncio.gather(*(_cancel_midway(http, i) for i in range(32)))
    assert asyncio.run(run()) == [3] * 32
    wait_all_blocks_free(server)
    assert _generated_when_idle(server) < 32 * LONG["max_tokens"], "cancelled requests kept generating"
    out = server.openai().completions.create(model=MODEL, prompt="JULIET", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_cancelled_whole_request_frees_its_blocks(server):
    wait_all_blocks_free(server)
    before = _generated_when_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 500}, headers=HEADERS, timeout=0.2)
    wait_all_blocks_free(server)
    assert _generated_when_idle(server) - before < 500, "the abandoned request ran to completion"


def _generated_when_idle(server) -> int:
    moment = time.time()
    wait_until(lambda: server.client.snapshot.time > moment, 5, "no fresh engine snapshot")
    return server.client.snapshot.stats.num_generation_tokens


async def _one(http: httpx.AsyncClient, index: int, max_tokens: int) -> float:
    start = time.perf_counter()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": f"ROMEO {index}: But soft",
                                                        "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == max_tokens and body["choices"][0]["finish_reason"] == "length"
    return time.perf_counter() - start


def run_load(server, num_requests: int, concurrency: int, max_tokens: int = 8) -> dict:
    async def run():
        limit = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=120, limits=limits) as http:
            async def bounded(i):
                async with limit:
                    return await _one(http, i, max_tokens)
            return await asyncio.gather(*(bounded(i) for i in range(num_requests)))
    start = time.perf_counter()
    latencies = sorted(asyncio.run(run()))
    elapsed = time.perf_counter() - start
    wait_all_blocks_free(server)
    figures = {"requests": num_requests, "concurrency": concurrency, "max_tokens": max_tokens,
               "requests_per_s": num_requests / elapsed, "tokens_per_s": num_requests * max_tokens / elapsed,
               "p50_ms": 1000 * latencies[len(latencies) // 2],
               "p99_ms": 1000 * latencies[min(int(0.99 * len(latencies)), len(latencies) - 1)]}
    print("\nload:", " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


def test_load_small(server):
    figures = run_load(server, num_requests=100, concurrency=32)
    assert figures["requests_per_s"] > 0


@pytest.mark.load
def test_load_full(server):
    figures = run_load(server, num_requests=500, concurrency=64)
    assert figures["requests_per_s"] > 0
