"""The fused CPU MoE kernel (layers/moe/csrc/fused_moe.cpp) against the exact expert loop in float64, built
for each x86-64 level this CPU runs: AVX2, AVX-512, and native (avx512_bf16's pair dot products where the CPU
has them, bf16 widened in integer code where it does not)."""
import pytest
import torch

from conftest import x86_targets
from pagedmoe import cpu_info
from pagedmoe.layers.moe import cpu_kernel
from pagedmoe.layers.linear import attach_cpu_kernels
from pagedmoe.layers.moe.cpu_kernel import CpuFusedMoE
from pagedmoe.layers.moe.fused_moe import fused_experts
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig, select_experts

NUM_EXPERTS, HIDDEN, INTER = 6, 64, 48
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_problem(num_tokens, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g)
    logits[:, 0] -= 100  # expert 0 never chosen: an inactive expert costs nothing and writes nothing
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k)
    return x, w13, w2, topk_weights, topk_ids


def exact(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None, w2_bias=None):
    args = (x.double(), w13.double(), w2.double(), topk_weights.double(), topk_ids, activation)
    biases = [None if b is None else b.double() for b in (w13_bias, w2_bias)]
    return fused_experts(*args, *biases, use_grouped_mm=False).float()


def expert_biases(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_EXPERTS, 2 * INTER, generator=g).to(dtype), torch.randn(NUM_EXPERTS, HIDDEN,
                                                                                   generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", x86_targets())
def test_matches_the_exact_expert_loop(target, dtype):
    """Token counts cover one row, a partial and a full row block (6 on AVX2, 8 on AVX-512) and several."""
    library = cpu_kernel.load_library(march=target if target != "native" else "native")
    for num_tokens, top_k in ((1, 1), (5, 2), (8, 2), (23, 3), (64, 2)):
        x, w13, w2, topk_weights, topk_ids = make_problem(num_tokens, top_k, dtype, seed=num_tokens)
        out = CpuFusedMoE(w13, w2, library)(x, topk_weights, topk_ids)
        assert out.dtype == torch.float32 and out.shape == (num_tokens, HIDDEN)
        torch.testing.assert_close(out, exact(x, w13, w2, topk_weights, topk_ids), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", x86_targets())
def test_gpt_oss_experts_match_the_exact_expert_loop(target, dtype):
    """swigluoai (clamped at 7, (up + 1) * gate * sigmoid(1.702 gate)) with both biases, the inputs scaled so
    that the clamps act; and silu with biases."""
    library = cpu_kernel.load_library(march=target)
    for activation, (num_tokens, top_k) in [("swigluoai", (1, 1)), ("swigluoai", (23, 3)), ("silu", (8, 2))]:
        x, w13, w2, topk_weights, topk_ids = make_problem(num_tokens, top_k, dtype, seed=num_tokens)
        x, (b13, b2) = x * 4, expert_biases(dtype, seed=num_tokens)
        out = CpuFusedMoE(w13, w2, library, activation, b13, b2)(x, topk_weights, topk_ids)
        expected = exact(x, w13, w2, topk_weights, topk_ids, activation, b13, b2)
        tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("target", x86_targets())
def test_a_token_does_not_depend_on_its_batch(target):
    """Each expert's last row block (1-3 rows: several panels per tile) sums its k-steps in the order a full
    block does, so a token's float32 output is bit-identical alone and in any batch."""
    library = cpu_kernel.load_library(march=target)
    x, w13, w2, topk_weights, topk_ids = make_problem(40, 2, torch.float32, seed=3)
    kernel = CpuFusedMoE(w13, w2, library)
    batched = kernel(x, topk_weights, topk_ids)
    for num_tokens in (1, 2, 3, 9, 20):
        alone = kernel(x[:num_tokens], topk_weights[:num_tokens], topk_ids[:num_tokens])
        assert torch.equal(alone, batched[:num_tokens])


def test_any_thread_count_gives_the_same_output():
    """Tasks go heaviest expert first and threads claim them from both ends (even threads the front, odd ones
    the back): with 1 to 5 threads every task runs once, and the output is bit-identical."""
    x, w13, w2, topk_weights, topk_ids = make_problem(40, 2, torch.float32, seed=5)
    kernel, threads = CpuFusedMoE(w13, w2), torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(kernel(x, topk_weights, topk_ids))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    torch.testing.assert_close(outs[0], exact(x, w13, w2, topk_weights, topk_ids), **TOLERANCE[torch.float32])


def test_ids_outside_the_experts_contribute_nothing():
    """An id of -1 (an expert on another rank, later) is skipped, not read out of bounds."""
    x, w13, w2, topk_weights, topk_ids = make_problem(7, 2, torch.float32)
    masked = topk_ids.clone()
    masked[:, 1] = -1
    out = CpuFusedMoE(w13, w2)(x, topk_weights, masked)
    expected = exact(x, w13, w2, topk_weights[:, :1], topk_ids[:, :1])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rejects_shapes_and_dtypes_it_cannot_run():
    panel = cpu_kernel.load_library().fused_moe_panel()
    x, w13, w2, _, _ = make_problem(2, 1, torch.float32)
    with pytest.raises(ValueError, match="intermediate"):
        CpuFusedMoE(w13[:, 1:-1], w2[:, :, 1:])
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        CpuFusedMoE(w13.half(), w2.half())
    kernel = CpuFusedMoE(w13, w2)
    with pytest.raises(ValueError, match="x must be"):
        kernel(x.bfloat16(), torch.ones(2, 1), torch.ones(2, 1, dtype=torch.long))
    assert panel in (8, 16, 32)


def test_decode_sized_batches_only(monkeypatch):
    """On Intel, where the expert loop's MKL GEMMs win past decode sizes."""
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", "GenuineIntel")
    x, w13, w2, _, topk_ids = make_problem(4, 2, torch.float32)
    kernel = CpuFusedMoE(w13, w2)
    limit = cpu_kernel.MAX_ROWS_PER_EXPERT[torch.float32] * NUM_EXPERTS
    assert kernel.fits(x, topk_ids)
    assert not kernel.fits(x, torch.zeros(limit // 2 + 1, 2, dtype=torch.long))
    assert not kernel.fits(x.requires_grad_(), topk_ids)


def moe_layer(activation="silu", expert_bias=False):
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, RouterConfig(top_k=2, renormalize=True), activation=activation,
                     expert_bias=expert_bias)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def test_the_layer_uses_the_kernel_for_small_batches_and_the_loop_for_large(monkeypatch):
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", "GenuineIntel")
    torch.manual_seed(0)
    layer = moe_layer()
    x_small, x_large = torch.randn(3, HIDDEN), torch.randn(400, HIDDEN)
    with torch.inference_mode():
        expected = [layer(x) for x in (x_small, x_large)]
        assert attach_cpu_kernels(layer, {"moe"}, min_bytes=0) == 1 and layer.cpu_experts is not None
        calls = []
        layer.cpu_experts.fn = record_calls(layer.cpu_experts.fn, calls)
        for x, ref in zip((x_small, x_large), expected):
            torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


@pytest.mark.parametrize("vendor, flags, dtype, every_size", [
    ("AuthenticAMD", "avx2 fma", torch.float32, True),  # MKL's GEMMs are not tuned off Intel
    ("GenuineIntel", "avx2 fma", torch.float32, False),
    ("GenuineIntel", "avx2 fma", torch.bfloat16, True),  # the loop's bf16 GEMMs are emulated
    ("AuthenticAMD", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16", torch.bfloat16, False)])
def test_large_batches_follow_the_cpu(monkeypatch, vendor, flags, dtype, every_size):
    """A prefill-sized batch runs through the kernel where the expert loop is slower at every size, and
    matches the loop."""
    if not cpu_info.is_x86():
        pytest.skip("x86 dispatch")
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", vendor)
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", flags)
    torch.manual_seed(0)
    layer = moe_layer().to(dtype)
    x = torch.randn(400, HIDDEN).to(dtype)
    with torch.inference_mode():
        expected = layer(x).double()
        assert attach_cpu_kernels(layer, {"moe"}, min_bytes=0) == 1
        calls = []
        layer.cpu_experts.fn = record_calls(layer.cpu_experts.fn, calls)
        scale = float(expected.abs().max())
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2 * scale, rtol=2e-2)
        torch.testing.assert_close(layer(x).double(), expected, **tolerance)
    assert len(calls) == int(every_size)


def record_calls(fn, calls):
    def wrapped(*args):
        calls.append(args)
        return fn(*args)
    return wrapped


@pytest.mark.parametrize("kwargs", [dict(activation="swigluoai", expert_bias=True), dict(expert_bias=True)])
def test_gpt_oss_layers_run_on_the_kernel(kwargs):
    torch.manual_seed(0)
    layer = moe_layer(**kwargs)
    x = torch.randn(5, HIDDEN) * 4
    with torch.inference_mode():
        expected = layer(x)
        assert attach_cpu_kernels(layer, {"moe"}, min_bytes=0) == 1 and layer.cpu_experts is not None
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_unknown_activations_are_refused():
    _, w13, w2, _, _ = make_problem(2, 1, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        CpuFusedMoE(w13, w2, activation="gelu")


def test_native_build_matches_the_cpu():
    """The bf16 pair path is compiled exactly where the CPU has avx512_bf16 (PAGEDMOE_CPU_FLAGS aside)."""
    has_pairs = bool(cpu_kernel.load_library().fused_moe_bf16_pairs())
    assert has_pairs == ("avx512_bf16" in cpu_info.detected_cpu_flags())


AMX = cpu_kernel.load_library().fused_moe_amx() and "amx_bf16" in cpu_info.cpu_flags()


def bf16_layer(inter=64):
    """in_features 64 on both projections: whole 32-wide AMX k-steps."""
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, inter, RouterConfig(top_k=2, renormalize=True))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer.bfloat16()


@pytest.mark.skipif(not AMX, reason="no AMX bf16 tiles on this CPU")
def test_amx_experts_match_the_exact_loop():
    """On AMX the kernel runs every batch on the tiles, from one row per expert to prefill sizes (row blocks
    of 32 and their remainders), ids of other ranks skipped: every regime against the float64 loop."""
    torch.manual_seed(1)
    layer = bf16_layer()
    with torch.inference_mode():
        assert attach_cpu_kernels(layer, {"moe"}, min_bytes=0) == 1 and layer.cpu_experts.amx_fn is not None
        calls = []
        layer.cpu_experts.fn = record_calls(layer.cpu_experts.amx_fn, calls)
        for num_tokens in (3, 60, 1200):  # ~1, ~20 and ~400 rows per expert
            x = torch.randn(num_tokens, HIDDEN).bfloat16()
            topk_weights, topk_ids = select_experts(layer.router, layer.router_logits(x), None)
            expected = exact(x, layer.w13, layer.w2, topk_weights, topk_ids)
            got = layer.routed_output(x, topk_weights, topk_ids).float()  # rounded to bf16, as the layer returns
            torch.testing.assert_close(got, expected, atol=2e-2 * float(expected.abs().max()), rtol=2e-2)
        masked = topk_ids.clone()
        masked[::2, 1] = -1
        got = layer.cpu_experts(x, topk_weights, masked)
        expected = exact(x, layer.w13, layer.w2, topk_weights * (masked >= 0), topk_ids)
        torch.testing.assert_close(got, expected, atol=2e-2 * float(expected.abs().max()), rtol=2e-2)
    assert [args[6].num_tokens for args in calls] == [3, 60, 1200, 1200]


def test_amx_experts_follow_the_reported_cpu(monkeypatch):
    """Without amx_bf16 in the CPU's flags, bf16 layers keep the fused kernel's own limit and the plain loop."""
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16")
    layer = bf16_layer()
    assert attach_cpu_kernels(layer, {"moe"}, min_bytes=0) == 1
    assert layer.cpu_experts.amx_fn is None
    assert layer.cpu_experts.max_pairs == cpu_kernel.MAX_ROWS_PER_EXPERT[torch.bfloat16] * NUM_EXPERTS


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", x86_targets())
def test_set_expert_packs_a_slot_as_construction_does(target, dtype, src_dtype):
    """Offloaded experts fill one slot at a time (C++ pack, k-pairs where the build uses them, the checkpoint's
    dtype converted first): the slots equal the packing of all experts at construction, and so do the outputs."""
    library = cpu_kernel.load_library(march=target)
    x, w13, w2, topk_weights, topk_ids = make_problem(9, 2, dtype)
    (b13, b2), w13_src, w2_src = expert_biases(dtype), w13.to(src_dtype), w2.to(src_dtype)
    whole = CpuFusedMoE(w13_src.to(dtype), w2_src.to(dtype), library, "silu", b13, b2)
    slots = CpuFusedMoE(torch.zeros_like(w13), torch.zeros_like(w2), library, "silu", b13 * 0, b2 * 0)
    for e in reversed(range(NUM_EXPERTS)):
        slots.set_expert(e, w13_src[e], w2_src[e], b13[e], b2[e])
    assert torch.equal(slots.w13, whole.w13) and torch.equal(slots.w2, whole.w2)
    assert torch.equal(slots.b13, whole.b13) and torch.equal(slots.b2, whole.b2)
    assert torch.equal(slots(x, topk_weights, topk_ids), whole(x, topk_weights, topk_ids))
