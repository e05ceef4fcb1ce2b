"""A TP=2 expert-parallel server on the bundled MoE model: /metrics and /dashboard/stats report the ranks,
rank 0's collective time, each rank's expert tokens and their imbalance, and the shut-down server stops its
ranks."""
import re

import httpx

from server_utils import HEADERS, MODEL, serve, wait_all_blocks_free, wait_until
from pagedmoe import DEFAULT_MODEL


def metric(text: str, name: str, *labels: str) -> float:
    """The value of pagedmoe:NAME{...} for this model whose labels include each of `labels` ('rank="0"')."""
    for found, value in re.findall(rf"^pagedmoe:{name}{{(.*)}} (\S+)$", text, re.M):
        if all(label in found.split(",") for label in (f'model_name="{MODEL}"', *labels)):
            return float(value)
    raise AssertionError(f"{name} {labels} missing")


def forward_seconds(text: str, rank: int) -> float:
    try:
        return metric(text, "parallel_rank_seconds_total", f'rank="{rank}"', 'kind="forward"')
    except AssertionError:
        return 0.0


def test_metrics_report_ranks_and_expert_balance():
    with serve(DEFAULT_MODEL, tensor_parallel_size=2, enable_expert_parallel=True) as running:
        client = running.openai()
        out = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=24, n=4, temperature=1.0)
        assert len(out.choices) == 4
        wait_all_blocks_free(running)
        text = httpx.get(f"{running.url}/metrics", headers=HEADERS).text
        assert metric(text, "parallel_world_size") == 2 and metric(text, "parallel_steps_total") >= 24
        assert metric(text, "parallel_comm_seconds_total", 'kind="all_reduce"') > 0
        tokens = [metric(text, "parallel_rank_expert_tokens_total", f'rank="{r}"') for r in (0, 1)]
        routed = sum(float(v) for v in re.findall(r"^pagedmoe:expert_tokens_total{.*} (\S+)$", text, re.M))
        prompt_tokens = metric(text, "prompt_tokens_total")
        forwarded = prompt_tokens + metric(text, "generation_tokens_total") - 4  # last tokens never fed back
        last_layer_rows = forwarded - (prompt_tokens - 1)  # its experts see the prompt's last row, not the others
        assert sum(tokens) == routed == 2 * (3 * forwarded + last_layer_rows)  # top-2 in each of 4 layers
        assert metric(text, "expert_load_imbalance") == max(tokens) / (sum(tokens) / 2)
        scrape = lambda: httpx.get(f"{running.url}/metrics", headers=HEADERS).text  # noqa: E731
        # each rank's seconds are fetched at most once a second: wait for a fetch after the request
        wait_until(lambda: all(forward_seconds(scrape(), r) > 0 for r in (0, 1)), 10, "a rank's forwards untimed")
        stats = httpx.get(f"{running.url}/dashboard/stats", headers=HEADERS).json()["parallel"]
        assert stats["world_size"] == 2 and stats["rank_expert_tokens"] == tokens
        assert [r["forward"] > 0 for r in stats["rank_seconds"]] == [True, True]
        ranks = running.engine.runner.executor.procs
    assert not any(proc.is_alive() for proc in ranks)
