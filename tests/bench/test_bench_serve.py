import json
import math

from pagedmoe.bench.serve import RequestResult, arrival_times, meets_slo, rate_figures
from pagedmoe.bench.server import serve_command
from pagedmoe.entrypoints.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_serve_against_an_inprocess_server(text_model, tmp_path):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    cli_main(["bench", "serve", "--model", text_model[0], "--server", "inprocess", "--num-prompts", "4",
              "--input-len", "4-12", "--output-len", "3-6", "--request-rate", "8", "inf", "--dtype", "float32",
              "--num-kv-blocks", "64", "--slo-ttft", "60", "--slo-itl", "60", "--timeout", "120",
              "--plot", str(plot), "--output-json", str(out)])
    results = json.loads(out.read_text())
    assert [row["request_rate"] for row in results["rates"]] == [8.0, math.inf]
    prompts = [w["input_tokens"] for w in results["workload"]]
    assert len(prompts) == 2  # each rate gets its own 4 prompts
    for row, workload in zip(results["rates"], results["workload"]):
        assert (row["num_requests"], row["completed"], row["failed"]) == (4, 4, 0), row["errors"]
        assert row["output_tokens"] == workload["output_tokens"]  # every request streamed its max_tokens
        for name in ("ttft", "itl", "tpot", "e2e"):
            assert 0 <= row[f"{name}_p50_ms"] <= row[f"{name}_p99_ms"]
        assert row["ttft_p99_ms"] <= row["e2e_p99_ms"] and row["output_tok_s"] > 0
        assert row["goodput_requests"] == 4  # generous SLOs: all requests meet them
    for requests in results["requests"].values():
        assert all(len(r["itl_s"]) <= r["output_tokens"] - 1 for r in requests)
    assert plot.read_bytes().startswith(PNG_MAGIC) and plot.stat().st_size > 1000


def test_poisson_arrivals_are_seeded_and_increasing():
    times = arrival_times(200, rate=4.0, seed=1)
    assert times == arrival_times(200, rate=4.0, seed=1) and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert 30 < times[-1] < 70  # 199 gaps of mean 0.25 s
    assert arrival_times(3, rate=math.inf, seed=1) == [0.0, 0.0, 0.0]


def test_goodput_uses_ttft_and_per_request_itl():
    fast = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=5)  # TPOT (0.5 - 0.1) / 4 = 0.1
    slow = RequestResult(ok=True, ttft_s=0.1, e2e_s=2.1, output_tokens=5)  # TPOT 0.5
    assert fast.mean_itl_s == 0.1 and meets_slo(fast, 0.2, 0.2) and not meets_slo(slow, 0.2, 0.2)
    assert not meets_slo(fast, 0.05, None) and meets_slo(slow, None, None)
    failed = RequestResult(error="HTTP 500")
    row = rate_figures(2.0, [fast, slow, failed], duration=2.0, slo_ttft=0.2, slo_itl=0.2)
    assert (row["completed"], row["failed"], row["goodput_requests"]) == (2, 1, 1)
    assert row["output_tok_s"] == 5.0 and row["goodput_req_s"] == 0.5 and row["errors"] == ["HTTP 500"]
    assert row["e2e_p50_ms"] == 1300.0


def test_serve_subprocess_command_carries_engine_options():
    command = serve_command("/m", 1234, {"dtype": "float32", "num_kv_blocks": None, "enable_prefix_caching": True,
                                         "skip_tokenizer_init": False, "max_num_seqs": 8})
    assert command[1:6] == ["-m", "pagedmoe", "serve", "/m", "--port"]
    assert command[command.index("--dtype") + 1] == "float32" and "--enable-prefix-caching" in command
    assert "--num-kv-blocks" not in command and "--skip-tokenizer-init" not in command
    assert command[command.index("--max-num-seqs") + 1] == "8"
