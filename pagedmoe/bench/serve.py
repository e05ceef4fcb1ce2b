"""Online serving: Poisson arrivals at each request rate against an OpenAI-compatible /v1/completions,
streamed with httpx. Per request: TTFT (send -> first token chunk), inter-token latencies (ITL: gaps between
token chunks, pooled over requests for the percentiles), TPOT (the request's mean ITL, (E2E - TTFT) /
(tokens - 1)), end-to-end latency, output tokens (from the final usage chunk). Goodput: requests with
TTFT <= --slo-ttft and TPOT <= --slo-itl. Bounded: a fixed number of requests per rate, a per-request
timeout and a global deadline; a request past them counts as failed."""
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from pagedmoe.bench.quiet import wait_for_quiet_cpus
from pagedmoe.bench.steps import percentile
from pagedmoe.bench.workload import BenchRequest


@dataclass
class RequestResult:
    ok: bool = False
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def mean_itl_s(self) -> float:
        """(E2E - TTFT) / (output tokens - 1): robust to several tokens arriving in one chunk."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: exponential gaps of mean 1/rate (rate = inf: all at 0)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def request_body(req: BenchRequest, model: str | None) -> dict:
    body = {"prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return body | ({"model": model} if model else {})


async def send_request(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """One streamed completion; token chunks are the SSE events whose choices carry text or a finish."""
    result, start, last = RequestResult(), time.perf_counter(), None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                last = _on_event(result, line, start, last)
        result.e2e_s, result.ok = time.perf_counter() - start, result.error is None and last is not None
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _on_event(result: RequestResult, line: str, start: float, last: float | None) -> float | None:
    """Updates result from one SSE line; returns the time of the latest token chunk."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    event, now = json.loads(line[len("data: "):]), time.perf_counter()
    if "error" in event:
        result.error = str(event["error"].get("message"))
    if event.get("usage"):
        result.output_tokens = event["usage"]["completion_tokens"]
    if not event.get("choices"):
        return last
    if last is None:
        result.ttft_s = now - start
    else:
        result.itl_s.append(now - last)
    return now


async def run_rate(url: str, model: str | None, workload: list[BenchRequest], rate: float, seed: int,
                   deadline: float, request_timeout: float) -> tuple[list[RequestResult], float]:
    """All of `workload` at Poisson arrivals of `rate` req/s; returns results (in workload order) and duration."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as http:
        start, bar = time.perf_counter(), tqdm(total=len(workload), desc=f"rate {rate:g} req/s")

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            result = await send_request(http, url, request_body(req, model))
            bar.update(1)
            return result
        tasks = [asyncio.ensure_future(one(r, t)) for r, t in zip(workload, arrival_times(len(workload), rate, seed))]
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        results = [_task_result(task) for task in tasks]
        bar.close()
        return results, time.perf_counter() - start


def _task_result(task: asyncio.Future) -> RequestResult:
    if not task.done():
        task.cancel()
        return RequestResult(error="global timeout")
    return task.result()


def rate_figures(rate: float, results: list[RequestResult], duration: float, slo_ttft: float | None,
                 slo_itl: float | None) -> dict:
    """Percentiles (ms) over the successful requests, output tok/s and goodput over the rate's duration."""
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo_ttft, slo_itl)]
    num_out = sum(r.output_tokens for r in ok)
    figures = {"request_rate": rate, "num_requests": len(results), "completed": len(ok),
               "failed": len(results) - len(ok), "duration_s": duration, "output_tokens": num_out,
               "output_tok_s": num_out / duration, "requests_s": len(ok) / duration,
               "goodput_requests": len(good), "goodput_req_s": len(good) / duration,
               "goodput_fraction": len(good) / len(results) if results else float("nan")}
    for name, values in (("ttft", _ms([r.ttft_s for r in ok])), ("itl", _ms([t for r in ok for t in r.itl_s])),
                         ("tpot", _ms([r.mean_itl_s for r in ok])), ("e2e", _ms([r.e2e_s for r in ok]))):
        figures |= {f"{name}_mean_ms": statistics.fmean(values) if values else float("nan"),
                    f"{name}_p50_ms": percentile(values, 50), f"{name}_p99_ms": percentile(values, 99)}
    errors = sorted({r.error for r in results if r.error})
    return figures | {"errors": errors[:5]}


def _ms(values: list[float]) -> list[float]:
    return [v * 1e3 for v in values]


def meets_slo(result: RequestResult, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """SLOs in seconds: TTFT and the request's mean inter-token latency; None means no bound."""
    return ((slo_ttft is None or result.ttft_s <= slo_ttft) and
            (slo_itl is None or result.mean_itl_s <= slo_itl))


async def sweep(url: str, model: str | None, workloads: list[list[BenchRequest]], rates: list[float], seed: int,
                slo_ttft: float | None, slo_itl: float | None, timeout: float, request_timeout: float) -> dict:
    """Every rate in turn, each with its own prompts (no prefix-cache hits from an earlier rate), within one
    global `timeout` in seconds."""
    return (await interleaved_sweep({"": (url, model)}, workloads, rates, seed, slo_ttft, slo_itl, timeout,
                                    request_timeout))[""]


async def interleaved_sweep(targets: dict[str, tuple[str, str | None]], workloads: list[list[BenchRequest]],
                            rates: list[float], seed: int, slo_ttft: float | None, slo_itl: float | None,
                            timeout: float, request_timeout: float, settle_timeout: float = 0.0) -> dict[str, dict]:
    """sweep() on several servers (name -> (url, model)): each rate runs on every server before the next rate,
    so that the host's drift falls on all of them alike; before each turn, up to settle_timeout seconds for
    the CPUs to go quiet after the last one."""
    deadline = time.monotonic() + timeout
    swept = {name: {"rates": [], "requests": {}} for name in targets}
    for rate, workload in zip(rates, workloads):
        for name, (url, model) in targets.items():
            wait_for_quiet_cpus(settle_timeout)
            results, duration = await run_rate(url, model, workload, rate, seed, deadline, request_timeout)
            swept[name]["rates"].append(rate_figures(rate, results, duration, slo_ttft, slo_itl))
            swept[name]["requests"][str(rate)] = [asdict(r) for r in results]
    return swept


def served_model(url: str) -> str | None:
    """The first model id /v1/models lists (None if the server has no such route)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


async def warm_up(url: str, model: str | None, req: BenchRequest, request_timeout: float):
    """One short request (the first prompt reversed: it warms the server without caching a real prompt)."""
    async with httpx.AsyncClient(timeout=request_timeout) as http:
        warm = BenchRequest(req.prompt_token_ids[::-1], 2)
        result = await send_request(http, url, request_body(warm, model))
    if not result.ok:
        raise RuntimeError(f"bench serve: warm-up request failed: {result.error}")
