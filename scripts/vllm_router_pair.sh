#!/usr/bin/env bash
# Two pagedmoe replicas of the bundled model (KV events on) behind vLLM's own router, vllm-router (PyPI):
#   VLLM_ROUTER=/path/to/venv/bin/vllm-router scripts/vllm_router_pair.sh cache_aware|kv_aware|round_robin
# Six requests sharing a system prompt go through it (replica 2 warmed with that prompt first); each
# replica's prompt tokens and prefix-cache hits are printed. See README, "Routing across replicas".
set -u
PM=${PAGEDMOE_PYTHON:-.venv/bin/python}; VR=${VLLM_ROUTER:?set VLLM_ROUTER to a vllm-router binary (pip install vllm-router, in a venv of its own)}; POLICY=${1:-cache_aware}
for i in 1 2; do
  $PM -m pagedmoe serve --port 810$i --num-threads 1 --num-kv-blocks 256 --log-level warning \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:556$i\", \"topic\": \"kv@r$i\"}" &
done
sleep 1
for i in 1 2; do until curl -sf localhost:810$i/health >/dev/null; do sleep 0.5; done; done
EXTRA=""
[ "$POLICY" = kv_aware ] && EXTRA="--kv-event-source http://127.0.0.1:8101=tcp://127.0.0.1:5561 --kv-event-source http://127.0.0.1:8102=tcp://127.0.0.1:5562 --kv-event-model pagedmoe-moe-default"
$VR --worker-urls http://127.0.0.1:8101 http://127.0.0.1:8102 --policy $POLICY --port 8190 $EXTRA --log-level warning > "${TMPDIR:-/tmp}/vllm-router.log" 2>&1 &
until curl -sf localhost:8190/health >/dev/null 2>&1 || curl -sf localhost:8190/v1/models >/dev/null 2>&1; do sleep 0.5; done
$PM - <<'PY'
import httpx, re
system = "You are the herald of Verona; speak in the measured tone of the court. " * 10
import time
httpx.post("http://127.0.0.1:8102/v1/completions", json={"model": "pagedmoe-moe-default", "prompt": system + "Warm.", "max_tokens": 2}, timeout=60)
time.sleep(1.0)  # the router reads replica 2's BlockStored events
for q in ["Who comes?", "What news?", "Where is Romeo?", "Is it day?", "Who knocks?", "What hour?"]:
    r = httpx.post("http://127.0.0.1:8190/v1/completions", json={"model": "pagedmoe-moe-default", "prompt": system + q, "max_tokens": 8, "temperature": 0}, timeout=60)
    print(r.status_code, repr(r.json()["choices"][0]["text"][:30]))
for port in (8101, 8102):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    get = lambda n: sum(float(v) for v in re.findall(rf"^pagedmoe:{n}_total{{.*}} (\S+)$", text, re.M))
    print(port, "prompt tokens", get("prompt_tokens"), "prefix hits", get("prefix_cache_hits"), "of", get("prefix_cache_queries"))
PY
kill %1 %2 %3 2>/dev/null; wait 2>/dev/null
