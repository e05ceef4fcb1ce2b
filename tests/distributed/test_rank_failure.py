"""A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-run: the engine raises WorkerDiedError for the step
instead of hanging, and a script driving it exits non-zero within the group's timeout."""
import subprocess
import sys
import time

import pytest

from conftest import save_random_model, tiny_dense_config

SCRIPT = """
import multiprocessing, os, signal, sys
from pagedmoe import LLM, SamplingParams
from pagedmoe.distributed.executor import WorkerDiedError

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              distributed_timeout_s=5)
    engine = llm.engine
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3, 4 + i], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    [rank1] = multiprocessing.active_children()
    os.kill(rank1.pid, getattr(signal, sys.argv[2]))
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except WorkerDiedError as error:
        print("in-flight requests failed:", sorted(engine.requests), error, flush=True)
        engine.shutdown()
        sys.exit(3)
    print("no error", flush=True)
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    save_random_model(tiny_dense_config("llama"), path)
    return path


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_hung_rank_fails_the_engine(model_path, signal_name, tmp_path):
    script = tmp_path / "drive.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script), model_path, signal_name], capture_output=True, text=True,
                            timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stdout + result.stderr
    assert "in-flight requests failed: ['0', '1', '2', '3']" in result.stdout
    assert elapsed < 60
