"""FusedMoE forward time at equal active parameters: few large-count vs many experts (same size, same top-k)."""
import argparse
import statistics
import time

import torch

from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig

TARGET_RATIO = 1.3


def make_layer(num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
               dtype: torch.dtype, device: str, seed: int) -> FusedMoE:
    torch.manual_seed(seed)
    router = RouterConfig("softmax", top_k, renormalize=True)
    layer = FusedMoE(num_experts, hidden_size, intermediate_size, router, dtype=dtype, device=device)
    with torch.no_grad():
        for tensor in layer.state_dict().values():
            tensor.normal_(std=0.02)
    return layer.eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_once(layer: FusedMoE, x: torch.Tensor) -> float:
    synchronize(str(x.device))
    start = time.perf_counter()
    layer(x)
    synchronize(str(x.device))
    return time.perf_counter() - start


def time_interleaved(layers: dict[int, FusedMoE], x: torch.Tensor, iters: int, warmup: int) -> dict[int, float]:
    samples = {num_experts: [] for num_experts in layers}
    with torch.inference_mode():
        for step in range(warmup + iters):
            for num_experts, layer in layers.items():
                elapsed = time_once(layer, x)
                if step >= warmup:
                    samples[num_experts].append(elapsed)
    return {num_experts: statistics.median(times) for num_experts, times in samples.items()}


def active_experts(layer: FusedMoE, x: torch.Tensor) -> int:
    expert_load = torch.zeros(layer.num_experts, dtype=torch.int64, device=x.device)
    with torch.inference_mode():
        layer(x, expert_load)
    return int((expert_load > 0).sum())


def expert_bytes(layer: FusedMoE) -> int:
    return (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()


def bench_rows(layers: dict[int, FusedMoE], x: torch.Tensor, iters: int, warmup: int) -> list[dict]:
    seconds = time_interleaved(layers, x, iters, warmup)
    rows = []
    for num_experts, layer in layers.items():
        weight_bytes = active_experts(layer, x) * expert_bytes(layer)
        rows.append({"dtype": str(x.dtype).removeprefix("torch."), "num_experts": num_experts,
                     "total_expert_params": layer.w13.numel() + layer.w2.numel(),
                     "ms": seconds[num_experts] * 1e3, "weight_gb_per_s": weight_bytes / seconds[num_experts] / 1e9})
    return rows


def bench_moe(num_tokens: int = 256, hidden_size: int = 1024, intermediate_size: int = 1024, top_k: int = 2,
              num_experts: tuple[int, ...] = (8, 64), dtypes: tuple[str, ...] = ("float32", "bfloat16"),
              iters: int = 10, warmup: int = 2, device: str | None = None, seed: int = 0) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows, ratios = [], {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        layers = {e: make_layer(e, hidden_size, intermediate_size, top_k, dtype, device, seed) for e in num_experts}
        x = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
        dtype_rows = bench_rows(layers, x, iters, warmup)
        rows += dtype_rows
        ratios[dtype_name] = dtype_rows[-1]["ms"] / dtype_rows[0]["ms"]
    return {"num_tokens": num_tokens, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "top_k": top_k, "active_expert_params_per_token": top_k * 3 * hidden_size * intermediate_size,
            "device": device, "threads": torch.get_num_threads(), "rows": rows, "ratios": ratios,
            "target_ratio": TARGET_RATIO}


def format_table(result: dict) -> str:
    lines = [f"FusedMoE forward, {result['num_tokens']} tokens, hidden {result['hidden_size']}, "
             f"expert intermediate {result['intermediate_size']}, top-{result['top_k']}, "
             f"device {result['device']}, {result['threads']} threads",
             f"{'dtype':<10}{'experts':>8}{'expert params':>15}{'ms':>10}{'weights GB/s':>14}"]
    for row in result["rows"]:
        lines.append(f"{row['dtype']:<10}{row['num_experts']:>8}{row['total_expert_params']:>15,}"
                     f"{row['ms']:>10.2f}{row['weight_gb_per_s']:>14.1f}")
    for dtype_name, ratio in result["ratios"].items():
        lines.append(f"ratio {dtype_name}: {ratio:.2f}x (target <= {result['target_ratio']}x)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench moe", description=__doc__)
    parser.add_argument("--num-tokens", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_moe(args.num_tokens, args.hidden_size, args.intermediate_size, args.top_k,
                       tuple(args.num_experts), tuple(args.dtypes), args.iters, args.warmup, args.device)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
