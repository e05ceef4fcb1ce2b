"""`--baseline vllm`: vLLM's CPU engine on the same model and workload, in vLLM's own virtualenv
(`--vllm-python`, or one made by `pagedmoe bench setup-vllm DIR`), run once per thread binding; the better
binding is the row, both are kept in the JSON. Its driver (vllm_driver.py) runs in that venv and reports the
digest of the prompts it ran, which must equal this side's: the same token ids reach both engines."""
import contextlib
import json
import os
import select
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from pagedmoe.bench.baselines import figures
from pagedmoe.bench.quiet import wait_for_quiet_cpus
from pagedmoe.bench.throughput import fastest
from pagedmoe.bench.vllm_driver import workload_digest
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.worker.cpu_threads import allowed_cpus

DRIVER = Path(__file__).with_name("vllm_driver.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VLLM_VERSION = "0.32.0"


def check_vllm_python(path: str | None) -> str:
    if not path:
        raise ValueError("--vllm-python: the vllm baseline needs vLLM's interpreter, e.g. DIR/bin/python after "
                         "`pagedmoe bench setup-vllm DIR`")
    if not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python: {path!r} is not an executable interpreter")
    return path


def thread_bindings() -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND values: vLLM's default (a core kept for its scheduler) and every allowed core."""
    cpus = sorted(allowed_cpus())
    every = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    return {"auto": "auto", "all-cores": every}


def vllm_env(python: str, binding: str) -> dict[str, str]:
    """vLLM's recommended runtime: tcmalloc and its venv's Intel OpenMP preloaded where present."""
    preload = [str(p) for p in [TCMALLOC, *Path(python).resolve().parents[1].rglob("libiomp5.so")] if p.exists()]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding, "VLLM_CPU_KVCACHE_SPACE": "4"}
    return env | ({"LD_PRELOAD": ":".join(preload[:2])} if preload else {})


def vllm_request(model_dir: str, dtype: str, workload: list[BenchRequest], args) -> dict:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in workload)
    return {"model": os.path.abspath(model_dir), "dtype": dtype, "max_model_len": max(longest, 256),
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "long_prefill_token_threshold": args.long_prefill_token_threshold, "repeats": args.repeats,
            "prompts": [r.prompt_token_ids for r in workload], "output_lens": [r.output_len for r in workload]}


class VllmDriver:
    """vllm_driver.py started in vLLM's venv with one thread binding and kept started: `run()` runs the
    workload once more. Its log goes to a temporary file, printed if it fails or falls silent."""

    def __init__(self, python: str, request: dict, env: dict, timeout: float):
        self.timeout, self.tmp = timeout, tempfile.TemporaryDirectory()
        req_path, self.log = Path(self.tmp.name, "request.json"), tempfile.TemporaryFile("w+")
        req_path.write_text(json.dumps(request | {"launch_time": time.time()}))
        self.process = subprocess.Popen([python, str(DRIVER), str(req_path)], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.startup_to_first_token_s = None

    def wait_started(self) -> None:
        self.startup_to_first_token_s = self._reply()["startup_to_first_token_s"]

    def run(self) -> dict:
        with contextlib.suppress(BrokenPipeError):  # a driver that died is reported by _reply
            self.process.stdin.write("run\n")
            self.process.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            from pagedmoe.bench.server import stop_process
            stop_process(self.process, 5)
            self.log.seek(0)
            raise RuntimeError(f"vllm baseline failed or fell silent for {self.timeout:.0f} s (exit "
                               f"{self.process.returncode}):\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        """EOF on its stdin ends the driver; one that does not end in 30 s is stopped."""
        from pagedmoe.bench.server import stop_process
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            stop_process(self.process, 30)
        self.tmp.cleanup()
        self.log.close()


@contextlib.contextmanager
def vllm_driver(python: str, request: dict, env: dict, timeout: float):
    driver = VllmDriver(python, request, env, timeout)
    try:
        driver.wait_started()
        yield driver
    finally:
        driver.close()


def vllm_baseline(model_dir: str, dtype: str, workload: list[BenchRequest], args, between=None) -> dict:
    """vLLM's runs, per binding after one start-up. `between`, if given, runs after each vLLM run (pagedmoe's
    run, for --interleave) and its rows come back under "between", per binding."""
    python, request = check_vllm_python(args.vllm_python), vllm_request(model_dir, dtype, workload, args)
    runs, between_rows = {}, {}
    for name, binding in thread_bindings().items():
        with vllm_driver(python, request, vllm_env(python, binding), args.vllm_timeout) as driver:
            results, between_rows[name] = [], []
            for _ in range(args.repeats):
                results.append(checked_run(driver, request, args.settle_timeout if between else 0.0))
                between_rows[name] += [settled(between, args.settle_timeout)] if between else []
        runs[name] = binding_row(workload, binding, driver.startup_to_first_token_s, results)
    best = max(runs.values(), key=lambda row: row["output_tok_s"])
    return best | {"bindings": runs, "vllm_python": python} | ({"between": between_rows} if between else {})


def settled(run, settle_timeout: float):
    """run() once the CPUs are quiet (or settle_timeout seconds passed)."""
    wait_for_quiet_cpus(settle_timeout)
    return run()


def checked_run(driver: VllmDriver, request: dict, settle_timeout: float) -> dict:
    result = settled(driver.run, settle_timeout)
    if result["workload_digest"] != workload_digest(request["prompts"], request["output_lens"]):
        raise RuntimeError("vllm baseline: vLLM ran other prompts than the workload's")
    return result


def binding_row(workload: list[BenchRequest], binding: str, startup_s: float, results: list[dict]) -> dict:
    """The binding's fastest run, with every run's output tok/s beside it."""
    rows = [figures("vllm", workload, r["elapsed_s"], r["generated"]) for r in results]
    return fastest(rows) | {"binding": binding, "startup_to_first_token_s": startup_s}


def interleaved_runs(model_dir: str, dtype: str, workload: list[BenchRequest], args, run_ours) -> dict:
    """vLLM's runs with one of pagedmoe's (run_ours) right after each: pagedmoe's row is its fastest run; each
    pair's ratio is kept, and ratio_vs_vllm_paired is the median pair's, on the binding where it is lowest."""
    vllm = vllm_baseline(model_dir, dtype, workload, args, between=run_ours)
    ours_runs = vllm.pop("between")
    pairs = {name: [ours["output_tok_s"] / theirs for ours, theirs in zip(ours_runs[name], row["repeats_output_tok_s"])]
             for name, row in vllm["bindings"].items()}
    return {"pagedmoe": fastest([row for rows in ours_runs.values() for row in rows]),
            "vllm": vllm | {"paired_ratios": pairs},
            "ratio_vs_vllm_paired": min(statistics.median(ratios) for ratios in pairs.values())}


def vllm_serve_command(python: str, model_dir: str, port: int, dtype: str, args) -> list[str]:
    """`vllm serve` with pagedmoe's scheduler limits, so that both engines batch under the same ones."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model_dir),
               "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    threshold = args.long_prefill_token_threshold
    return command + (["--long-prefill-token-threshold", str(threshold)] if threshold else [])


@contextlib.contextmanager
def vllm_server(python: str, model_dir: str, dtype: str, binding: str, args):
    """`vllm serve` (its OpenAI api_server module) on a free port, with one thread binding; its log goes to
    a temporary file that is printed if it fails to come up."""
    from pagedmoe.bench.server import free_port, stop_process, wait_healthy
    port, log = free_port(), tempfile.TemporaryFile("w+")
    process = subprocess.Popen(vllm_serve_command(python, model_dir, port, dtype, args),
                               env=vllm_env(python, binding), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", args.vllm_timeout, lambda: process.poll() is None)
        yield f"http://127.0.0.1:{port}"
    except (RuntimeError, TimeoutError):
        log.seek(0)
        raise RuntimeError(f"vllm serve did not come up:\n{log.read()[-3000:]}")
    finally:
        stop_process(process, 30)
        log.close()


def best_serve_binding(bindings: dict[str, dict]) -> str:
    """The binding with the most goodput summed over the rates (then output tok/s)."""
    def score(name):
        rates = bindings[name]["rates"]
        return sum(r["goodput_req_s"] for r in rates), sum(r["output_tok_s"] for r in rates)
    return max(bindings, key=score)
