"""The fused CPU pointwise kernels (layers/csrc/pointwise.cpp) against the PyTorch code they replace."""
import pytest
import torch

from conftest import x86_targets
from pagedmoe.layers import cpu_ops
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.layers.rotary import RotaryEmbedding
from pagedmoe.layers.sampler import greedy

TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def eager(monkeypatch, fn, *args):
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "enabled", False)
        return fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_eager_on_rows_and_head_views(monkeypatch, dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.normal_()
    with torch.inference_mode():
        x = torch.randn(5, 3 * 64).to(dtype)
        for inputs in (x[:, :64].contiguous(), x.view(5, 3, 64)[:, 1:]):  # Qwen3's per-head norms: a view
            assert cpu_ops.rms_norm(inputs, norm.weight, norm.eps) is not None
            torch.testing.assert_close(norm(inputs), eager(monkeypatch, norm, inputs), **TOLERANCE[dtype])


@pytest.mark.parametrize("target", x86_targets())
def test_rms_norm_of_head_views_in_avx2_and_avx512_builds(monkeypatch, target):
    """Per-head rows of a qkv view (read in place, rows 256 floats apart), as an AVX2 or AVX-512 machine builds
    the kernels."""
    library = cpu_ops.load_library(march=target)
    norm = RMSNorm(32, eps=1e-6)
    torch.manual_seed(1)
    norm.weight.data.normal_()
    with torch.inference_mode():
        qkv = torch.randn(4, 8 * 32)
        q = qkv.view(4, 8, 32)[:, :4]  # rows 256 floats apart, heads 32
        want = eager(monkeypatch, norm, q)
        monkeypatch.setattr(cpu_ops, "load_library", lambda: library)
        torch.testing.assert_close(cpu_ops.rms_norm(q, norm.weight, norm.eps), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype, table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
def test_rotary_in_place_on_qkv_views_matches_eager(monkeypatch, dtype, table_dtype):
    """table_dtype bfloat16: a bf16 model's tables, cast with it; the kernel rotates by their float32 copies."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32), 1.0, 256).to(table_dtype)
    positions = torch.tensor([0, 5, 255, 17])
    with torch.inference_mode():
        qkv = torch.randn(4, (4 + 2 + 2) * 32).to(dtype)
        q0, k0, _ = views(qkv.clone())
        expected = eager(monkeypatch, rotary, positions, q0, k0)
        v_before = views(qkv)[2].clone()
        q, k, v = views(qkv)
        cos = rotary.float_tables()[0]
        assert cpu_ops.can_rotate(q, positions, cos) and cpu_ops.can_rotate(k, positions, cos)
        got = rotary(positions, q, k)
        assert got[0].data_ptr() == q.data_ptr()  # in place, in the qkv buffer
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **TOLERANCE[dtype])
        assert torch.equal(views(qkv)[2], v_before)


def views(qkv):
    q, k, v = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    return q.view(-1, 4, 32), k.view(-1, 2, 32), v.view(-1, 2, 32)


def test_rotary_leaves_transposed_inputs_to_eager():
    q = torch.randn(4, 32, 3).transpose(1, 2)
    assert not cpu_ops.can_rotate(q, torch.zeros(3, dtype=torch.long), torch.zeros(8, 32))


def test_greedy_argmax_matches_torch_with_ties_infinities_and_nan():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[1, [3, 9]] = 50.0  # a tie: the first index
    logits[2, :] = float("-inf")
    logits[3, [5, 700]] = float("inf")
    logits[4, 400] = float("nan")  # torch.argmax: the NaN
    logits[5, [10, 20]] = float("nan")
    got = cpu_ops.greedy_argmax(logits)
    assert got is not None and torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_ops_fall_back_where_the_kernels_do_not_apply():
    x = torch.randn(3, 8, requires_grad=True)
    assert cpu_ops.rms_norm(x, torch.ones(8), 1e-6) is None  # autograd
    assert cpu_ops.rms_norm(torch.randn(3, 8).half(), torch.ones(8).half(), 1e-6) is None
    assert cpu_ops.greedy_argmax(torch.randn(3, 8).bfloat16()) is None
    assert cpu_ops.greedy_argmax(torch.randn(3, 0)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy_from_qkv_views(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 32).to(dtype)
    _, k, v = views(qkv)
    slots = torch.tensor([0, 17, 3, 63, 40])
    cache = torch.zeros(2 * 2, 4, 16, 32, dtype=dtype)
    expected = cache.clone()
    for half, new in zip(expected.split(2), (k, v)):
        half.view(2, -1, 32).index_copy_(1, slots, new.transpose(0, 1))
    assert cpu_ops.write_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)
    assert not cpu_ops.write_kv(cache, k.float() if dtype == torch.bfloat16 else k.bfloat16(), v, slots)
    assert not cpu_ops.write_kv(cache, k, v, slots.int())
