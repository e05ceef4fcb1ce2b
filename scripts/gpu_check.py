"""Issue 20's device checks, in one JSON file: every Triton kernel against the PyTorch path on the device
(float32 and bf16; the KV write inside the attention checks), greedy tokens of CUDA graphs against eager, and decode's achieved memory bandwidth against
the device's measured copy bandwidth.

    python scripts/gpu_check.py --out runs/gpu-bench/check.json [--models-dir runs/bench-models]
    python scripts/gpu_check.py --dry-run --out /tmp/check.json   # CPU, tiny shapes: the script itself (CI)

The dry run runs the kernel checks on the CPU (Triton's interpreter) and marks the device-only sections
skipped; either way the report is checked against SCHEMA before it is written."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagedmoe.layers.attention.metadata import Workspace, build_attention_metadata  # noqa: E402
from pagedmoe.layers.attention.mla import MLAPagedAttention  # noqa: E402
from pagedmoe.layers.attention.torch_backend import TorchPagedAttention  # noqa: E402
from pagedmoe.layers.moe.fused_moe import fused_experts  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max abs error; bf16: its 8-bit mantissa on O(1) values
SCHEMA = {"schema": int, "device": str, "dry_run": bool, "seconds": float, "kernels": list, "graphs": dict,
          "decode_bandwidth": dict}
KERNEL_FIELDS = {"name": str, "dtype": str, "max_abs_error": float, "tolerance": float, "passed": bool}
SECTION_STATUSES = ("passed", "failed", "measured", "skipped", "error")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON report's path")
    parser.add_argument("--models-dir", default="runs/bench-models", help="scripts/make_bench_models.py's output")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, device sections skipped")
    parser.add_argument("--decode-batch", type=int, default=32)
    args = parser.parse_args(argv)
    if args.decode_batch < 1:
        parser.error("--decode-batch must be >= 1")
    return args


def paged_inputs(query_lens, seq_lens, block_size, device, seed=0):
    """Block tables over shuffled blocks and the slots of each query token."""
    g = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = torch.tensor(query_lens), torch.tensor(seq_lens)
    per_seq = -(-int(seq_lens.max()) // block_size)
    tables = torch.randperm(per_seq * len(seq_lens), generator=g).view(len(seq_lens), per_seq)
    seq_index = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    positions = torch.arange(int(query_lens.sum())) - starts[seq_index] + (seq_lens - query_lens)[seq_index]
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
    return query_lens, seq_lens, tables, slots.to(device), per_seq * len(seq_lens)


def both_steps(batch, kv_caches, block_size, device, num_splits=None):
    from pagedmoe.layers.attention.triton_backend import build_triton_attention
    query_lens, seq_lens, tables, slots, _ = batch
    meta = build_attention_metadata(query_lens, seq_lens, tables, slots, kv_caches, block_size,
                                    Workspace(kv_caches.dtype, device))
    step = build_triton_attention(query_lens, seq_lens, tables, block_size, device, num_splits)
    step.slot_mapping = slots
    return meta, step


def attention_error(shape: dict, dtype, device) -> float:
    """Standard layout: max |triton - pytorch| over outputs and the written caches."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block"]
    batch = paged_inputs(shape["query_lens"], shape["seq_lens"], block_size, device)
    caches = torch.randn(1, 2 * kv_heads, batch[4], block_size, head_dim, device=device).to(dtype)
    num_tokens = len(batch[3])
    q, k, v = (torch.randn(num_tokens, h, head_dim, device=device).to(dtype) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, device=device) if shape.get("sinks") else None
    window, scale = shape.get("window", 0), head_dim ** -0.5
    triton_caches = caches.clone()
    meta, step = both_steps(batch, caches, block_size, device, shape.get("splits"))
    expected = TorchPagedAttention(0, heads, kv_heads, head_dim, scale, window)(q, k, v, meta, sinks)
    got = step.attend(q, k, v, triton_caches[0], scale, window, sinks)
    return max(max_error(got, expected), max_error(triton_caches, caches))


def mla_error(shape: dict, dtype, device) -> float:
    torch.manual_seed(0)
    heads, latent, rope, block_size = shape["heads"], shape["latent"], shape["rope"], shape["block"]
    batch = paged_inputs(shape["query_lens"], shape["seq_lens"], block_size, device)
    caches = torch.randn(1, 1, batch[4], block_size, latent + rope, device=device).to(dtype)
    num_tokens = len(batch[3])
    q_latent, q_pe = (torch.randn(num_tokens, heads, d, device=device).to(dtype) for d in (latent, rope))
    new_latent, k_pe = (torch.randn(num_tokens, d, device=device).to(dtype) for d in (latent, rope))
    triton_caches = caches.clone()
    meta, step = both_steps(batch, caches, block_size, device, shape.get("splits"))
    expected = MLAPagedAttention(0, heads, latent, rope, 0.1)(q_latent, q_pe, new_latent, k_pe, meta)
    got = step.attend_latent(torch.cat((q_latent, q_pe), -1), torch.cat((new_latent, k_pe), -1), triton_caches[0],
                             latent, 0.1)
    return max(max_error(got, expected), max_error(triton_caches, caches))


def moe_error(shape: dict, dtype, device) -> float:
    """Relative to the output's largest magnitude (bf16 rounds the intermediate activations)."""
    from pagedmoe.layers.moe.triton_moe import triton_fused_experts
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = shape["experts"], shape["hidden"], shape["inter"], shape["tokens"], 2
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, device=device)
    expected = fused_experts(x, w13, w2, weights, ids, shape["activation"], use_grouped_mm=False).float()
    got = triton_fused_experts(x, w13, w2, weights, ids, shape["activation"])
    return max_error(got, expected) / max(expected.abs().max().item(), 1e-6)


def copy_error(shape: dict, dtype, device) -> float:
    """Copy-on-write block copies against the tensor copy (exact)."""
    from pagedmoe.layers.attention.triton_cache_ops import copy_blocks
    from pagedmoe.worker.kv_cache import _copy_blocks
    cache = torch.randn(shape["layers"], 2, shape["blocks"], 16, 64, device=device).to(dtype)
    pairs = [(i, shape["blocks"] - 1 - i) for i in range(shape["blocks"] // 4)]
    expected = cache.clone()
    _copy_blocks(expected, expected, pairs)
    copy_blocks(cache, pairs)
    return max_error(cache, expected)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def kernel_cases(small: bool) -> list[tuple[str, callable, dict]]:
    """(name, error function, shape): tiny on the dry run, serving-sized on the device."""
    scale = 1 if small else 8
    decode = dict(query_lens=[1] * 3, seq_lens=[5, 40 * scale, 17], heads=8, kv_heads=2, head_dim=64, block=16)
    prefill = dict(query_lens=[24 * scale, 7], seq_lens=[40 * scale, 7], heads=8, kv_heads=2, head_dim=64, block=16)
    return [
        ("decode", attention_error, decode),
        ("decode_split", attention_error, {**decode, "splits": 4}),
        ("decode_window_sinks", attention_error, {**decode, "window": 16, "sinks": True, "splits": 2}),
        ("chunked_prefill", attention_error, prefill),
        ("prefill_window_sinks", attention_error, {**prefill, "window": 16, "sinks": True}),
        ("mla_decode", mla_error, dict(query_lens=[1, 1], seq_lens=[9, 30 * scale], heads=16, latent=64, rope=16,
                                       block=16, splits=2)),
        ("mla_prefill", mla_error, dict(query_lens=[12], seq_lens=[20 * scale], heads=16, latent=64, rope=16,
                                        block=16)),
        ("copy_blocks", copy_error, dict(layers=2 * scale, blocks=8 * scale)),
        ("fused_moe_silu", moe_error, dict(experts=8, hidden=64 * scale, inter=32 * scale, tokens=5 * scale,
                                           activation="silu")),
        ("fused_moe_swigluoai", moe_error, dict(experts=8, hidden=64 * scale, inter=32 * scale, tokens=5 * scale,
                                                activation="swigluoai")),
    ]


def check_kernels(device: torch.device, small: bool) -> list[dict]:
    results = []
    for dtype in (torch.float32,) if small else (torch.float32, torch.bfloat16):
        for name, error_of, shape in kernel_cases(small):
            error = error_of(shape, dtype, device)
            results.append(dict(name=name, dtype=str(dtype).removeprefix("torch."), max_abs_error=error,
                                tolerance=TOLERANCE[dtype], passed=error <= TOLERANCE[dtype]))
    return results


def greedy_tokens(model: str, enforce_eager: bool, backend: str) -> tuple[list[list[int]], bool]:
    """The tokens, and whether decode steps ran on captured graphs."""
    from pagedmoe import LLM, SamplingParams
    llm = LLM(model, dtype="float32", device="cuda", skip_tokenizer_init=True, enforce_eager=enforce_eager,
              attention_backend=backend, moe_backend=backend, max_num_seqs=16, max_model_len=512)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(20 + 9 * i)]} for i in range(12)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.runner.decode_graphs is not None


def check_graphs(models_dir: str) -> dict:
    """float32 greedy tokens: graphs (triton) against eager (triton), and against the PyTorch path."""
    result = {"status": "passed"}
    for name in ("qwen3-100m", "qwen3-moe-100m-active"):
        path = os.path.join(models_dir, name)
        (graphs, captured), (eager, _) = greedy_tokens(path, False, "triton"), greedy_tokens(path, True, "triton")
        torch_path = greedy_tokens(path, True, "torch")[0]
        result[name] = dict(captured=captured, graphs_match_eager=graphs == eager,
                            graphs_match_torch_path=graphs == torch_path)
        if graphs != eager or not captured:
            result["status"] = "failed"
    return result


def copy_bandwidth(device: torch.device, num_bytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write), the best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def decode_bandwidth(models_dir: str, batch: int, device: torch.device) -> dict:
    """bf16 dense model: the time of a decode step (from two runs, differing only in output length) against
    the bytes it must read: the weights, and each sequence's KV context."""
    from pagedmoe import LLM, SamplingParams
    llm = LLM(os.path.join(models_dir, "qwen3-100m"), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              max_num_seqs=batch)
    prompts = [{"prompt_token_ids": [(i * 31 + j) % 30000 + 1 for j in range(128)]} for i in range(batch)]
    seconds = {}
    for steps in (1, 129):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
        seconds[steps] = time.perf_counter() - start
    step_s = (seconds[129] - seconds[1]) / 128
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = batch * (128 + 64) * runner.block_bytes // llm.engine.config.block_size  # mean context 192
    achieved = (weight_bytes + kv_bytes) / step_s
    peak = copy_bandwidth(device)
    return dict(status="measured", batch=batch, step_ms=step_s * 1e3, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                achieved_gb_s=achieved / 1e9, copy_peak_gb_s=peak / 1e9, fraction_of_peak=achieved / peak)


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    skipped = {"status": "skipped", "reason": "dry run (CPU)"}
    report = dict(schema=1, device=device_name(device), dry_run=args.dry_run,
                  kernels=check_kernels(device, args.dry_run), graphs=skipped, decode_bandwidth=skipped)
    if not args.dry_run:
        report["graphs"] = guarded(check_graphs, args.models_dir)
        report["decode_bandwidth"] = guarded(decode_bandwidth, args.models_dir, args.decode_batch, device)
    report["seconds"] = time.perf_counter() - start
    return report


def guarded(section, *args) -> dict:
    """A section's result, or its error: one failing section must not cost the others' figures."""
    try:
        return section(*args)
    except Exception as error:  # noqa: BLE001 (the report records it)
        return {"status": "error", "error": f"{type(error).__name__}: {error}"}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def check_schema(report: dict):
    """ValueError naming the first field that is missing or of the wrong type."""
    check_fields(report, SCHEMA)
    for kernel in report["kernels"]:
        check_fields(kernel, KERNEL_FIELDS)
    for name in ("graphs", "decode_bandwidth"):
        if report[name].get("status") not in SECTION_STATUSES:
            raise ValueError(f"report field {name!r}: status must be one of {SECTION_STATUSES}")


def check_fields(record: dict, fields: dict):
    for name, kind in fields.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise ValueError(f"report field {name!r}: expected {kind.__name__}, got {value!r}")


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    check_schema(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    failed = [f"{k['name']} ({k['dtype']})" for k in report["kernels"] if not k["passed"]]
    print(json.dumps(report, indent=1))
    print("FAILED: " + ", ".join(failed) if failed else "all kernels within tolerance")
    return 1 if failed or report["graphs"]["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
