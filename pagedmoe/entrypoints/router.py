"""`pagedmoe router`: one OpenAI-compatible address in front of several pagedmoe (or vLLM) replicas, for tests
and single-host use (fleets use vllm-router, which drives pagedmoe replicas unchanged). /v1/completions and
/v1/chat/completions go to the replica the policy picks (routing_policies.py), streamed through as they
come; a replica that cannot be reached answers 502 in OpenAI's error shape, never a hang."""
import argparse
import contextlib
import json
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedmoe.entrypoints.routing_policies import POLICIES

ROUTED = ("/v1/completions", "/v1/chat/completions")


class Router:
    def __init__(self, replicas: list[str], policy: str, timeout_s: float = 600.0):
        self.replicas = [url.rstrip("/") for url in replicas]
        self.policy = POLICIES[policy](len(self.replicas))
        self.in_flight = [0] * len(self.replicas)
        self.routed = [0] * len(self.replicas)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    def pick(self, body: dict) -> int:
        replica = self.policy.choose(request_text(body), self.in_flight)
        self.routed[replica] += 1
        return replica

    async def forward(self, path: str, body: dict, headers: dict) -> Response:
        replica = self.pick(body)
        self.in_flight[replica] += 1
        request = self.http.build_request("POST", self.replicas[replica] + path, json=body, headers=headers)
        try:
            upstream = await self.http.send(request, stream=True)
        except httpx.HTTPError as error:
            self.in_flight[replica] -= 1
            return unreachable(self.replicas[replica], error)
        return StreamingResponse(self.relay(upstream, replica), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    async def relay(self, upstream: httpx.Response, replica: int):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            self.in_flight[replica] -= 1
            await upstream.aclose()


class DisaggregatedRouter(Router):
    """Prefill then decode, as vLLM's P/D proxies drive it: the request goes to the prefill instance with
    max_tokens 1 and kv_transfer_params {"do_remote_decode": true}; its answer's kv_transfer_params go with
    the original request to the decode instance, whose response (streamed or not) is the client's."""

    def __init__(self, prefill: str, decode: str, timeout_s: float = 600.0):
        super().__init__([decode], "round_robin", timeout_s)
        self.prefill = prefill.rstrip("/")

    async def forward(self, path: str, body: dict, headers: dict) -> Response:
        prefill_body = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        prefill_body |= {"max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": REMOTE_DECODE}
        try:
            answer = await self.http.post(self.prefill + path, json=prefill_body, headers=headers)
        except httpx.HTTPError as error:
            return unreachable(self.prefill, error)
        if answer.status_code != 200:  # the client sees the prefill instance's error as it was
            return Response(answer.content, answer.status_code, media_type="application/json")
        params = answer.json().get("kv_transfer_params")
        return await super().forward(path, body | {"kv_transfer_params": params}, headers)


REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def request_text(body: dict) -> str:
    """What the policy matches: the prompt, or the chat messages' roles and contents in order."""
    if "messages" in body:
        return "".join(f"{m.get('role', '')}:{json.dumps(m.get('content'))}" for m in body["messages"]
                       if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def unreachable(url: str, error: Exception) -> JSONResponse:
    message = f"replica {url} could not be reached: {type(error).__name__}: {error}"
    return JSONResponse({"error": {"message": message, "type": "bad_gateway", "param": None, "code": "bad_gateway"}},
                        status_code=502)


async def first_replica_models(router: Router, auth: dict) -> Response:
    try:
        upstream = await router.http.get(router.replicas[0] + "/v1/models", headers=auth)
    except httpx.HTTPError as error:
        return unreachable(router.replicas[0], error)
    return Response(upstream.content, upstream.status_code, media_type="application/json")


def bad_json(error: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": f"request body is not a JSON object: {error}",
                                   "type": "invalid_request_error", "param": None, "code": None}}, status_code=400)


def auth_header(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="pagedmoe router")

    async def routed(request: Request):
        try:
            body = await request.json()
            assert isinstance(body, dict), "not an object"
        except (ValueError, AssertionError) as error:
            return bad_json(error)
        return await router.forward(request.url.path, body, auth_header(request))

    for path in ROUTED:
        app.add_api_route(path, routed, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        return await first_replica_models(router, auth_header(request))

    @app.get("/router/stats")
    async def stats():
        return {"replicas": router.replicas, "in_flight": router.in_flight, "routed": router.routed}

    @app.get("/health")
    async def health():
        return Response(status_code=200)
    return app


@contextlib.contextmanager
def router_in_thread(router: Router):
    """The router app under uvicorn in a background thread on a free localhost port (tests, benches)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def main(args: argparse.Namespace):
    if bool(args.prefill) != bool(args.decode) or bool(args.prefill) == bool(args.replica):
        raise SystemExit("pagedmoe router: give --replica URL ..., or --prefill URL and --decode URL")
    router = DisaggregatedRouter(args.prefill, args.decode) if args.prefill else Router(args.replica, args.policy)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port)
