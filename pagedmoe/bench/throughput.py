import time

from pagedmoe.bench.baselines import _figures
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams


def pagedmoe_throughput(llm: LLM, workload: list[BenchRequest]) -> dict:
    """Offline throughput: every request submitted at once, greedy, ignore_eos, exactly output_len tokens."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r.output_len for r in workload]
    return _figures("pagedmoe", workload, elapsed)
