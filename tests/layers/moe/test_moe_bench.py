import math

from pagedmoe.bench.moe import bench_moe, main

TINY = dict(num_tokens=32, hidden_size=16, intermediate_size=8, top_k=2, num_experts=(2, 8), iters=2, warmup=1)


def test_bench_moe_fields():
    result = bench_moe(**TINY, device="cpu")
    assert [(r["dtype"], r["num_experts"]) for r in result["rows"]] == [
        ("float32", 2), ("float32", 8), ("bfloat16", 2), ("bfloat16", 8)]
    assert [r["total_expert_params"] for r in result["rows"][:2]] == [2 * 3 * 16 * 8, 8 * 3 * 16 * 8]
    assert all(r["ms"] > 0 and math.isfinite(r["weight_gb_per_s"]) for r in result["rows"])
    assert set(result["ratios"]) == {"float32", "bfloat16"}
    assert math.isclose(result["ratios"]["float32"], result["rows"][1]["ms"] / result["rows"][0]["ms"])
    assert result["active_expert_params_per_token"] == 2 * 3 * 16 * 8


def test_main_prints_table(capsys):
    main(["--num-tokens", "8", "--hidden-size", "16", "--intermediate-size", "8", "--num-experts", "2", "4",
          "--dtypes", "float32", "--iters", "1", "--warmup", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "ratio float32" in out and "experts" in out
