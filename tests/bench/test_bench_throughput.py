import json

from pagedmoe.bench.workload import parse_range, random_workload
from pagedmoe.entrypoints.cli import main as cli_main


def test_workload_is_seeded_and_in_range():
    a = random_workload(8, (4, 9), (2, 5), vocab_size=100, seed=3)
    assert a == random_workload(8, (4, 9), (2, 5), vocab_size=100, seed=3)
    assert all(4 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert parse_range("32-256") == (32, 256) and parse_range("7") == (7, 7)


def test_bench_throughput_with_baseline_writes_json(dense_model, tmp_path):
    out = tmp_path / "bench.json"
    cli_main(["bench", "throughput", "--model", dense_model[0], "--num-prompts", "4", "--input-len", "4-12",
              "--output-len", "2-6", "--dtype", "float32", "--baseline", "hf-sequential",
              "--output-json", str(out)])
    results = json.loads(out.read_text())
    ours, hf = results["pagedmoe"], results["hf-sequential"]
    assert ours["output_tokens"] == hf["output_tokens"] > 0
    assert results["ratio_vs_hf-sequential"] == ours["output_tok_s"] / hf["output_tok_s"]
