"""`pagedmoe bench quantization` on a tiny gpt-oss checkpoint: every form loads and reports its figures (not
their speed), and the 4-bit forms hold fewer weight bytes than float32."""
import json

import pytest
import torch
import transformers

from conftest import VOCAB, save_random_model
from pagedmoe.bench.cli import main as bench_main
from pagedmoe.bench.quantization import resident_weight_bytes


def tiny_gpt_oss(path):
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, intermediate_size=64,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                       max_position_embeddings=512, eos_token_id=None)
    save_random_model(config, path)
    return str(path)


def test_quantization_bench_reports_every_form(tmp_path, capsys):
    out = tmp_path / "quant.json"
    args = ["quantization", "--model", tiny_gpt_oss(tmp_path / "m"), "--batch-sizes", "1", "3", "--input-len", "8",
            "--output-len", "4", "--prefill-prompts", "2", "--prefill-len", "20", "--iters", "1",
            "--output-json", str(out)]
    assert bench_main(args) == 0
    result = json.loads(out.read_text())
    rows = {row["form"]: row for row in result["forms"]}
    assert list(rows) == ["float32", "bfloat16", "mxfp4", "nvfp4"]
    assert all(row["decode_tok_s"]["1"] > 0 and row["decode_tok_s"]["3"] > 0 and row["prefill_tok_s"] > 0
               for row in rows.values())
    assert rows["bfloat16"]["weight_bytes"] < rows["float32"]["weight_bytes"]
    assert max(rows["nvfp4"]["weight_bytes"], rows["mxfp4"]["weight_bytes"]) < rows["bfloat16"]["weight_bytes"]
    assert "machine:" in capsys.readouterr().out


def test_resident_bytes_count_each_storage_once():
    linear = torch.nn.Linear(64, 32)
    model = torch.nn.Sequential(linear, torch.nn.Linear(64, 32))
    model[1].weight = linear.weight  # shared
    model[1].copy = {"packed": [linear.weight.detach().clone()]}  # a packed copy the layer holds
    assert resident_weight_bytes(model) == 4 * (64 * 32 * 2 + 32 * 2)


def test_forms_are_checked():
    with pytest.raises(SystemExit):
        bench_main(["quantization", "--model", "x", "--forms", "int3"])
