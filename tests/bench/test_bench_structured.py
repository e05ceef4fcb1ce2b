"""`pagedmoe bench structured` on the bundled model, tiny: it reports compile times and both tok/s, and each
unconstrained twin generated exactly its constrained request's number of tokens (the run asserts it)."""
import json

from pagedmoe.bench.cli import main as bench_main


def test_structured_bench_reports_both_batches(tmp_path, capsys):
    out = tmp_path / "structured.json"
    assert bench_main(["structured", "--num-requests", "3", "--max-tokens", "120", "--iters", "1",
                       "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["json_schema_tok_s"] > 0 and result["unconstrained_tok_s"] > 0
    assert set(result["compile"]) == {"setup_ms", "cold_ms", "cached_ms"}
    assert result["runs"][0]["num_tokens"] > 3
    assert "machine:" in capsys.readouterr().out
