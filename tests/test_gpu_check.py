"""The prepared device run, checked on the CPU: scripts/gpu_bench.sh --dry-run runs gpu_check.py's kernel
checks in Triton's interpreter (a fresh process: no TRITON_INTERPRET, triton imported before the kernels) and
writes a report that must pass the schema; bad arguments are refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

pytest.importorskip("triton")


def test_dry_run_writes_a_valid_report_of_passing_kernels(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "would run: timeout 80" in done.stdout and "--model runs/bench-models/qwen3-moe-100m-active" in done.stdout
    report = json.loads((tmp_path / "check.json").read_text())
    gpu_check.check_schema(report)
    assert report["dry_run"] and report["device"] == "cpu"
    assert {k["name"] for k in report["kernels"]} == {name for name, _, _ in gpu_check.kernel_cases(True)}
    assert all(k["passed"] for k in report["kernels"])
    assert report["graphs"]["status"] == report["decode_bandwidth"]["status"] == "skipped"
    assert json.loads((tmp_path / "summary.json").read_text())["check"] == report


@pytest.mark.parametrize("argv", [[], ["--out", "x.json", "--decode-batch", "0"], ["--out", "x", "--bogus"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2


def test_the_shell_script_refuses_unknown_arguments(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", "--bogus"], cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_schema_names_the_bad_field():
    report = dict(schema=1, device="cpu", dry_run=True, seconds=1.0, graphs={"status": "skipped"},
                  decode_bandwidth={"status": "measured"},
                  kernels=[dict(name="decode", dtype="float32", max_abs_error=0.0, tolerance=1e-4, passed=True)])
    gpu_check.check_schema(report)
    for field, bad in [("seconds", "1"), ("dry_run", 1), ("kernels", None)]:
        with pytest.raises(ValueError, match=f"'{field}'"):
            gpu_check.check_schema({**report, field: bad})
    with pytest.raises(ValueError, match="'passed'"):
        gpu_check.check_schema({**report, "kernels": [{**report["kernels"][0], "passed": "yes"}]})
    with pytest.raises(ValueError, match="'graphs'"):
        gpu_check.check_schema({**report, "graphs": {"status": "fine"}})
