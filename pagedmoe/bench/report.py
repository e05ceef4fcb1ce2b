"""Printed tables and the --output-json file of every `pagedmoe bench` subcommand."""
import json
import math
import platform

import torch
import transformers

from pagedmoe.cpu_info import describe_cpu


def env() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": describe_cpu(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def print_and_save(result: dict, format_lines, path: str | None) -> int:
    """A bench subcommand's ending: its table printed, its figures in --output-json; exit status 0."""
    print("\n".join(format_lines(result)))
    write_json(result, path)
    return 0


def write_json(results: dict, path: str | None):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)


def args_json(args) -> dict:
    return {key: value for key, value in vars(args).items() if key != "func"}


def throughput_table(results: dict, engines: list[str]) -> str:
    lines = [f"machine: {results['env']['cpu']}, {results['env']['threads']} threads",
             f"{'engine':<14}{'output tok/s':>13}{'total tok/s':>12}{'req/s':>8}{'elapsed s':>10}"
             f"{'roofline %':>11}{'pagedmoe x':>11}"]
    for name in engines:
        row, ratio = results[name], results.get(f"ratio_vs_{name}", 1.0)
        lines.append(f"{name:<14}{row['output_tok_s']:>13.1f}{row['total_tok_s']:>12.1f}{row['requests_s']:>8.2f}"
                     f"{row['elapsed_s']:>10.2f}{row.get('roofline_pct', math.nan):>10.2f}%{ratio:>10.2f}x")
    return "\n".join(lines)


def roofline_lines(roof: dict) -> str:
    peak = roof["peak"]
    lines = [f"roofline: peak {peak['peak_flop_s'] / 1e9:.1f} GFLOP/s ({peak['size']}^3 {peak['dtype']} matmul on "
             f"{peak['device']}, best of {peak['repeats']}, {peak['threads']} threads); workload "
             f"{roof['run']['flops'] / 1e9:.3f} GFLOP"]
    for name in ("run", "decode"):
        if roof.get(name):
            lines.append(_roofline_line(name, roof[name]))
    if roof.get("decode_bandwidth"):
        lines.append(_bandwidth_line(roof["decode_bandwidth"], peak["read"]))
    return "\n".join(lines)


def decode_batch_line(rows: list[dict]) -> str:
    parts = [f"{r['min_seqs']}{'+' if r['max_seqs'] is None else '-' + str(r['max_seqs'])}: {r['num_steps']} steps, "
             f"{r['total_s']:.2f} s, {r['total_s'] / r['tokens'] * 1e3:.2f} ms a token" for r in rows]
    return "  decode by sequences a step: " + "; ".join(parts)


def _bandwidth_line(b: dict, read: dict) -> str:
    return (f"  decode memory: read {b['bytes'] / 1e9:.1f} GB (weights {b['weight_bytes'] / 1e9:.1f}, KV "
            f"{b['kv_bytes'] / 1e9:.1f}) in {b['elapsed_s']:.3f} s = {b['achieved_bytes_s'] / 1e9:.1f} GB/s, "
            f"{b['bandwidth_pct']:.1f}% of the {read['peak_bytes_s'] / 1e9:.1f} GB/s read bandwidth measured "
            f"({read['bytes'] >> 20} MiB float32 sum, best of {read['repeats']})")


def _roofline_line(name: str, r: dict) -> str:
    return (f"  {name + ':':<8}achieved {r['achieved_flop_s'] / 1e9:.2f} GFLOP/s = {r['roofline_pct']:.2f}% of peak; "
            f"roofline time {r['roofline_time_s']:.4f} s (measured {r['elapsed_s']:.3f} s); output tok/s "
            f"{r['output_tok_s']:.1f}, at the roofline {r['roofline_output_tok_s']:.1f}")


def latency_lines(result: dict) -> str:
    return "\n".join([
        f"latency: {result['latency_count']} iterations, mean {result['latency_mean_ms']:.1f} ms, "
        f"p50 {result['latency_p50_ms']:.1f} ms, p99 {result['latency_p99_ms']:.1f} ms",
        f"prefill: mean {result['prefill_mean_ms']:.1f} ms per batch",
        f"decode step: mean {result.get('decode_step_mean_ms', math.nan):.2f} ms, "
        f"p50 {result.get('decode_step_p50_ms', math.nan):.2f} ms, "
        f"p99 {result.get('decode_step_p99_ms', math.nan):.2f} ms",
        f"engine overhead (step time outside the model forward): {result['overhead_pct']:.1f}% of step time "
        f"(decode steps {result['decode_overhead_pct']:.1f}%), mean {result['overhead_mean_ms']:.2f} ms per step"])


def spec_line(spec: dict) -> str:
    decode = f", decode phase {spec['decode_speedup']:.2f}x" if "decode_speedup" in spec else ""
    return (f"speculative decoding: {spec['spec_tok_s']:.1f} out tok/s against {spec['no_spec_tok_s']:.1f} without "
            f"({spec['speedup']:.2f}x{decode}); mean acceptance length {spec['mean_acceptance_length']:.2f}, "
            f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens accepted")


def serve_table(rows: list[dict]) -> str:
    lines = [f"{'rate':>6}{'done':>6}{'fail':>5}{'out tok/s':>10}{'goodput':>8}{'TTFT p50':>9}{'p99':>8}"
             f"{'ITL p50':>8}{'p99':>8}{'E2E p50':>9}{'p99':>9}  (ms)"]
    for r in rows:
        lines.append(f"{r['request_rate']:>6g}{r['completed']:>6}{r['failed']:>5}{r['output_tok_s']:>10.1f}"
                     f"{r['goodput_req_s']:>8.2f}{r['ttft_p50_ms']:>9.1f}{r['ttft_p99_ms']:>8.1f}{r['itl_p50_ms']:>8.1f}"
                     f"{r['itl_p99_ms']:>8.1f}{r['e2e_p50_ms']:>9.1f}{r['e2e_p99_ms']:>9.1f}")
    return "\n".join(lines)


def vllm_lines(results: dict) -> str:
    vllm, ours = results["vllm"], results["pagedmoe"]
    lines = [f"vllm: best binding {vllm['binding']!r}; " + ", ".join(
        f"{name} {row['output_tok_s']:.1f} tok/s" for name, row in vllm["bindings"].items())]
    lines.append(f"start-up to first token: pagedmoe {ours['startup_to_first_token_s']:.1f} s, vllm "
                 + ", ".join(f"{n} {r['startup_to_first_token_s']:.1f} s" for n, r in vllm["bindings"].items()))
    if len(ours.get("repeats_output_tok_s", [])) > 1:
        lines.append("every run, out tok/s: pagedmoe " + _runs(ours) + "; " + "; ".join(
            f"vllm {name} {_runs(row)}" for name, row in vllm["bindings"].items()))
    if "paired_ratios" in vllm:
        lines.append("interleaved pairs, pagedmoe / vllm: " + "; ".join(
            f"{name} " + " / ".join(f"{r:.2f}" for r in ratios) for name, ratios in vllm["paired_ratios"].items())
            + f"; median pair on the worse binding {results['ratio_vs_vllm_paired']:.2f}x")
    return "\n".join(lines)


def _runs(row: dict) -> str:
    return " / ".join(f"{tok_s:.1f}" for tok_s in row["repeats_output_tok_s"])
