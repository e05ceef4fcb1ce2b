"""KV pool sizing from gpu_memory_utilization: the arithmetic (fake device numbers), and the profiled
forward at the largest batch, which runs on any device."""
import pytest
import torch

from conftest import save_random_model, tiny_dense_config
from pagedmoe.config import GIB, EngineConfig
from pagedmoe.worker.device_memory import kv_cache_budget, profile_forward, prompt_lengths
from pagedmoe.worker.model_loader import prepare_model


def test_kv_budget_is_what_utilization_leaves():
    assert kv_cache_budget(80 * GIB, 0.9, 16 * GIB, 4 * GIB, GIB) == int(72 * GIB) - 21 * GIB
    assert kv_cache_budget(100, 1.0, 50, 20, 10) == 20


@pytest.mark.parametrize("numbers", [(80 * GIB, 0.2, 16 * GIB, 0, 0), (100, 0.5, 30, 20, 0), (100, 1.0, 0, 0, 100)])
def test_no_memory_left_is_a_clear_error(numbers):
    with pytest.raises(ValueError, match="gpu_memory_utilization: .* leaves no memory for the KV cache"):
        kv_cache_budget(*numbers)


def test_prompt_lengths_fill_the_token_budget_within_max_model_len():
    assert prompt_lengths(2048, 512) == [512] * 4
    assert prompt_lengths(100, 64) == [64, 36]
    assert prompt_lengths(16, 512) == [16]


@pytest.mark.parametrize("triton", [False, True])
def test_profile_forward_runs_the_largest_step(tmp_path, monkeypatch, triton):
    if triton:
        pytest.importorskip("triton")
    save_random_model(tiny_dense_config("llama"), tmp_path)
    config = EngineConfig(str(tmp_path), dtype="float32", max_num_batched_tokens=40, max_model_len=16,
                          block_size=4, max_num_seqs=3)
    model = prepare_model(config)
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, pos, meta: seen.append((ids, pos, meta)) or forward(ids, pos,
                                                                                                         meta))
    profile_forward(config, model, (2, 4, (16,)), triton)
    ids, positions, meta = seen[0]
    assert len(ids) == 40 and positions.tolist() == list(range(16)) * 2 + list(range(8))
    assert (meta.triton is not None) == triton
    assert meta.kv_caches.shape == (2, 4, 4 + 4 + 2, 4, 16)
