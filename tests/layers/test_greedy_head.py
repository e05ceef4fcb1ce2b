"""The greedy head (layers/greedy_head.py): greedy tokens from an int8 or bf16 LM head and a float32 check of
the candidates its error bound leaves must be the argmax of the float32 logits of the full head (the tile
kernel), first index on ties, on every row count, in the kernels as an AVX2 (x86-64-v3) and an AVX-512
(x86-64-v4) machine build them; the engine takes it only for plain greedy steps, with HF's greedy tokens. The
bf16 head runs on every machine here (without bf16 dot products the bf16 tile widens its loads); the engine
attaches it only on AMX, and the int8 head from AVX2 up."""
import pytest
import torch

from conftest import assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams
from pagedmoe.cpu_info import FLAGS_ENV, detected_cpu_flags
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.cpu_linear import ANY_ROWS, CpuLinear
from pagedmoe.layers.greedy_head import GreedyHead, approximation_kind, attach_greedy_head

VOCAB, HIDDEN = 2048, 254  # 254: the int8 head pads its k-steps to quads
# AVX2's vpmaddubsw, AVX-512BW's, and this CPU's own build (VNNI's vpdpbusd where it has avx512_vnni)
TARGETS = ["x86-64-v3"] + ["x86-64-v4"] * ("avx512bw" in detected_cpu_flags()) + ["native"]
# (approximation, kernel build, the head's dtype); bf16 heads: their logits rounded to bf16, ties and all
KINDS = [("int8", target, dtype) for target in TARGETS for dtype in (torch.float32, torch.bfloat16)] + \
    [("bf16", "native", torch.float32)]


def make_head(kind: str = "int8", target: str = "native", dtype: torch.dtype = torch.float32,
              seed: int = 0) -> tuple[CpuLinear, GreedyHead, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02
    weight[700] = weight[9]  # an exact tie: the first index wins
    weight[1000:1064] = weight[:64] + torch.randn(64, HIDDEN, generator=gen) * 1e-6  # near ties: only float32 tells
    weight[1100], weight[1101] = 0.0, 1e-20  # a zero row, and one too small for its own int8 scale
    if dtype == torch.bfloat16:  # near ties in bf16: one step of the last bit in a few of each row's weights
        weight = weight.bfloat16()
        weight[1000:1064] = weight[:64]
        weight.view(torch.int16)[1000:1064, :4] += 1
    library = cpu_linear.load_library(march=target)
    full = CpuLinear(weight, library, max_rows=ANY_ROWS)
    return full, GreedyHead(full, weight, library, kind), weight


@pytest.mark.parametrize("kind, target, dtype", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 12, 13, 48, 64])
def test_the_head_gives_the_argmax_of_the_logits(rows, kind, target, dtype):
    full, head, weight = make_head(kind, target, dtype)
    gen = torch.Generator().manual_seed(rows)
    for scale in (1e-3, 1.0, 1e3):
        x = weight[torch.randint(0, 64, (rows,), generator=gen)] * 40 * scale  # each near a tie of n, 1000 + n
        x[0] = weight[9] * 40 * scale  # its logit ties between tokens 9 and 700
        assert torch.equal(head(x), full(x).argmax(dim=1))
        x = (torch.randn(rows, HIDDEN, generator=gen) * scale).to(dtype)
        assert torch.equal(head(x), full(x).argmax(dim=1))


@pytest.mark.parametrize("kind, target, dtype", KINDS)
def test_the_bound_holds_and_the_float32_check_is_needed(kind, target, dtype):
    """Every approximate logit lies within its bound of the float32 one (bf16 heads: of the float32 sum before
    its rounding); on the near ties the approximation alone picks other tokens than the full head."""
    full, head, weight = make_head(kind, target, dtype)
    x = torch.cat([weight[:48] * 40, torch.randn(16, HIDDEN).to(dtype)])
    approx, scales, error_scales = head.approx(x, x.double().norm(dim=1))
    bounds = scales[:, None] * head.w_norms + error_scales[:, None] * head.approx.w_errors
    logits = full(x) if dtype == torch.float32 else x.double() @ weight.double().T
    assert bool(((approx - logits).abs() <= bounds).all())
    assert not torch.equal(approx.argmax(dim=1), logits.argmax(dim=1))
    assert torch.equal(head(x), full(x).argmax(dim=1))


def test_rows_it_cannot_bound_take_the_full_logits():
    full, head, _ = make_head()
    x = torch.randn(4, HIDDEN)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 5] = bad
        assert head(y) is None
    assert head(torch.zeros(4, HIDDEN)) is None  # below MIN_HIDDEN_NORM
    head.max_rows = 3
    assert head(x) is None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return str(path), save_random_model(tiny_dense_config("qwen3"), path, seed=4)


def with_head(llm: LLM) -> list:
    """The engine's LM head on the float32 tile kernel and the greedy head on it; the head's answers (None:
    it stepped aside)."""
    model, answers = llm.engine.runner.model, []
    model.lm_head.cpu_kernel = full = CpuLinear(model.lm_head.weight, max_rows=ANY_ROWS)
    head = GreedyHead(full, model.lm_head.weight)

    def counted(hidden):
        answers.append(head(hidden))
        return answers[-1]
    model.greedy_head = counted
    return answers


def generate(llm: LLM, prompts, **params) -> list:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_takes_its_tokens_from_the_head_in_greedy_steps(model_path, dtype):
    """The full head's tokens (float32: HF's too); bf16 logits round many near ties to exact ones, first index."""
    path, hf_model = model_path
    prompts = make_prompts(6, seed=2, max_len=30)
    llm = LLM(path, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False)
    answers = with_head(llm)
    tokens = [out.token_ids for out in generate(llm, prompts)]
    assert answers and all(a is not None for a in answers)
    assert dtype != "float32" or tokens == [hf_greedy(hf_model, p, 10) for p in prompts]
    llm.engine.runner.model.greedy_head = None
    assert [out.token_ids for out in generate(llm, prompts)] == tokens


@pytest.mark.parametrize("params", [dict(logprobs=2), dict(repetition_penalty=1.3), dict(logit_bias={5: 3.0})])
def test_steps_that_need_the_logits_take_them(model_path, params):
    """Logprobs, penalties and biases read the logits: those steps never ask the head."""
    path, _ = model_path
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    answers = with_head(llm)
    outputs = generate(llm, make_prompts(3, seed=6, max_len=20), **params)
    assert not answers
    assert all(out.logprobs for out in outputs) == ("logprobs" in params)


def test_the_engine_attaches_the_head_where_the_cpu_has_int8_or_amx_dot_products(model_path, monkeypatch):
    path, _ = model_path
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    model = llm.engine.runner.model
    model.lm_head.cpu_kernel = CpuLinear(model.lm_head.weight, max_rows=ANY_ROWS)
    library = cpu_linear.load_library()
    expected = "bf16" if library.linear_amx() and "amx_bf16" in detected_cpu_flags() else "int8"
    assert approximation_kind(library, model.lm_head.weight) == expected
    assert attach_greedy_head(model) and model.greedy_head.kind == expected
    monkeypatch.setenv(FLAGS_ENV, "avx2 fma")
    assert attach_greedy_head(model) and model.greedy_head.kind == "int8"
    monkeypatch.setenv(FLAGS_ENV, "sse2")
    assert not attach_greedy_head(model)
    model.lm_head.cpu_kernel = None  # float32 this small stays on MKL / oneDNN
    monkeypatch.delenv(FLAGS_ENV)
    assert not attach_greedy_head(model)
    off = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_greedy_head=False)
    assert off.engine.runner.model.greedy_head is None
    bf16 = LLM(path, dtype="bfloat16", skip_tokenizer_init=True).engine.runner.model
    kernel = bf16.lm_head.cpu_kernel
    assert (bf16.greedy_head is not None) == (kernel is not None and not kernel.on_amx)
