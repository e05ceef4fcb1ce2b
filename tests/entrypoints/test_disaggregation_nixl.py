"""Prefill/decode disaggregation over the NixlConnector behind `pagedmoe router --prefill --decode`: one
instance's greedy tokens for 8 prompts of different lengths, streamed or not, the decode server computing one
prompt token a request and both pools free afterwards (the prefill's leases ended by the reads'
notifications); a prefill process killed after its answer fails the next request at the decode server alone
(a 500 naming the reason, no hang) while others go on; the pair across two network namespaces (UCX over TCP on a
veth pair)."""
import json

import httpx
import pytest

from conftest import make_prompts
from server_utils import HEADERS, MODEL, serve, wait_all_blocks_free, wait_until
from test_disaggregation import assert_pair_matches_one_instance, complete, run_pair_in_namespaces, server_process
from pagedmoe.entrypoints.router import DisaggregatedRouter, router_in_thread

pytest.importorskip("nixl_cu12")


def nixl(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def instances(text_model):
    with serve(text_model[0], num_kv_blocks=128) as single, \
            serve(text_model[0], num_kv_blocks=128, kv_transfer_config=nixl("kv_producer")) as prefill, \
            serve(text_model[0], num_kv_blocks=128, kv_transfer_config=nixl("kv_consumer")) as decode:
        yield single, prefill, decode


def wait_pair_free(prefill, decode):
    wait_until(lambda: prefill.engine.connector.num_leases == 0, 10, "the prefill leases were not released")
    for server in (prefill, decode):
        wait_all_blocks_free(server)


def test_prefill_then_decode_over_nixl_matches_one_instance(instances):
    single, prefill, decode = instances
    assert_pair_matches_one_instance(single, prefill, decode, seed=26)
    assert decode.engine.runner.kv_connector.worker.bytes_read > 0
    wait_pair_free(prefill, decode)


def test_the_prefill_answer_carries_vllm_nixl_params(instances):
    _, prefill, decode = instances
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{prefill.url}/v1/completions", json=body, headers=HEADERS, timeout=30)
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.engine.config.kv_transfer_config.engine_id and params["tp_size"] == 1
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.engine.connector.port)
    assert params["remote_block_ids"] and params["remote_request_id"]
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2, "kv_transfer_params": params}
    assert httpx.post(f"{decode.url}/v1/completions", json=body, headers=HEADERS, timeout=30).status_code == 200
    wait_pair_free(prefill, decode)


def test_a_killed_prefill_fails_the_next_request_alone(text_model, instances):
    """The decode server has read from this prefill process before (its handshake is cached); the process is
    killed after answering a second prompt, so that prompt's read finds no peer."""
    single, _, decode = instances
    prompts = make_prompts(3, seed=28, min_len=10, max_len=50)
    with server_process(text_model[0], nixl("kv_producer")) as (prefill, p_proc):
        with router_in_thread(DisaggregatedRouter(prefill, decode.url)) as url:
            assert complete(url, prompts[0], model=None) == complete(single.url, prompts[0])
        body = {"prompt": prompts[1], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params = httpx.post(f"{prefill}/v1/completions", json=body, timeout=30).json()["kv_transfer_params"]
        p_proc.kill()
        p_proc.wait(10)
    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 4, "kv_transfer_params": params}
    failed = httpx.post(f"{decode.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert failed.status_code == 500 and "kv_transfer" in failed.text
    assert complete(decode.url, prompts[2]) == complete(single.url, prompts[2])
    wait_all_blocks_free(decode)


def test_prefill_and_decode_over_nixl_in_two_network_namespaces(text_model, tmp_path):
    """P (its side channel on host 0's address) and the proxy on host 0, D on host 1, a client on host 0; UCX
    over TCP on the veth only. Namespaces of this test's own, so it cannot collide with the other pair tests."""
    from netns import Hosts
    hosts = Hosts(("pm-nixl0", "pm-nixl1"), ("pm-nxveth0", "pm-nxveth1"), ("10.213.9.1", "10.213.9.2"))
    run_pair_in_namespaces(text_model[0], tmp_path, hosts, nixl("kv_producer", side_channel_host=hosts.addrs[0]),
                           nixl("kv_consumer"), seed=36)
