"""Start-up to first token, measured as for the vllm baseline: a fresh process loads the engine and
generates one token of the workload's first prompt; the time counts from the parent's launch."""
import json
import subprocess
import sys
import time


def pagedmoe_startup(model_dir: str, engine_kwargs: dict, prompt_token_ids: list[int], timeout: float = 600) -> float:
    request = json.dumps({"model": model_dir, "engine": engine_kwargs, "prompt": prompt_token_ids,
                          "launch_time": time.time()})
    proc = subprocess.run([sys.executable, "-m", "pagedmoe.bench.startup"], input=request, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"pagedmoe start-up run failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main():
    request = json.loads(sys.stdin.read())
    from pagedmoe import LLM, SamplingParams
    llm = LLM(request["model"], **request["engine"] | {"skip_tokenizer_init": True})
    llm.generate({"prompt_token_ids": request["prompt"]}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    print(time.time() - request["launch_time"])


if __name__ == "__main__":
    main()
