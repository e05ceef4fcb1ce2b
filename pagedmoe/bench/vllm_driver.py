"""Runs a `pagedmoe bench` workload on vLLM's offline LLM, inside vLLM's own virtualenv.

    VLLM_PYTHON vllm_driver.py REQUEST.json RESULT.json

Standalone on purpose: vLLM's venv has no pagedmoe, so this file imports only the standard library until
main() imports vllm. REQUEST.json holds the model, dtype, engine limits, the process launch time and the
workload (prompt token ids and output lengths) and how many times to run it; RESULT.json gets the timings
(the best run's, and every run's), each request's generated
token count and the sha256 of the prompt token ids vLLM actually ran (the harness checks it against its own).
"""
import hashlib
import json
import sys
import time


def workload_digest(prompts: list[list[int]], output_lens: list[int]) -> str:
    """The identity of a workload: its prompts' token ids and output lengths, in order."""
    return hashlib.sha256(json.dumps([prompts, output_lens]).encode()).hexdigest()


def load_engine(request: dict):
    from vllm import LLM
    return LLM(model=request["model"], dtype=request["dtype"], skip_tokenizer_init=True, seed=0,
               max_model_len=request["max_model_len"], max_num_seqs=request["max_num_seqs"],
               max_num_batched_tokens=request["max_num_batched_tokens"], enable_prefix_caching=False,
               long_prefill_token_threshold=request["long_prefill_token_threshold"])


def run(request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = load_engine(request)
    prompts, output_lens = request["prompts"], request["output_lens"]
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    startup_s = time.time() - request["launch_time"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    elapsed = []
    for _ in range(request.get("repeats", 1)):  # prefix caching is off: every repeat computes everything
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        elapsed.append(time.perf_counter() - start)
    ran = [list(o.prompt_token_ids) for o in outputs]
    return {"startup_to_first_token_s": startup_s, "elapsed_s": min(elapsed), "repeats_elapsed_s": elapsed,
            "generated": [len(o.outputs[0].token_ids) for o in outputs],
            "workload_digest": workload_digest(ran, output_lens)}


if __name__ == "__main__":  # vLLM spawns its engine processes: everything runs under this guard
    with open(sys.argv[1]) as f:
        req = json.load(f)
    result = run(req)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
