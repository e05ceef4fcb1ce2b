import json

from pagedmoe.train.compare import compare


def test_compare_writes_table_json_and_plot(tiny_config, tmp_path):
    table = compare(tiny_config(max_steps=4), tmp_path / "cmp", ["none", "switch", "sigmoid_bias"], tmp_path / "cv.png")
    rows = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert [row["router"] for row in rows] == ["none", "switch", "sigmoid_bias"]
    assert rows[0]["dropped"] == 0 and rows[1]["dropped"] > 0
    assert rows[2]["params_total"] > rows[0]["params_total"] > rows[1]["params_active"]
    assert all(len(row["end_cv"]) == 2 for row in rows)
    assert table.count("\n") == 2 + len(rows)
    assert (tmp_path / "cv.png").stat().st_size > 10_000
