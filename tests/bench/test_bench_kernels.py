"""`pagedmoe bench kernels` runs every path once on tiny settings and reports each figure (not their speed)."""
import json

import torch

from pagedmoe.bench import cpu_kernels as kernels
from pagedmoe.bench.cli import main as bench_main


def test_kernels_bench_reports_every_path(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    args = ["kernels", "--dtypes", "float32", "--rows", "3", "--moe-tokens", "5", "--layers", "1", "--iters", "1",
            "--attention-seqs", "2", "--attention-context", "40", "--prefill-lens", "20",
            "--output-json", str(out)]
    assert bench_main(args) == 0
    result = json.loads(out.read_text())
    linears, moe = result["dtypes"]["float32"]["linears"], result["dtypes"]["float32"]["moe"]
    assert [r["op"] for r in linears] == list(kernels.LINEAR_SHAPES)
    assert all(r[p] > 0 for r in linears for p in ("onednn", "mkl", "kernel"))
    assert moe[0]["tokens"] == 5 and all(moe[0][p] > 0 for p in ("onednn", "loop", "kernel", "layer"))
    attention = result["dtypes"]["float32"]["attention"]
    assert attention[0]["seqs"] == 2 and attention[0]["kv_gb_per_s"] > 0
    assert all(attention[0][p] > 0 for p in ("kernel", "adjacent", "in_l2"))
    prefill = result["dtypes"]["float32"]["prefill_attention"]
    assert prefill[0]["len"] == 20 and all(prefill[0][p] > 0 for p in ("sdpa", "kernel", "kernel_gflops"))
    assert "machine:" in capsys.readouterr().out


def test_without_a_onednn_bf16_path_the_other_paths_run(tmp_path, capsys, monkeypatch):
    """bf16 on an AVX2-only CPU: oneDNN refuses to pack bf16 there, so its column is "-"."""
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", "avx avx2 fma")
    out = tmp_path / "kernels.json"
    args = ["kernels", "--dtypes", "bfloat16", "--rows", "3", "--moe-tokens", "5", "--layers", "1", "--iters", "1",
            "--attention-seqs", "1", "--attention-context", "20", "--prefill-lens", "17", "--output-json", str(out)]
    assert bench_main(args) == 0
    part = json.loads(out.read_text())["dtypes"]["bfloat16"]
    assert all("onednn" not in r and r["mkl"] > 0 and r["kernel"] > 0 for r in part["linears"])
    assert "onednn" not in part["moe"][0] and part["moe"][0]["kernel"] > 0
    assert "  -" in capsys.readouterr().out


def test_block_placements_keep_each_table_in_the_cache():
    tables = torch.tensor([[7, 2, 9], [4, 0, 5]])
    placements = kernels.block_placements(tables, resident_blocks=2)
    assert torch.equal(placements["kernel"], tables)
    assert placements["adjacent"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert placements["in_l2"].tolist() == [[0, 1, 0], [1, 0, 1]]
