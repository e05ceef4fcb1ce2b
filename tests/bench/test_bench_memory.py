from pagedmoe.bench.memory import main


def test_memory_bench_paged_beats_static(tmp_path):
    plot = tmp_path / "util.png"
    static, paged = main(["--num-prompts", "12", "--num-kv-blocks", "160", "--max-tokens", "256",
                          "--plot", str(plot)])
    assert static["mode"] == "static" and paged["mode"] == "paged"
    assert 0 < static["kv_utilization_mean"] < paged["kv_utilization_mean"] <= 1
    assert paged["peak_concurrent_seqs"] > static["peak_concurrent_seqs"]
    assert plot.stat().st_size > 0
