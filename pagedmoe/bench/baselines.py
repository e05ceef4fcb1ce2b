import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from pagedmoe.bench.workload import BenchRequest


def load_hf_model(model_dir: str, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_sequential(model_dir: str, dtype: torch.dtype, workload: list[BenchRequest]) -> dict:
    """HF transformers `generate`, one request at a time, greedy, exactly output_len new tokens."""
    model = load_hf_model(model_dir, dtype)
    start = time.perf_counter()
    for req in tqdm(workload, desc="hf-sequential"):
        ids = torch.tensor([req.prompt_token_ids])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.output_len,
                       min_new_tokens=req.output_len, do_sample=False, pad_token_id=0)
    return _figures("hf-sequential", workload, time.perf_counter() - start)


def _figures(name: str, workload: list[BenchRequest], elapsed: float) -> dict:
    num_out = sum(r.output_len for r in workload)
    num_in = sum(len(r.prompt_token_ids) for r in workload)
    return {"engine": name, "elapsed_s": elapsed, "num_requests": len(workload), "output_tokens": num_out,
            "output_tok_s": num_out / elapsed, "total_tok_s": (num_in + num_out) / elapsed,
            "requests_s": len(workload) / elapsed}


BASELINES = {"hf-sequential": hf_sequential}
