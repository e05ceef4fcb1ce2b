import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedmoe.train.cli import main
from pagedmoe.train.export import export, load_trained

EXPECTED_CLASS = {
    "none": "Qwen3MoeForCausalLM",
    "noisy_topk": "Qwen3MoeForCausalLM",
    "switch": "Qwen3MoeForCausalLM",
    "top2": "Qwen3MoeForCausalLM",
    "sigmoid_bias": "DeepseekV3ForCausalLM",
}


def logits_match(run_dir, out_dir) -> None:
    trained, _ = load_trained(run_dir)
    exported = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, trained.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=1e-6)


def stored_keys(out_dir) -> list[str]:
    with safe_open(str(out_dir / "model.safetensors"), "pt") as handle:
        return list(handle.keys())


@pytest.mark.parametrize("router", list(EXPECTED_CLASS))
def test_export_round_trips_through_transformers(tiny_config, tmp_path, router):
    run_dir = tmp_path / "run"
    main(["train", "--router", router, *config_flags(tiny_config(out_dir=str(run_dir), max_steps=3))])
    out_dir = export(run_dir, tmp_path / "hf")
    assert json.loads((out_dir / "config.json").read_text())["architectures"] == [EXPECTED_CLASS[router]]
    assert not list(out_dir.glob("*.bin"))
    assert not [key for key in stored_keys(out_dir) if "noise" in key]
    logits_match(run_dir, out_dir)


def test_dense_export_round_trips_and_tokenizer_travels(tiny_config, tmp_path):
    run_dir = tmp_path / "run"
    main(["train", "--arch", "dense", *config_flags(tiny_config(out_dir=str(run_dir), max_steps=3))])
    main(["export", str(run_dir), str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    logits_match(run_dir, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.decode(tokenizer("Good morrow.")["input_ids"]) == "Good morrow."


def test_bfloat16_export_halves_the_weights(tiny_config, tmp_path):
    run_dir = tmp_path / "run"
    main(["train", *config_flags(tiny_config(out_dir=str(run_dir), max_steps=2))])
    fp32, bf16 = export(run_dir, tmp_path / "fp32"), export(run_dir, tmp_path / "bf16", dtype="bfloat16")
    ratio = (bf16 / "model.safetensors").stat().st_size / (fp32 / "model.safetensors").stat().st_size
    assert ratio < 0.55
    assert AutoModelForCausalLM.from_pretrained(str(bf16)).dtype == torch.bfloat16


def config_flags(cfg) -> list[str]:
    names = ["out_dir", "tokenizer_dir", "corpus", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "num_experts", "moe_intermediate_size", "dense_intermediate_size", "seq_len", "batch_size", "max_steps",
             "eval_batches", "corpus_fraction", "threads"]
    return [item for name in names for item in ("--" + name.replace("_", "-"), str(getattr(cfg, name)))]


def test_export_with_card_documents_the_run(tiny_config, tmp_path):
    run_dir = tmp_path / "run"
    main(["train", *config_flags(tiny_config(out_dir=str(run_dir), max_steps=2))])
    main(["export", str(run_dir), str(tmp_path / "hf"), "--card-title", "tiny", "--command", "python -m pagedmoe.train train ..."])
    card = (tmp_path / "hf" / "README.md").read_text()
    for expected in ["# tiny", "active per token", "validation loss", "python -m pagedmoe.train train ...", "ROMEO:", "Qwen3MoeForCausalLM"]:
        assert expected in card
