import json
from pathlib import Path

import pytest
import transformers

from conftest import save_random_model

from pagedmoe import LLM
from pagedmoe.bench.latency import split_prefill
from pagedmoe.bench.roofline import model_flops
from pagedmoe.bench.steps import StepRecord, StepRecorder
from pagedmoe.bench.workload import random_workload
from pagedmoe.entrypoints.cli import main as cli_main
from pagedmoe.sampling_params import SamplingParams

BATCH, INPUT_LEN, OUTPUT_LEN = 3, 20, 5


def test_bench_latency_splits_prefill_and_decode(dense_model, tmp_path):
    out = tmp_path / "latency.json"
    cli_main(["bench", "latency", "--model", dense_model[0], "--batch-size", str(BATCH), "--input-len",
              str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--num-iters", "2", "--num-iters-warmup", "1",
              "--dtype", "float32", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32",
              "--output-json", str(out)])
    results = json.loads(out.read_text())
    lat = results["pagedmoe"]
    assert results["batch_size"] == BATCH and len(lat["iterations"]) == 2 and len(lat["steps"]) == 2
    for iteration, steps in zip(lat["iterations"], lat["steps"]):
        # 3 x 20 prompt tokens at 32 per step: step 1 prefills A and 12 of B, step 2 decodes A and prefills the
        # rest (8 of B, 20 of C); 4 more tokens each: A finishes a step before B and C
        assert [s["num_prefill_tokens"] for s in steps] == [32, 28, 0, 0, 0, 0]
        assert [s["num_decode_tokens"] for s in steps] == [0, 1, 3, 3, 3, 2]
        assert [s["num_sampled"] for s in steps] == [1, 3, 3, 3, 3, 2]
        assert (iteration["num_prefill_steps"], iteration["num_decode_steps"]) == (2, 4)
        assert iteration["prefill_s"] == pytest.approx(sum(s["step_s"] for s in steps[:2]))
        assert all(0 < s["execute_s"] <= s["step_s"] for s in steps)
        assert 0 <= iteration["overhead_pct"] <= 100
    assert 0 <= lat["overhead_pct"] <= 100 and 0 <= lat["decode_overhead_pct"] <= 100
    assert lat["decode_step_count"] == 8 and lat["decode_step_p50_ms"] > 0 and lat["prefill_mean_ms"] > 0


def test_step_flops_sum_to_the_workload_flops(dense_model):
    llm = LLM(dense_model[0], dtype="float32", num_kv_blocks=64, skip_tokenizer_init=True,
              max_num_batched_tokens=16)
    counts = model_flops(llm.engine.runner.model, llm.engine.config.hf_config)
    workload = random_workload(4, (5, 30), (1, 6), 320, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    with StepRecorder(llm.engine, counts) as recorder:
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload], params, use_tqdm=False)
    assert sum(r.flops for r in recorder.records) == counts.workload_flops(workload)
    assert sum(r.num_sampled for r in recorder.records) == sum(r.output_len for r in workload)
    assert type(llm.engine.runner).__name__ == "ModelRunner" and "step" not in vars(llm.engine)  # restored


def record(prefill: int, decode: int) -> StepRecord:
    return StepRecord(1.0, 0.5, 0.4, 1, prefill + decode, prefill, decode, 1, 0, 0, 0)


def test_split_prefill_takes_steps_up_to_the_last_prefill():
    steps = [record(8, 0), record(0, 2), record(4, 2), record(0, 3), record(0, 3)]
    prefill, decode = split_prefill(steps)
    assert prefill == steps[:3] and decode == steps[3:]
    assert split_prefill([record(0, 1)]) == ([], [record(0, 1)])


def test_decode_steps_record_context_and_distinct_experts(tmp_path):
    config = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    save_random_model(config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, skip_tokenizer_init=True)
    counts = model_flops(llm.engine.runner.model, llm.engine.config.hf_config)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with StepRecorder(llm.engine, counts) as recorder:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    decode = [r for r in recorder.records if r.is_decode]
    assert [r.context_tokens for r in decode] == [3 + 5 + 2 * i for i in range(1, 4)]  # positions 0..start
    assert all(4 <= r.active_experts <= 8 for r in decode)  # per layer: 2 tokens x top-2 hit 2 to 4 experts


def test_bench_latency_with_speculation_runs_the_same_batches_without_it(dense_model, tmp_path):
    """--speculative-config: the batches also on the engine without speculation, in the same invocation;
    a copy-heavy workload (--prompt-repeats) gives the drafts something to find; decode steps that verify
    drafts still count as decode steps."""
    out = tmp_path / "latency.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    cli_main(["bench", "latency", "--model", dense_model[0], "--batch-size", "2", "--input-len", "24",
              "--output-len", "40", "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32",
              "--prompt-repeats", "3", "--speculative-config", spec, "--output-json", str(out)])
    results = json.loads(out.read_text())
    summary = results["spec_decode"]
    assert results["pagedmoe-no-spec"]["latency_count"] == results["pagedmoe"]["latency_count"] == 1
    assert summary["num_draft_tokens"] > 0
    mean = 1 + summary["num_accepted_tokens"] / summary["num_drafts"]
    assert summary["mean_acceptance_length"] == pytest.approx(mean)
    assert summary["speedup"] == pytest.approx(summary["spec_tok_s"] / summary["no_spec_tok_s"])
    decode_s = {name: results[name]["iterations"][0]["decode_s"] for name in ("pagedmoe", "pagedmoe-no-spec")}
    assert summary["decode_speedup"] == pytest.approx(decode_s["pagedmoe-no-spec"] / decode_s["pagedmoe"])
    steps = results["pagedmoe"]["steps"][0]
    assert sum(s["num_prefill_tokens"] for s in steps) == 2 * 24  # verifying drafts is decoding, not prefill
    decode_steps = [s for s in steps if s["num_prefill_tokens"] == 0]
    assert len(decode_steps) == len(steps) - 1
    assert sum(s["num_decode_tokens"] for s in decode_steps) == \
        sum(s["num_sampled"] for s in decode_steps) + summary["num_draft_tokens"]  # 1 + its drafts each


def test_prompt_repeats_builds_copy_heavy_prompts():
    from pagedmoe.bench.workload import repeat_segments
    workload = repeat_segments(random_workload(3, (10, 12), (4, 4), 320, seed=2), 3)
    for r in workload:
        segment = r.prompt_token_ids[:len(r.prompt_token_ids) // 3]
        assert r.prompt_token_ids[:3 * len(segment)] == segment * 3 and 10 <= len(r.prompt_token_ids) <= 12
    with pytest.raises(ValueError, match="prompt-repeats"):
        repeat_segments(workload, 0)


def test_the_two_engines_alternate_batch_by_batch(monkeypatch):
    """With and without speculation, each batch runs on both engines back to back (drift hits both alike);
    warm-up batches are run but not counted."""
    from pagedmoe.bench import latency
    order = []
    monkeypatch.setattr(latency, "run_batch", lambda engine, batch, counts: order.append((engine, batch)) or
                        (0.5 if engine == "spec" else 1.0, []))
    spec, plain = latency.bench_latency_pair("spec", "plain", ["b0", "b1", "b2"], num_warmup=1)
    assert order == [(e, b) for b in ("b0", "b1", "b2") for e in ("spec", "plain")]
    assert (spec["latency_count"], spec["latency_mean_ms"], plain["latency_mean_ms"]) == (2, 500.0, 1000.0)


def test_a_dataset_too_short_for_the_batches_is_a_value_error(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"ROMEO {i}:"}, {"from": "gpt", "value": "Ay, me!"}]}
            for i in range(3)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    bundled = str(Path(__file__).resolve().parents[2] / "models" / "pagedmoe-moe-default")
    with pytest.raises(ValueError, match="--dataset: 3 usable rows.*needs 4"):
        cli_main(["bench", "latency", "--model", bundled, "--dataset", str(tmp_path / "rows.json"),
                  "--batch-size", "2", "--num-iters", "1", "--num-iters-warmup", "1"])
