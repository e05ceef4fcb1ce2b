"""The CPU tile kernels against the paths they replace, in one invocation: each linear shape of the 100M bench
models at decode-sized row counts (oneDNN's packed GEMM, MKL on the plain weight, the tile kernel), and a
12-layer MoE stack (the oneDNN expert loop, the plain expert loop, the fused kernel). Weights rotate over
`--layers` copies so they come from memory, as in a decode step; each figure is the best of `--iters`,
the paths interleaved so drift hits them alike. The MoE stack's "layer" path is FusedMoE as the engine runs
it with the kernels attached (the fused kernel, AMX per expert or oneDNN by batch size). Decode attention:
the paged kernel over `--layers` caches of the 100M models' shape (4 KV heads of 64, 3 query heads each), each
sequence's blocks scattered, at adjacent ids, and on the same 4 blocks (in L2): memory against arithmetic.
Prefill attention: one sequence's `--prefill-lens` positions, the context gather + causal SDPA that the
PyTorch backend runs against the prefill kernel (layers/attention/cpu_prefill.py)."""
# Not bench/kernels.py: vllm_driver.py runs from this folder, and transformers imports a package named "kernels".
import argparse
import json
import time

import torch
import torch.nn.functional as F

from pagedmoe.cpu_info import describe_cpu
from pagedmoe.layers.attention.cpu_kernel import PagedDecodeKernel
from pagedmoe.layers.attention.cpu_prefill import PagedPrefillKernel
from pagedmoe.layers.cpu_linear import CpuLinear
from pagedmoe.layers.linear import attach_cpu_kernels, can_pack, pack_weight, packed_linear
from pagedmoe.layers.moe.cpu_kernel import CpuFusedMoE
from pagedmoe.layers.moe.fused_moe import fused_experts
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig, select_experts

LINEAR_SHAPES = {"qkv": (1280, 768), "o_proj": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
                 "lm_head": (32000, 768)}


def best_of(fns: dict, iters: int) -> dict[str, float]:
    """Seconds per call of each fn (one call covers every layer copy), best of iters, interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(iters):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def linear_paths(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    """oneDNN's packed GEMM only where it takes the dtype (not bf16 without native bf16)."""
    kernels = [CpuLinear(w, max_rows=x.shape[0]) for w in weights]
    paths = {"mkl": lambda: [F.linear(x, w) for w in weights], "kernel": lambda: [k(x) for k in kernels]}
    if can_pack(weights[0]):
        packed = [pack_weight(w) for w in weights]
        paths["onednn"] = lambda: [packed_linear(x, p) for p in packed]
    return paths


def bench_linears(dtype: torch.dtype, rows: list[int], layers: int, iters: int) -> list[dict]:
    results = []
    for name, (n, k) in LINEAR_SHAPES.items():
        weights = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(layers if name != "lm_head" else 2)]
        for m in rows:
            seconds = best_of(linear_paths(weights, torch.randn(m, k).to(dtype)), iters)
            results.append({"op": name, "rows": m, **{p: s / len(weights) * 1e3 for p, s in seconds.items()},
                            "kernel_gflops": 2 * m * n * k / (seconds["kernel"] / len(weights)) / 1e9})
    return results


def moe_layers(dtype: torch.dtype, layers: int) -> list[tuple[FusedMoE, CpuFusedMoE]]:
    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        layer = FusedMoE(8, 768, 1024, RouterConfig(top_k=2, renormalize=True), dtype=dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(std=0.02)
        layer.pack()
        stack.append((layer, CpuFusedMoE(layer.w13, layer.w2)))
    return stack


def engine_layers(dtype: torch.dtype, stack) -> list[FusedMoE]:
    """Copies of the stack's layers with the CPU kernels attached, as the model runner attaches them."""
    layers = []
    for layer, _ in stack:
        copy = FusedMoE(8, 768, 1024, RouterConfig(top_k=2, renormalize=True), dtype=dtype)
        copy.load_state_dict(layer.state_dict())
        attach_cpu_kernels(copy, {"moe"}, min_bytes=0)
        layers.append(copy)
    return layers


def moe_paths(stack, engine: list[FusedMoE], x: torch.Tensor) -> dict:
    routes = [select_experts(layer.router, layer.router_logits(x), None) for layer, _ in stack]
    pairs = list(zip(stack, routes))
    paths = {"loop": lambda: [fused_experts(x, m.w13, m.w2, *r, use_grouped_mm=False) for (m, _), r in pairs],
             "kernel": lambda: [k(x, *r) for (_, k), r in pairs],
             "layer": lambda: [e.routed_output(x, *r) for e, r in zip(engine, routes)]}
    if stack[0][0].packed_experts is not None:  # oneDNN took the dtype
        paths["onednn"] = lambda: [fused_experts(x, m.w13, m.w2, *r, packed=m.packed_experts) for (m, _), r in pairs]
    return paths


def bench_moe_stack(dtype: torch.dtype, tokens: list[int], layers: int, iters: int) -> list[dict]:
    stack, results = moe_layers(dtype, layers), []
    engine = engine_layers(dtype, stack)
    expert_bytes = sum(t.numel() for t in (stack[0][0].w13, stack[0][0].w2)) * stack[0][0].w13.element_size()
    for m in tokens:
        x = torch.randn(m, 768).to(dtype)
        with torch.inference_mode():
            seconds = best_of(moe_paths(stack, engine, x), iters)
        per_layer = {p: s / layers * 1e3 for p, s in seconds.items()}
        results.append({"op": "moe", "tokens": m, **per_layer,
                        "kernel_gb_per_s": expert_bytes / (per_layer["kernel"] / 1e3) / 1e9})
    return results


def attention_problem(dtype, num_seqs: int, context: int, layers: int, block_size: int = 16):
    """Caches of `layers` layers, each sequence's blocks scattered; contexts spread over [context / 2, context]."""
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    caches = [torch.randn(2 * 4, num_blocks, block_size, 64, generator=g).to(dtype) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * blocks_per_seq].view(num_seqs, -1).contiguous()
    seq_lens = torch.randint(context // 2, context + 1, (num_seqs,), generator=g)
    return torch.randn(num_seqs, 12, 64, generator=g).to(dtype), caches, tables, seq_lens


def block_placements(tables: torch.Tensor, resident_blocks: int = 4) -> dict[str, torch.Tensor]:
    """The same contexts at three places in the cache: scattered block ids ("kernel", as a busy pool leaves
    them), each sequence's blocks at adjacent ids, and every sequence on the same few blocks, so that the KV
    stays in L2: how much of the kernel's time is memory and how much its arithmetic."""
    ids = torch.arange(tables.numel()).view_as(tables)
    return {"kernel": tables, "adjacent": ids.contiguous(), "in_l2": (ids % resident_blocks).contiguous()}


def bench_attention(dtype: torch.dtype, batches: list[int], context: int, layers: int, iters: int) -> list[dict]:
    kernel, results = PagedDecodeKernel(dtype), []
    for num_seqs in batches:
        q, caches, tables, seq_lens = attention_problem(dtype, num_seqs, context, layers)
        fns = {name: (lambda t=t: [kernel(q, c, t, seq_lens, 0.125) for c in caches])
               for name, t in block_placements(tables).items()}
        per_layer = {name: s / layers * 1e3 for name, s in best_of(fns, iters).items()}
        kv_bytes = 2 * 4 * 64 * int(seq_lens.sum()) * caches[0].element_size()
        results.append({"op": "attention", "seqs": num_seqs, "context": context, **per_layer,
                        "kv_gb_per_s": kv_bytes / per_layer["kernel"] * 1e3 / 1e9})
    return results


def prefill_paths(q: torch.Tensor, caches: list[torch.Tensor], table: torch.Tensor) -> dict:
    kernel, seq_len = PagedPrefillKernel(q.dtype), q.shape[0]

    def sdpa(cache):
        context = cache[:, table].flatten(1, 2)[:, :seq_len]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], context[None, :4], context[None, 4:],
                                              is_causal=True, scale=0.125, enable_gqa=True)
    return {"sdpa": lambda: [sdpa(c) for c in caches],
            "kernel": lambda: [kernel(q, c, table, seq_len, 0.125) for c in caches]}


def bench_prefill_attention(dtype: torch.dtype, lens: list[int], layers: int, iters: int) -> list[dict]:
    results = []
    for seq_len in lens:
        _, caches, tables, _ = attention_problem(dtype, 1, seq_len, layers)
        q = torch.randn(seq_len, 12, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        seconds = best_of(prefill_paths(q, caches, tables[0]), iters)
        flops = 4 * 12 * 64 * seq_len * (seq_len + 1) / 2  # the causal half, QK^T and PV
        results.append({"op": "prefill_attention", "len": seq_len, **{p: s / layers * 1e3 for p, s in seconds.items()},
                        "kernel_gflops": flops / (seconds["kernel"] / layers) / 1e9})
    return results


def cell(row: dict, path: str, width: int, digits: int) -> str:
    """A path's figure, or "-" where it did not run (oneDNN without a bf16 path)."""
    return f"{row[path]:>{width}.{digits}f}" if path in row else f"{'-':>{width}}"


def format_lines(result: dict) -> list[str]:
    lines = [f"machine: {result['machine']}, {result['threads']} threads"]
    for dtype, part in result["dtypes"].items():
        lines.append(f"{dtype} linears, ms per call (weights from memory):   onednn      mkl   kernel  kernel GFLOP/s")
        lines += [f"  {r['op']:<8} rows {r['rows']:>4}  {cell(r, 'onednn', 28, 3)} {r['mkl']:>8.3f} {r['kernel']:>8.3f}"
                  f" {r['kernel_gflops']:>10.0f}" for r in part["linears"]]
        lines.append(f"{dtype} MoE layer (8 experts 768 -> 1024, top-2), ms:  onednn     loop   kernel    layer"
                     "  all-expert GB/s")
        lines += [f"  tokens {r['tokens']:>4}  {cell(r, 'onednn', 37, 2)} {r['loop']:>8.2f} {r['kernel']:>8.2f}"
                  f" {r['layer']:>8.2f} {r['kernel_gb_per_s']:>10.1f}" for r in part["moe"]]
        lines.append(f"{dtype} decode attention per layer, ms, blocks:      scattered adjacent    in L2  KV GB/s")
        lines += [f"  seqs {r['seqs']:>4} context <= {r['context']:<5} {r['kernel']:>21.3f} {r['adjacent']:>8.3f}"
                  f" {r['in_l2']:>8.3f} {r['kv_gb_per_s']:>8.1f}" for r in part["attention"]]
        lines.append(f"{dtype} prefill attention per layer (one sequence), ms:      sdpa   kernel  kernel GFLOP/s")
        lines += [f"  len {r['len']:>5} {r['sdpa']:>44.3f} {r['kernel']:>8.3f} {r['kernel_gflops']:>10.0f}"
                  for r in part["prefill_attention"]]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench kernels", description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--attention-seqs", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--attention-context", type=int, default=256)
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "dtypes": {}}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        result["dtypes"][name] = {"linears": bench_linears(dtype, args.rows, args.layers, args.iters),
                                  "moe": bench_moe_stack(dtype, args.moe_tokens, args.layers, args.iters),
                                  "attention": bench_attention(dtype, args.attention_seqs, args.attention_context,
                                                               args.layers, args.iters),
                                  "prefill_attention": bench_prefill_attention(dtype, args.prefill_lens, args.layers,
                                                                               args.iters)}
    print("\n".join(format_lines(result)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
