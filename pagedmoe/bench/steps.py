"""Per-step timing of an LLMEngine, from the outside: while a StepRecorder is active, the engine's `step` and
its `runner` are wrapped (instance attributes only; the engine's code is untouched) and every step that ran
a forward leaves a StepRecord. Step time minus the model's own forward (and LM head) is the engine overhead:
scheduling, block bookkeeping, input preparation, sampling, postprocessing, detokenizing."""
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pagedmoe.bench.roofline import ModelFlops, synchronize


@dataclass
class StepRecord:
    step_s: float  # the whole engine.step()
    execute_s: float  # engine.runner.execute() inside it (input prep, forward, sampling)
    forward_s: float  # the model's forward and compute_logits inside execute
    num_seqs: int
    num_tokens: int  # tokens fed this step
    num_prefill_tokens: int  # prompt tokens (or recomputed tokens after a preemption)
    num_decode_tokens: int  # one token per decoding sequence (1 + its drafts with speculative decoding)
    num_sampled: int  # sequences that sampled a token
    flops: int  # model FLOPs of the step (roofline.ModelFlops rules)
    context_tokens: int  # KV positions the decoding sequences attended over
    active_experts: int  # distinct experts routed to, summed over MoE layers

    @property
    def is_decode(self) -> bool:
        return self.num_prefill_tokens == 0

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.forward_s


def classify(sched, counts: ModelFlops | None) -> dict:
    """Splits a SchedulerOutput (read before execute, so num_computed_tokens is the chunk start)."""
    prefill = decode = sampled = flops = context = 0
    for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
        start, num_drafts = seq.num_computed_tokens, len(seq.spec_token_ids)  # a decode verifies its drafts
        is_decode = num_new == 1 + num_drafts and start >= seq.num_prompt_tokens and start == len(seq) - 1
        decode, prefill = decode + is_decode * num_new, prefill + (0 if is_decode else num_new)
        context += (start + 1) * is_decode
        samples = start + num_new == len(seq) + num_drafts
        sampled += samples
        flops += counts.chunk_flops(start, num_new, samples) if counts else 0
    return {"num_seqs": len(sched.seqs), "num_tokens": prefill + decode, "num_prefill_tokens": prefill,
            "num_decode_tokens": decode, "num_sampled": sampled, "flops": flops, "context_tokens": context}


class _TimedModel:
    """Stands in for runner.model: times the forward and the LM head."""

    def __init__(self, model, recorder: "StepRecorder"):
        self._model, self._recorder = model, recorder

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        synchronize(self._recorder.engine.config.device)
        self._recorder.forward_s += time.perf_counter() - start
        return out

    def __call__(self, *args):
        return self._timed(self._model, *args)

    def compute_logits(self, hidden):
        return self._timed(self._model.compute_logits, hidden)


class _TimedRunner:
    """Stands in for engine.runner: times execute, forwards every other attribute."""

    def __init__(self, runner, recorder: "StepRecorder"):
        self._runner, self._recorder = runner, recorder

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, sched):
        info = classify(sched, self._recorder.counts)
        self._recorder.forward_s = 0.0
        start = time.perf_counter()
        out = self._runner.execute(sched)
        synchronize(self._runner.device)
        info["active_experts"] = 0 if out.expert_load is None else int((out.expert_load > 0).sum())
        self._recorder.pending = (time.perf_counter() - start, self._recorder.forward_s, info)
        return out


class StepRecorder:
    """with StepRecorder(engine, counts) as rec: ... -> rec.records, one per step that executed."""

    def __init__(self, engine, counts: ModelFlops | None = None):
        self.engine, self.counts = engine, counts
        self.records: list[StepRecord] = []
        self.pending, self.forward_s = None, 0.0

    def __enter__(self):
        self._step, self._runner = self.engine.step, self.engine.runner
        self._model = self._runner.model
        self._runner.model = _TimedModel(self._model, self)
        self.engine.runner = _TimedRunner(self._runner, self)
        self.engine.step = self._timed_step
        return self

    def __exit__(self, *exc):
        self._runner.model = self._model
        self.engine.runner = self._runner
        vars(self.engine).pop("step", None)

    def _timed_step(self):
        self.pending = None
        start = time.perf_counter()
        outputs = self._step()
        elapsed = time.perf_counter() - start
        if self.pending is not None:
            execute_s, forward_s, info = self.pending
            self.records.append(StepRecord(elapsed, execute_s, forward_s, **info))
        return outputs


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100))


def time_stats(values: list[float], prefix: str = "") -> dict:
    """mean / p50 / p99 / min / max / total in milliseconds (total in seconds)."""
    if not values:
        return {f"{prefix}count": 0}
    ms = [v * 1e3 for v in values]
    return {f"{prefix}count": len(ms), f"{prefix}mean_ms": statistics.fmean(ms), f"{prefix}p50_ms": percentile(ms, 50),
            f"{prefix}p99_ms": percentile(ms, 99), f"{prefix}min_ms": min(ms), f"{prefix}max_ms": max(ms),
            f"{prefix}total_s": sum(values)}


def overhead_pct(records: list[StepRecord]) -> float:
    """Time outside the model forward as a percentage of the steps' total time."""
    total = sum(r.step_s for r in records)
    return 100 * sum(r.overhead_s for r in records) / total if total else float("nan")


def records_json(records: list[StepRecord]) -> list[dict]:
    return [asdict(r) | {"is_decode": r.is_decode} for r in records]
