"""TP=2 across two network namespaces joined by a veth pair (made and removed here): rank 0 is an offline
engine in one namespace, rank 1 a headless `pagedmoe serve --node-rank 1` in the other, meeting at
--master-addr over TCP as on two machines. The tokens match one process."""
import json
import subprocess
import sys

import pytest

from conftest import make_prompts, pagedmoe_greedy, save_random_model, tiny_dense_config
from netns import ADDRS, in_namespace, two_hosts

PORT = 29517
DRIVER = """
import json, sys
from pagedmoe import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2, nnodes=2, node_rank=0,
              master_addr=sys.argv[2], master_port=int(sys.argv[3]), distributed_timeout_s=60)
    prompts = json.loads(sys.argv[4])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.shutdown()
    print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


@pytest.fixture
def hosts():
    with two_hosts():
        yield


def test_tp2_across_two_namespaces_matches_one_process(hosts, tmp_path):
    path = str(tmp_path / "llama")
    save_random_model(tiny_dense_config("llama"), path)
    prompts = make_prompts(4, seed=9)
    driver_script = tmp_path / "driver.py"
    driver_script.write_text(DRIVER)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    node1 = in_namespace(1, [sys.executable, "-m", "pagedmoe", "serve", path, "--tensor-parallel-size", "2",
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", ADDRS[0], "--master-port",
                             str(PORT), "--dtype", "float32", "--skip-tokenizer-init"], **pipes)
    driver = in_namespace(0, [sys.executable, str(driver_script), path, ADDRS[0], str(PORT), json.dumps(prompts)],
                          **pipes)
    try:
        out, err = driver.communicate(timeout=180)
        assert driver.returncode == 0, err[-3000:]
        assert node1.wait(timeout=60) == 0, node1.stderr.read()[-3000:]
    finally:
        for proc in (driver, node1):
            proc.kill() if proc.poll() is None else None
    assert json.loads(out.strip().splitlines()[-1]) == pagedmoe_greedy(path, prompts, 16)
