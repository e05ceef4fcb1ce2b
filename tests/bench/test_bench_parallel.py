"""`pagedmoe bench parallel` on a tiny MoE checkpoint: every configuration reports its figures with the same
tokens (the bench raises otherwise), and the EPLB run on the bundled model reports its rebalances."""
import json

from conftest import save_random_model, tiny_moe_config
from pagedmoe.bench.cli import main as bench_main


def test_parallel_bench_reports_each_config(tmp_path, capsys):
    model, out = tmp_path / "moe", tmp_path / "parallel.json"
    save_random_model(tiny_moe_config(), model)
    assert bench_main(["parallel", "--model", str(model), "--num-requests", "2", "--input-len", "8", "--output-len",
                       "4", "--eplb-requests", "2", "--eplb-output-len", "12", "--eplb-step-interval", "4",
                       "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["configs"]) == ["1 process", "TP=2", "EP=2", "DP=2+EP"]
    assert all(r["output_tok_s"] > 0 for r in result["configs"].values())
    assert result["configs"]["TP=2"]["comm_ms_per_step"]["all_reduce"] > 0
    assert len(result["eplb"]["rebalances"]) >= 2 and [r["ranks"] for r in result["eplb"]["what_if"]] == [2, 4, 8]
    assert "machine:" in capsys.readouterr().out
