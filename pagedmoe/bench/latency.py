"""Latency of one batch: `batch_size` requests submitted together and run to completion, per step timed.

Prefill = the steps that fed prompt tokens (the first step(s); with chunked prefill a long batch takes several),
decode = the steps after, one token per running request. Engine overhead = step time outside the model's
forward and LM head (scheduling, KV block bookkeeping, input preparation, sampling, postprocessing,
detokenizing), as % of the step."""
import time

from tqdm import tqdm

from pagedmoe.bench.roofline import ModelFlops
from pagedmoe.bench.steps import StepRecord, StepRecorder, overhead_pct, records_json, time_stats
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams


def run_batch(llm: LLM, batch: list[BenchRequest], counts: ModelFlops | None) -> tuple[float, list[StepRecord]]:
    """One batch through the engine; returns its wall time and its step records."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in batch]
    with StepRecorder(llm.engine, counts) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    if [len(o.outputs[0].token_ids) for o in outputs] != [r.output_len for r in batch]:
        raise RuntimeError("latency: a request produced a different number of tokens than its output_len")
    return elapsed, recorder.records


def split_prefill(records: list[StepRecord]) -> tuple[list[StepRecord], list[StepRecord]]:
    """Leading steps up to the last one that fed prompt tokens, and the decode steps after them."""
    last_prefill = max((i for i, r in enumerate(records) if not r.is_decode), default=-1)
    return records[:last_prefill + 1], records[last_prefill + 1:]


def batch_figures(elapsed: float, records: list[StepRecord]) -> dict:
    prefill, decode = split_prefill(records)
    return {"latency_s": elapsed, "num_steps": len(records), "prefill_s": sum(r.step_s for r in prefill),
            "num_prefill_steps": len(prefill), "decode_s": sum(r.step_s for r in decode),
            "num_decode_steps": len(decode), "overhead_pct": overhead_pct(records)}


def bench_latency(llm: LLM, batches: list[list[BenchRequest]], num_warmup: int,
                  counts: ModelFlops | None = None) -> dict:
    """Runs num_warmup + len(batches) - num_warmup batches; figures over the measured ones only."""
    iterations, records = [], []
    for index, batch in enumerate(tqdm(batches, desc="latency iterations")):
        elapsed, steps = run_batch(llm, batch, counts)
        if index >= num_warmup:
            iterations.append(batch_figures(elapsed, steps))
            records.append(steps)
    return summarize(iterations, records)


def bench_latency_pair(llm: LLM, plain: LLM, batches: list[list[BenchRequest]], num_warmup: int,
                       counts: ModelFlops | None = None) -> tuple[dict, dict]:
    """bench_latency of two engines with their batches alternating (each batch on llm, then on plain), so a
    host whose speed drifts between minutes slows both alike; the two summaries."""
    runs = {id(llm): ([], []), id(plain): ([], [])}
    for index, batch in enumerate(tqdm(batches, desc="latency iterations (both engines)")):
        for engine in (llm, plain):
            elapsed, steps = run_batch(engine, batch, counts)
            if index >= num_warmup:
                runs[id(engine)][0].append(batch_figures(elapsed, steps))
                runs[id(engine)][1].append(steps)
    return summarize(*runs[id(llm)]), summarize(*runs[id(plain)])


def summarize(iterations: list[dict], records: list[list[StepRecord]]) -> dict:
    splits = [split_prefill(steps) for steps in records]
    every = [r for steps in records for r in steps]
    return {"iterations": iterations, **time_stats([it["latency_s"] for it in iterations], "latency_"),
            **time_stats([it["prefill_s"] for it in iterations], "prefill_"),
            **time_stats([r.step_s for _, decode in splits for r in decode], "decode_step_"),
            **time_stats([r.step_s for r in every], "step_"),
            **time_stats([r.execute_s for r in every], "execute_"),
            **time_stats([r.overhead_s for r in every], "overhead_"),
            "overhead_pct": overhead_pct(every), "decode_overhead_pct": overhead_pct([r for _, d in splits for r in d]),
            "steps": [records_json(steps) for steps in records]}


def spec_summary(stats, spec_tok_s: float, no_spec_tok_s: float) -> dict:
    """vLLM's mean acceptance length (1 + accepted drafts per drafting step), the draft counts, and output
    tok/s with and without speculation."""
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos,
            "mean_acceptance_length": 1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
            "draft_acceptance_rate": stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
            "spec_tok_s": spec_tok_s, "no_spec_tok_s": no_spec_tok_s, "speedup": spec_tok_s / no_spec_tok_s}
