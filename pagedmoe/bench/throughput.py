import time

from pagedmoe.bench.baselines import figures
from pagedmoe.bench.roofline import ModelFlops, bandwidth, roofline
from pagedmoe.bench.steps import StepRecorder, overhead_pct, time_stats
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams


def pagedmoe_throughput(llm: LLM, workload: list[BenchRequest], counts: ModelFlops | None = None) -> dict:
    """Offline throughput: every request submitted at once, greedy, ignore_eos, exactly output_len tokens.
    Steps are recorded (engine.step / runner.execute wrapped for the run) to split out the decode steps."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    with StepRecorder(llm.engine, counts) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    result = figures("pagedmoe", workload, elapsed, generated)
    return result | {"steps": step_summary(recorder.records)}


def step_summary(records) -> dict:
    decode = [r for r in records if r.is_decode]
    return {"num_steps": len(records), "num_decode_steps": len(decode),
            "overhead_pct": overhead_pct(records), **time_stats([r.step_s for r in records], "step_"),
            **time_stats([r.step_s for r in decode], "decode_step_"),
            "decode_tokens": sum(r.num_decode_tokens for r in decode),
            "decode_context_tokens": sum(r.context_tokens for r in decode),
            "decode_active_experts": sum(r.active_experts for r in decode),
            "decode_flops": sum(r.flops for r in decode), "step_flops": sum(r.flops for r in records),
            "decode_by_batch": decode_by_batch(decode)}


BATCH_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None))  # None: no upper bound


def decode_by_batch(decode) -> list[dict]:
    """The decode steps by how many sequences they ran: where a workload's small-batch tail spends its time."""
    rows = []
    for low, high in BATCH_BUCKETS:
        if steps := [r for r in decode if low <= r.num_seqs and (high is None or r.num_seqs <= high)]:
            rows.append({"min_seqs": low, "max_seqs": high, "num_steps": len(steps),
                         "total_s": sum(r.step_s for r in steps), "tokens": sum(r.num_decode_tokens for r in steps),
                         "context_tokens": sum(r.context_tokens for r in steps)})
    return rows


def decode_roofline(steps: dict, peak_flop_s: float) -> dict | None:
    """Roofline of the decode-only steps (whole engine.step time), if any ran."""
    if not steps["num_decode_steps"]:
        return None
    return roofline(steps["decode_flops"], steps["decode_step_total_s"], steps["decode_tokens"], peak_flop_s)


def decode_bandwidth(steps: dict, counts: ModelFlops, element_size: int, peak_bytes_s: float) -> dict | None:
    """Bytes the decode-only steps had to read (ModelFlops.decode_bytes) against the measured read bandwidth."""
    if not steps["num_decode_steps"]:
        return None
    moved = counts.decode_bytes(steps["num_decode_steps"], steps["decode_active_experts"],
                                steps["decode_context_tokens"], element_size)
    return bandwidth(moved, steps["decode_step_total_s"], peak_bytes_s)


def best_of_repeats(run, repeats: int) -> dict:
    """The fastest of `repeats` runs (the machine's speed drifts between minutes), with every run's output
    tok/s beside it."""
    return fastest([run() for _ in range(repeats)])


def fastest(runs: list[dict]) -> dict:
    """The run with the most output tok/s, with every run's output tok/s beside it."""
    best = max(runs, key=lambda row: row["output_tok_s"])
    return best | {"repeats_output_tok_s": [row["output_tok_s"] for row in runs]}
