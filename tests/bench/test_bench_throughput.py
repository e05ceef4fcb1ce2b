import itertools
import json
import sys

import pytest

from pagedmoe.bench.baselines import figures, left_padded
from pagedmoe.bench.workload import BenchRequest, parse_range, random_workload
from pagedmoe.entrypoints.cli import main as cli_main

HF_BASELINES = ["hf-sequential", "hf-static", "hf-cb"]


def test_workload_is_seeded_and_in_range():
    a = random_workload(8, (4, 9), (2, 5), vocab_size=100, seed=3)
    assert a == random_workload(8, (4, 9), (2, 5), vocab_size=100, seed=3)
    assert all(4 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert parse_range("32-256") == (32, 256) and parse_range("7") == (7, 7)


def throughput_args(model_dir: str, out, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", model_dir, "--num-prompts", "5", "--input-len", "4-12",
            "--output-len", "2-6", "--dtype", "float32", "--num-kv-blocks", "64", "--peak-matmul-size", "64",
            "--peak-repeats", "2", "--output-json", str(out), *extra]


def test_bench_throughput_with_hf_baselines_writes_json(dense_model, tmp_path):
    out = tmp_path / "bench.json"
    baselines = [arg for name in HF_BASELINES for arg in ("--baseline", name)]
    cli_main(throughput_args(dense_model[0], out, "--hf-batch-size", "2", *baselines))
    results = json.loads(out.read_text())
    ours = results["pagedmoe"]
    assert ours["output_tokens"] == results["workload"]["output_tokens"] > 0
    for name in HF_BASELINES:
        row = results[name]
        assert row["engine"] == name and row["output_tokens"] == ours["output_tokens"]
        assert row["input_tokens"] == ours["input_tokens"] and row["num_requests"] == 5
        assert results[f"ratio_vs_{name}"] == ours["output_tok_s"] / row["output_tok_s"]
        assert row["roofline_pct"] > 0
    assert results["hf-static"]["generated_tokens"] >= ours["output_tokens"]  # padding to each batch's longest


def test_throughput_roofline_and_decode_steps(dense_model, tmp_path):
    out = tmp_path / "bench.json"
    cli_main(throughput_args(dense_model[0], out))
    results = json.loads(out.read_text())
    roof, steps = results["roofline"], results["pagedmoe"]["steps"]
    assert steps["step_flops"] == roof["run"]["flops"]  # the steps ran exactly the workload's model FLOPs
    assert roof["run"]["roofline_time_s"] == pytest.approx(roof["run"]["flops"] / roof["peak"]["peak_flop_s"])
    assert 0 < roof["run"]["roofline_pct"] == pytest.approx(results["pagedmoe"]["roofline_pct"])
    assert steps["num_decode_steps"] > 0 and roof["decode"]["flops"] == steps["decode_flops"] > 0
    assert 0 < steps["decode_tokens"] <= results["workload"]["output_tokens"] - 5  # the first token is a prefill's
    memory = roof["decode_bandwidth"]
    assert steps["decode_active_experts"] == 0 and steps["decode_context_tokens"] > steps["decode_tokens"]
    assert memory["kv_bytes"] == steps["decode_context_tokens"] * results["model_flops"]["kv_values_per_token"] * 4
    assert memory["bytes"] / memory["elapsed_s"] == pytest.approx(memory["achieved_bytes_s"])
    assert 0 < memory["bandwidth_pct"] and roof["peak"]["read"]["peak_bytes_s"] > 0
    by_batch = steps["decode_by_batch"]  # every decode step in exactly one bucket
    assert sum(row["num_steps"] for row in by_batch) == steps["num_decode_steps"]
    assert sum(row["tokens"] for row in by_batch) == steps["decode_tokens"]
    assert sum(row["total_s"] for row in by_batch) == pytest.approx(steps["decode_step_total_s"])


def test_figures_count_useful_tokens_and_reject_short_outputs():
    workload = [BenchRequest([1, 2, 3], 4), BenchRequest([4], 2)]
    row = figures("x", workload, 2.0, [6, 2])
    assert row["output_tokens"] == 6 and row["output_tok_s"] == 3.0 and row["total_tok_s"] == 5.0
    with pytest.raises(RuntimeError, match="fewer tokens"):
        figures("x", workload, 2.0, [3, 2])


def test_left_padding_and_mask():
    ids, mask = left_padded([BenchRequest([5, 6, 7], 1), BenchRequest([8], 1)], "cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_llama_cpp_missing_package_says_how_to_install(dense_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
        cli_main(throughput_args(dense_model[0], tmp_path / "bench.json", "--baseline", "llama.cpp"))


def test_baseline_choices_are_validated(dense_model, tmp_path):
    with pytest.raises(SystemExit):
        cli_main(throughput_args(dense_model[0], tmp_path / "bench.json", "--baseline", "nope"))


def test_llama_cpp_baseline_on_the_converted_checkpoint(dense_model, tmp_path):
    """Runs only where the optional llama-cpp-python is installed (the test above covers it elsewhere)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from conftest import hf_greedy
    from pagedmoe.bench.llamacpp import convert_to_gguf
    path, model = dense_model
    gguf_path = convert_to_gguf(path, str(tmp_path / "model.gguf"))
    llm = llama_cpp.Llama(gguf_path, n_ctx=64, n_batch=64, verbose=False)
    prompt = [5, 9, 33, 71, 2, 140, 18]
    tokens = list(itertools.islice(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0), 8))
    assert tokens == hf_greedy(model, prompt, 8)  # the conversion (q/k permutation, rope) is exact
    out = tmp_path / "bench.json"
    cli_main(throughput_args(path, out, "--baseline", "llama.cpp"))
    results = json.loads(out.read_text())
    assert results["llama.cpp"]["output_tokens"] == results["pagedmoe"]["output_tokens"] > 0
    assert results["ratio_vs_llama.cpp"] > 0


def test_passthrough_subcommands_get_their_own_options(monkeypatch):
    seen = {}
    monkeypatch.setattr("pagedmoe.bench.moe.main", lambda argv: seen.setdefault("moe", argv))
    cli_main(["bench", "moe", "--num-tokens", "8", "--dtypes", "float32"])
    assert seen["moe"] == ["--num-tokens", "8", "--dtypes", "float32"]


def test_bfloat16_against_pagedmoe_float32_in_one_invocation(dense_model, tmp_path):
    out = tmp_path / "bench.json"
    args = throughput_args(dense_model[0], out, "--baseline", "pagedmoe-float32")
    args[args.index("--dtype") + 1] = "bfloat16"
    cli_main(args)
    results = json.loads(out.read_text())
    ours, fp32 = results["pagedmoe"], results["pagedmoe-float32"]
    assert results["args"]["dtype"] == "bfloat16"
    assert fp32["engine"] == "pagedmoe-float32" and fp32["output_tokens"] == ours["output_tokens"] > 0
    assert fp32["steps"]["num_decode_steps"] > 0 and fp32["float32_peak"]["dtype"] == "float32"
    assert fp32["roofline_pct"] == pytest.approx(fp32["float32_roofline"]["roofline_pct"])
    assert fp32["roofline_pct"] > 0
    assert results["ratio_vs_pagedmoe-float32"] == ours["output_tok_s"] / fp32["output_tok_s"]


def test_background_load_runs_the_workload_again_beside_busy_processes(dense_model, tmp_path, monkeypatch):
    from pagedmoe.bench import background
    started = []
    real = background.background_load

    def recording(num_procs, max_seconds=1800):
        started.append(num_procs)
        return real(num_procs, max_seconds=30)
    monkeypatch.setattr(background, "background_load", recording)
    out = tmp_path / "bench.json"
    cli_main(throughput_args(dense_model[0], out, "--background-load", "1"))
    results = json.loads(out.read_text())
    load = results["background_load"]
    assert started == [1] and load["num_procs"] == 1
    assert results["pagedmoe-loaded"]["output_tokens"] == results["pagedmoe"]["output_tokens"] > 0
    assert load["ratio"] == pytest.approx(load["loaded_output_tok_s"] / load["quiet_output_tok_s"])


def test_background_processes_run_until_stopped_and_end_by_themselves():
    import time

    from pagedmoe.bench.background import background_load
    with background_load(2) as procs:
        time.sleep(0.3)
        assert all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with background_load(1, max_seconds=0.2) as procs:
        assert procs[0].wait(20) == 0  # its own deadline ends it


def test_bench_throughput_with_speculation_runs_the_workload_without_it(dense_model, tmp_path):
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    cli_main(throughput_args(dense_model[0], out, "--prompt-repeats", "3", "--speculative-config", spec))
    results = json.loads(out.read_text())
    summary = results["spec_decode"]
    assert results["pagedmoe-no-spec"]["output_tokens"] == results["pagedmoe"]["output_tokens"]
    assert summary["no_spec_tok_s"] == results["pagedmoe-no-spec"]["output_tok_s"]
    assert summary["speedup"] == results["pagedmoe"]["output_tok_s"] / summary["no_spec_tok_s"]
    assert summary["num_draft_tokens"] > 0
