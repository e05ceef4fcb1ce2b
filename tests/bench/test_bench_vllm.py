"""The vllm baseline's harness, without vLLM: a stand-in `vllm` package on PYTHONPATH plays the engine, so
these tests check what crosses the process boundary (the same token ids reach both engines, the lengths, the
bindings, the start-up figures) and the argument handling. Benchmarks are not tests: vLLM itself never runs."""
import itertools
import json
import sys
import textwrap

import pytest

from pagedmoe.bench.vllm_driver import workload_digest
from pagedmoe.bench.vllm_peer import check_vllm_python, thread_bindings
from pagedmoe.entrypoints.cli import main as cli_main

FAKE_VLLM = """
import json, os, time
class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens
class _Completion:
    def __init__(self, n): self.token_ids = [7] * n
class _Output:
    def __init__(self, prompt, n): self.prompt_token_ids, self.outputs = prompt, [_Completion(n)]
class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("fake vllm: no engine today")
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"kwargs": kwargs, "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}) + "\\n")
    def generate(self, prompts, params, use_tqdm=True):
        if len(prompts) > 1 and os.environ.get("FAKE_VLLM_HANG"):
            time.sleep(60)
        if "FAKE_ORDER_LOG" in os.environ and len(prompts) > 1:
            with open(os.environ["FAKE_ORDER_LOG"], "a") as f:
                f.write("vllm\\n")
        print("a vLLM log line on stdout")
        drop = int(os.environ.get("FAKE_VLLM_DROP_TOKEN", "0"))
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [_Output(p["prompt_token_ids"][drop:], s.max_tokens) for p, s in zip(prompts, params)]
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids): return {'prompt_token_ids': prompt_token_ids}\n")
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def bench_args(model_dir: str, out, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", model_dir, "--num-prompts", "4", "--input-len", "4-12",
            "--output-len", "2-6", "--dtype", "float32", "--num-kv-blocks", "64", "--peak-matmul-size", "64",
            "--peak-repeats", "1", "--output-json", str(out), *extra]


def test_vllm_baseline_gets_the_same_workload_under_both_bindings(dense_model, tmp_path, fake_vllm, capsys):
    out = tmp_path / "bench.json"
    cli_main(bench_args(dense_model[0], out, "--baseline", "vllm", "--vllm-python", sys.executable,
                        "--max-num-seqs", "16"))
    results = json.loads(out.read_text())
    vllm, ours = results["vllm"], results["pagedmoe"]
    assert vllm["output_tokens"] == ours["output_tokens"] and vllm["input_tokens"] == ours["input_tokens"]
    assert set(vllm["bindings"]) == {"auto", "all-cores"} and vllm["binding"] in ("auto", thread_bindings()["all-cores"])
    assert vllm["output_tok_s"] == max(row["output_tok_s"] for row in vllm["bindings"].values())
    assert results["ratio_vs_vllm"] == pytest.approx(ours["output_tok_s"] / vllm["output_tok_s"])
    assert ours["startup_to_first_token_s"] > 0 and all(r["startup_to_first_token_s"] > 0
                                                        for r in vllm["bindings"].values())
    runs = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert [r["bind"] for r in runs] == list(thread_bindings().values())
    assert runs[0]["kwargs"]["dtype"] == "float32" and runs[0]["kwargs"]["max_num_seqs"] == 16
    assert "start-up to first token" in capsys.readouterr().out


def test_repeats_run_each_engine_n_times_and_keep_the_fastest(dense_model, tmp_path, fake_vllm):
    out = tmp_path / "bench.json"
    cli_main(bench_args(dense_model[0], out, "--baseline", "vllm", "--vllm-python", sys.executable,
                        "--repeats", "3"))
    results = json.loads(out.read_text())
    ours, vllm = results["pagedmoe"], results["vllm"]
    assert len(ours["repeats_output_tok_s"]) == 3 and ours["output_tok_s"] == max(ours["repeats_output_tok_s"])
    assert results["args"]["enable_prefix_caching"] is False  # no repeat finds the last one's prompts cached
    for row in vllm["bindings"].values():
        assert len(row["repeats_output_tok_s"]) == 3
        assert row["output_tok_s"] == pytest.approx(max(row["repeats_output_tok_s"]))
    assert len(fake_vllm.read_text().splitlines()) == 2  # one start-up per binding, not per repeat
    with pytest.raises(ValueError, match="--repeats"):
        cli_main(bench_args(dense_model[0], out, "--repeats", "0"))


def test_other_prompts_reaching_vllm_fail_the_run(dense_model, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_DROP_TOKEN", "1")
    with pytest.raises(RuntimeError, match="other prompts"):
        cli_main(bench_args(dense_model[0], tmp_path / "b.json", "--baseline", "vllm", "--vllm-python", sys.executable))


def test_interleave_alternates_the_engines_runs_and_keeps_each_pairs_ratio(text_model, tmp_path, fake_vllm,
                                                                          monkeypatch, capsys):
    import pagedmoe.bench.throughput as throughput
    order = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_ORDER_LOG", str(order))
    ours = throughput.pagedmoe_throughput

    def logged(*args):
        with open(order, "a") as f:
            f.write("pagedmoe\n")
        return ours(*args)
    monkeypatch.setattr(throughput, "pagedmoe_throughput", logged)
    out = tmp_path / "bench.json"
    cli_main(bench_args(text_model[0], out, "--baseline", "vllm", "--vllm-python", sys.executable,
                        "--repeats", "2", "--interleave", "--settle-timeout", "0.5"))
    assert order.read_text().split() == ["vllm", "pagedmoe"] * 4  # two pairs per binding
    assert len(fake_vllm.read_text().splitlines()) == 2  # vLLM started once per binding
    results = json.loads(out.read_text())
    ours_runs, vllm = results["pagedmoe"]["repeats_output_tok_s"], results["vllm"]
    assert len(ours_runs) == 4 and results["pagedmoe"]["output_tok_s"] == max(ours_runs)
    pairs = vllm["paired_ratios"]
    assert pairs["auto"] == pytest.approx([o / v for o, v in zip(ours_runs[:2],
                                                                  vllm["bindings"]["auto"]["repeats_output_tok_s"])])
    assert results["ratio_vs_vllm_paired"] == pytest.approx(min(sum(r) / 2 for r in pairs.values()))
    assert "median pair on the worse binding" in capsys.readouterr().out


def test_interleave_needs_the_vllm_baseline(text_model, tmp_path):
    with pytest.raises(ValueError, match="--interleave"):
        cli_main(bench_args(text_model[0], tmp_path / "b.json", "--interleave"))


@pytest.mark.parametrize("failure", ["FAKE_VLLM_FAIL", "FAKE_VLLM_HANG"])
def test_a_vllm_that_fails_or_falls_silent_is_reported_not_waited_on(text_model, tmp_path, fake_vllm,
                                                                      monkeypatch, failure):
    monkeypatch.setenv(failure, "1")
    with pytest.raises(RuntimeError, match="vllm baseline failed or fell silent") as error:
        cli_main(bench_args(text_model[0], tmp_path / "b.json", "--baseline", "vllm", "--vllm-python",
                            sys.executable, "--vllm-timeout", "3"))
    assert failure != "FAKE_VLLM_FAIL" or "no engine today" in str(error.value)


def test_vllm_python_is_required_and_checked_before_any_run(dense_model, tmp_path):
    with pytest.raises(ValueError, match="--vllm-python"):
        cli_main(bench_args(dense_model[0], tmp_path / "b.json", "--baseline", "vllm"))
    with pytest.raises(ValueError, match="not an executable"):
        check_vllm_python(str(tmp_path / "missing" / "python"))
    assert not (tmp_path / "b.json").exists()


def test_workload_digest_is_order_and_length_sensitive():
    base = workload_digest([[1, 2], [3]], [4, 5])
    assert base == workload_digest([[1, 2], [3]], [4, 5])
    assert base != workload_digest([[3], [1, 2]], [5, 4]) and base != workload_digest([[1, 2], [3]], [4, 6])


def test_all_cores_binding_names_the_allowed_cpus(monkeypatch):
    import pagedmoe.bench.vllm_peer as peer
    monkeypatch.setattr(peer, "allowed_cpus", lambda: {0, 1, 2, 3})
    assert peer.thread_bindings() == {"auto": "auto", "all-cores": "0-3"}
    monkeypatch.setattr(peer, "allowed_cpus", lambda: {0, 2, 5})
    assert peer.thread_bindings()["all-cores"] == "0,2,5"


def test_vllm_serve_gets_the_same_scheduler_limits():
    import argparse
    from pagedmoe.bench.vllm_peer import vllm_serve_command
    args = argparse.Namespace(max_num_seqs=16, max_num_batched_tokens=512, long_prefill_token_threshold=0)
    command = vllm_serve_command("py", "m", 8000, "float32", args)
    assert command[command.index("--max-num-batched-tokens") + 1] == "512"
    assert "--long-prefill-token-threshold" not in command  # vLLM's default, 0, as pagedmoe's
    args.long_prefill_token_threshold = 128
    command = vllm_serve_command("py", "m", 8000, "float32", args)
    assert command[command.index("--long-prefill-token-threshold") + 1] == "128"


FAKE_API_SERVER = """
import argparse, json, os
from pagedmoe.entrypoints.cli import main
parser = argparse.ArgumentParser()
for flag in ("--model", "--port", "--dtype", "--max-num-seqs", "--max-num-batched-tokens"):
    parser.add_argument(flag)
args = parser.parse_args()
with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
    f.write(json.dumps({"bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "dtype": args.dtype}) + "\\n")
main(["serve", args.model, "--port", args.port, "--dtype", args.dtype, "--max-num-seqs", args.max_num_seqs,
      "--num-kv-blocks", "64", "--log-level", "warning"])
"""


def test_vllm_serve_baseline_runs_the_same_arrivals_per_binding(text_model, tmp_path, fake_vllm):
    """The stand-in `vllm.entrypoints.openai.api_server` serves with pagedmoe itself: what is checked is the
    harness (command, environment, health wait, sweep per binding, the better binding on top)."""
    server_dir = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    server_dir.mkdir(parents=True)
    (server_dir / "api_server.py").write_text(textwrap.dedent(FAKE_API_SERVER))
    out = tmp_path / "serve.json"
    cli_main(["bench", "serve", "--model", text_model[0], "--server", "inprocess", "--num-prompts", "3",
              "--input-len", "4-12", "--output-len", "3-6", "--request-rate", "inf", "--dtype", "float32",
              "--num-kv-blocks", "64", "--max-num-seqs", "8", "--timeout", "120", "--baseline", "vllm",
              "--vllm-python", sys.executable, "--output-json", str(out)])
    results = json.loads(out.read_text())
    vllm = results["vllm"]
    assert set(vllm["bindings"]) == {"auto", "all-cores"}
    assert [r["bind"] for r in map(json.loads, fake_vllm.read_text().splitlines())] == list(thread_bindings().values())
    for row in [*results["rates"], *vllm["rates"]]:
        assert (row["completed"], row["failed"]) == (3, 0), row["errors"]
    assert vllm["rates"][0]["output_tokens"] == results["rates"][0]["output_tokens"]
    assert results["startup_to_first_token_s"] > 0 and vllm["startup_to_first_token_s"] > 0


def test_interleaved_sweep_runs_each_rate_on_every_server_before_the_next(monkeypatch):
    import asyncio

    import pagedmoe.bench.serve as serve
    calls = []

    async def fake_run_rate(url, model, workload, rate, seed, deadline, request_timeout):
        calls.append((rate, url, model, workload))
        return [serve.RequestResult(ok=True, ttft_s=0.1, e2e_s=0.4, itl_s=[0.1] * 3, output_tokens=4)], 2.0
    monkeypatch.setattr(serve, "run_rate", fake_run_rate)
    targets = {"pagedmoe": ("http://a", "m"), "auto": ("http://b", "n")}
    swept = asyncio.run(serve.interleaved_sweep(targets, [["w0"], ["w1"]], [0.5, 2.0], 0, None, None, 60, 60))
    assert calls == [(0.5, "http://a", "m", ["w0"]), (0.5, "http://b", "n", ["w0"]),
                     (2.0, "http://a", "m", ["w1"]), (2.0, "http://b", "n", ["w1"])]
    assert [row["request_rate"] for row in swept["auto"]["rates"]] == [0.5, 2.0]
    assert swept["pagedmoe"]["rates"][1]["output_tok_s"] == 2.0 and set(swept["pagedmoe"]["requests"]) == {"0.5", "2.0"}


def test_vllm_serve_interleaved_keeps_every_server_up_through_the_sweep(text_model, tmp_path, fake_vllm):
    server_dir = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    server_dir.mkdir(parents=True)
    (server_dir / "api_server.py").write_text(textwrap.dedent(FAKE_API_SERVER))
    out = tmp_path / "serve.json"
    cli_main(["bench", "serve", "--model", text_model[0], "--server", "inprocess", "--num-prompts", "3",
              "--input-len", "4-12", "--output-len", "3-6", "--request-rate", "inf", "8", "--dtype", "float32",
              "--num-kv-blocks", "64", "--max-num-seqs", "8", "--timeout", "120", "--baseline", "vllm",
              "--vllm-python", sys.executable, "--interleave", "--settle-timeout", "0.5", "--output-json", str(out)])
    results = json.loads(out.read_text())
    vllm = results["vllm"]
    assert set(vllm["bindings"]) == {"auto", "all-cores"} and len(fake_vllm.read_text().splitlines()) == 2
    for row in [*results["rates"], *vllm["rates"], *vllm["bindings"]["auto"]["rates"]]:
        assert (row["completed"], row["failed"]) == (3, 0), row["errors"]
    assert [r["output_tokens"] for r in vllm["rates"]] == [r["output_tokens"] for r in results["rates"]]
    assert results["startup_to_first_token_s"] > 0 and vllm["startup_to_first_token_s"] > 0
    with pytest.raises(ValueError, match="--interleave"):
        cli_main(["bench", "serve", "--model", text_model[0], "--interleave"])


def test_quiet_cpus_are_waited_for_until_a_second_in_a_row_is_quiet(monkeypatch):
    import pagedmoe.bench.quiet as quiet
    monkeypatch.setattr(quiet.time, "sleep", lambda s: None)
    busy_per_window = iter([100, 60, 10, 10, 90, 10, 10, 10, 10, 100])  # of 100 ticks a window, on 2 CPUs
    state = {"busy": 0, "total": 0}

    def ticks():
        state["busy"] += next(busy_per_window)
        state["total"] += 100
        return state["busy"], state["total"]
    quiet.wait_for_quiet_cpus(60, ticks=ticks, num_cpus=2)
    assert next(busy_per_window) == 100  # four quiet windows (0.2 cores) after the 90 ended it, not the two before
    busy_per_window = itertools.repeat(15)  # 0.3 cores a window, under a quarter of 2 CPUs: not quiet
    state.update(busy=0, total=0)
    assert quiet.wait_for_quiet_cpus(0.01, ticks=ticks, num_cpus=2) >= 0.01
    state.update(busy=0, total=0)
    always_busy = iter(range(10 ** 6))
    assert quiet.wait_for_quiet_cpus(0.01, ticks=lambda: (next(always_busy) * 100, next(always_busy) * 100)) >= 0.01
    assert quiet.wait_for_quiet_cpus(60, ticks=lambda: None) < 1  # no /proc/stat: no wait
    assert quiet.cpu_ticks() is None or quiet.cpu_ticks()[1] >= quiet.cpu_ticks()[0] > 0
