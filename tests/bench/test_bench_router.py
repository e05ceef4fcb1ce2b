"""`pagedmoe bench router`, tiny: both policies complete every request through the router over two replica
processes and report a hit rate; cache-aware keeps each shared prefix on one replica, so it hits at least as
often as round robin."""
import json

from pagedmoe.bench.cli import main as bench_main


def test_router_bench_reports_both_policies(tmp_path, capsys):
    out = tmp_path / "router.json"
    assert bench_main(["router", "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "4", "--num-requests",
                       "12", "--output-len", "2", "--request-rate", "inf", "--replica-kv-blocks", "64",
                       "--output-json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["policies"]}
    assert set(rows) == {"round_robin", "cache_aware"}
    assert all(r["completed"] == 12 and r["failed"] == 0 and sum(r["routed"]) == 12 for r in rows.values())
    assert rows["cache_aware"]["prefix_hit_rate"] >= rows["round_robin"]["prefix_hit_rate"] > 0
    assert "machine:" in capsys.readouterr().out
