"""Runs a `pagedmoe bench` workload on vLLM's offline LLM, inside vLLM's own virtualenv.

    VLLM_PYTHON vllm_driver.py REQUEST.json

Standalone on purpose: vLLM's venv has no pagedmoe, so this file imports only the standard library until
serve() imports vllm. REQUEST.json holds the model, dtype, engine limits, the process launch time and the
workload (prompt token ids and output lengths). The driver starts the engine, replies with its start-up to
first token, then runs the workload once for each `run` line on stdin, replying with the run's time, each
request's generated token count and the sha256 of the prompt token ids vLLM actually ran (the harness checks
it against its own). Replies are JSON lines on stdout; vLLM's own stdout goes to stderr, so that a log line
never reads as a reply. Between runs the engine stays started, so the harness can alternate engines' runs.
"""
import hashlib
import json
import os
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


def run_once(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts, output_lens = request["prompts"], request["output_lens"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()  # prefix caching is off: every run computes everything
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ran = [list(o.prompt_token_ids) for o in outputs]
    return {"elapsed_s": elapsed, "generated": [len(o.outputs[0].token_ids) for o in outputs],
            "workload_digest": workload_digest(ran, output_lens)}


def serve(request: dict, replies) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = load_engine(request)
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0])], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    reply(replies, {"startup_to_first_token_s": time.time() - request["launch_time"]})
    for line in sys.stdin:
        if line.strip() == "run":
            reply(replies, run_once(llm, request))


def reply(replies, message: dict) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


if __name__ == "__main__":  # vLLM spawns its engine processes: everything runs under this guard
    with open(sys.argv[1]) as f:
        req = json.load(f)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(req, replies)
