"""HF transformers baselines on the same checkpoint and workload, greedy, exactly output_len useful tokens each.

Each baseline is timed from its first request to its last result; model loading and (for hf-cb) the
continuous batching manager's setup and teardown are outside the timing, as the engine's init is."""
import logging
import math
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from pagedmoe.bench.workload import BenchRequest

HF_STATIC_BATCH_SIZE = 16


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_sequential(model_dir: str, dtype: torch.dtype, workload: list[BenchRequest], device: str = "cpu") -> dict:
    """HF `generate`, one request at a time."""
    model = load_hf_model(model_dir, dtype, device)
    generated = []
    start = time.perf_counter()
    for req in tqdm(workload, desc="hf-sequential"):
        ids = torch.tensor([req.prompt_token_ids], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.output_len,
                             min_new_tokens=req.output_len, do_sample=False, pad_token_id=0)
        generated.append(out.shape[1] - ids.shape[1])
    return figures("hf-sequential", workload, time.perf_counter() - start, generated)


def left_padded(requests: list[BenchRequest], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of a batch, left-padded with token 0 to its longest prompt."""
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros(len(requests), width, dtype=torch.long)
    for row, req in enumerate(requests):
        ids[row, width - len(req.prompt_token_ids):] = torch.tensor(req.prompt_token_ids)
        mask[row, width - len(req.prompt_token_ids):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_static(model_dir: str, dtype: torch.dtype, workload: list[BenchRequest], device: str = "cpu",
              batch_size: int = HF_STATIC_BATCH_SIZE) -> dict:
    """HF `generate` on static batches of `batch_size` requests in workload order, left padding + attention
    mask; each batch runs to its longest output_len. Only each request's own output_len tokens count as
    useful output; `generated_tokens` in the result also counts the tokens past it."""
    model = load_hf_model(model_dir, dtype, device)
    batches = [workload[i:i + batch_size] for i in range(0, len(workload), batch_size)]
    generated, computed = [], 0
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf-static"):
        ids, mask = left_padded(batch, device)
        steps = max(r.output_len for r in batch)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0)
        generated += [out.shape[1] - ids.shape[1]] * len(batch)
        computed += (out.shape[1] - ids.shape[1]) * len(batch)
    result = figures("hf-static", workload, time.perf_counter() - start, generated)
    return result | {"batch_size": batch_size, "generated_tokens": computed}


@torch.inference_mode()
def hf_cb(model_dir: str, dtype: torch.dtype, workload: list[BenchRequest], device: str = "cpu",
          page_size: int = 16, max_batch_tokens: int = 2048) -> dict:
    """transformers' own continuous batching (the manager behind `model.generate_batch`). generate_batch takes
    one max_new_tokens for every prompt, so the requests go through the same manager's add_request, which
    takes a per-request max_new_tokens (EOS disabled). The paged cache is sized to hold the whole workload
    (no evictions), the token budget per batch is the engine's max_num_batched_tokens."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    model = load_hf_model(model_dir, dtype, device)
    max_out = max(r.output_len for r in workload)
    gen_config = GenerationConfig(max_new_tokens=max_out, do_sample=False, eos_token_id=-1, pad_token_id=0)
    num_blocks = sum(math.ceil((len(r.prompt_token_ids) + r.output_len) / page_size) for r in workload)
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks + 1,
                                         max_batch_tokens=max_batch_tokens)
    hints = WorkloadHints(max(len(r.prompt_token_ids) for r in workload), max_out, len(workload))
    with _quiet_cb_logger(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints,
            block=True, timeout=5) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1)
               for r in workload]
        results = _collect(manager, set(ids))
        elapsed = time.perf_counter() - start
    generated = [len(results[i].generated_tokens) for i in ids]
    return figures("hf-cb", workload, elapsed, generated) | {"page_size": page_size, "num_blocks": num_blocks + 1,
                                                             "max_batch_tokens": max_batch_tokens}


def _collect(manager, pending: set[str]) -> dict:
    results = {}
    with tqdm(total=len(pending), desc="hf-cb") as bar:
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("hf-cb: the continuous batching thread stopped early")
                continue
            if result.is_finished() and result.request_id in pending:
                if result.error is not None:
                    raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
                pending.discard(result.request_id)
                bar.update(1)
    return results


class _quiet_cb_logger:
    """The CB manager logs an ERROR on CPU without psutil although num_blocks is given; silence that."""

    def __enter__(self):
        self.logger = logging.getLogger("ContinuousBatchingLogger")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def figures(name: str, workload: list[BenchRequest], elapsed: float, generated: list[int]) -> dict:
    """Throughput figures over USEFUL output: each request's own output_len. Fewer tokens is an error."""
    short = [i for i, (r, n) in enumerate(zip(workload, generated)) if n < r.output_len]
    if short:
        raise RuntimeError(f"{name}: requests {short[:8]} produced fewer tokens than their output_len")
    num_out = sum(r.output_len for r in workload)
    num_in = sum(len(r.prompt_token_ids) for r in workload)
    return {"engine": name, "elapsed_s": elapsed, "num_requests": len(workload), "input_tokens": num_in,
            "output_tokens": num_out, "output_tok_s": num_out / elapsed, "total_tok_s": (num_in + num_out) / elapsed,
            "requests_s": len(workload) / elapsed}


def run_baseline(name: str, model_dir: str, dtype: torch.dtype, workload: list[BenchRequest], device: str,
                 args) -> dict:
    if name == "hf-static":
        return hf_static(model_dir, dtype, workload, device, args.hf_batch_size)
    if name == "hf-cb":
        return hf_cb(model_dir, dtype, workload, device, max_batch_tokens=args.max_num_batched_tokens)
    if name == "pagedmoe-float32":
        return pagedmoe_float32(workload, args)
    if name == "llama.cpp":
        from pagedmoe.bench.llamacpp import llama_cpp_baseline
        return llama_cpp_baseline(model_dir, workload, args)
    if name == "vllm":
        from pagedmoe.bench.vllm_peer import vllm_baseline
        return vllm_baseline(model_dir, str(dtype).removeprefix("torch."), workload, args)
    return BASELINES[name](model_dir, dtype, workload, device)


def pagedmoe_float32(workload: list[BenchRequest], args) -> dict:
    """pagedmoe itself with the same engine arguments in float32, the reference dtype: the speed-up of a
    faster --dtype, measured in the same invocation."""
    from pagedmoe.bench.throughput import pagedmoe_throughput
    from pagedmoe.entrypoints.cli import engine_kwargs
    from pagedmoe.llm import LLM
    from pagedmoe.bench.roofline import matmul_peak, model_flops, roofline
    llm = LLM(args.model, **engine_kwargs(args) | {"dtype": "float32", "skip_tokenizer_init": True})
    counts = model_flops(llm.engine.runner.model, llm.engine.config.hf_config)
    peak = matmul_peak(torch.float32, args.device, args.peak_matmul_size, args.peak_repeats)
    row = pagedmoe_throughput(llm, workload, counts) | {"engine": "pagedmoe-float32", "float32_peak": peak}
    return row | {"float32_roofline": roofline(counts.workload_flops(workload), row["elapsed_s"],
                                               row["output_tokens"], peak["peak_flop_s"])}


BASELINES = {"hf-sequential": hf_sequential, "hf-static": hf_static, "hf-cb": hf_cb}
BASELINE_NAMES = [*BASELINES, "llama.cpp", "pagedmoe-float32", "vllm"]
