"""`pagedmoe bench disagg`, tiny: one instance and 1P1D each complete every request of the mixed workload, and
the connector's save and load bandwidth is reported; with --connector NixlConnector, 1P1D over NIXL and its
read bandwidth."""
import json

import pytest

from pagedmoe.bench.cli import main as bench_main


def test_disagg_bench_reports_both_setups(tmp_path, capsys):
    out = tmp_path / "disagg.json"
    assert bench_main(["disagg", "--num-requests", "6", "--long-len", "80", "--long-output", "4", "--request-rate",
                       "inf", "--bandwidth-tokens", "64", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["serving"]) == {"1 instance", "1P1D"}
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in result["serving"].values())
    assert result["bandwidth"]["save_mb_s"] > 0 and result["bandwidth"]["load_mb_s"] > 0
    assert "machine:" in capsys.readouterr().out


def test_disagg_bench_over_nixl(tmp_path):
    pytest.importorskip("nixl_cu12")
    out = tmp_path / "disagg.json"
    assert bench_main(["disagg", "--connector", "NixlConnector", "--num-requests", "4", "--long-len", "80",
                       "--long-output", "4", "--request-rate", "inf", "--bandwidth-tokens", "64",
                       "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in result["serving"].values())
    assert result["bandwidth"]["connector"] == "NixlConnector" and result["bandwidth"]["read_mb_s"] > 0
