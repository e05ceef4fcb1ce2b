"""The greedy head (layers/greedy_head.py): greedy tokens from a bf16 LM head and a float32 check of the
candidates its error bound leaves must be the argmax of the float32 logits of the full head (the tile kernel),
first index on ties, on every row count; the engine takes it only for plain greedy steps, with HF's greedy
tokens. It runs on every machine here (without bf16 dot products the bf16 tile widens its loads); the engine
attaches it only where the CPU has them."""
import pytest
import torch

from conftest import assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams
from pagedmoe.cpu_info import FLAGS_ENV, has_native_bf16
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.cpu_linear import ANY_ROWS, CpuLinear
from pagedmoe.layers.greedy_head import GreedyHead, attach_greedy_head

VOCAB, HIDDEN = 2048, 256


def make_head(seed: int = 0) -> tuple[CpuLinear, GreedyHead, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02
    weight[700] = weight[9]  # an exact tie: the first index wins
    weight[1000:1064] = weight[:64] + torch.randn(64, HIDDEN, generator=gen) * 1e-6  # near ties, bf16 cannot tell
    full = CpuLinear(weight, max_rows=ANY_ROWS)
    return full, GreedyHead(full, weight), weight


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 13, 48, 64])
def test_the_head_gives_the_argmax_of_the_float32_logits(rows):
    full, head, weight = make_head()
    gen = torch.Generator().manual_seed(rows)
    for scale in (1e-3, 1.0, 1e3):
        x = weight[torch.randint(0, 64, (rows,), generator=gen)] * 40 * scale  # each near a tie of n, 1000 + n
        x[0] = weight[9] * 40 * scale  # its logit ties between tokens 9 and 700
        assert torch.equal(head(x), full(x).argmax(dim=1))
        x = torch.randn(rows, HIDDEN, generator=gen) * scale
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


def test_the_engine_takes_its_tokens_from_the_head_in_greedy_steps(model_path):
    path, hf_model = model_path
    prompts = make_prompts(5, seed=2, max_len=30)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    answers = with_head(llm)
    tokens = [out.token_ids for out in generate(llm, prompts)]
    assert answers and all(a is not None for a in answers)
    assert tokens == [hf_greedy(hf_model, p, 10) for p in prompts]
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


def test_the_engine_attaches_the_head_where_the_cpu_has_bf16_dot_products(model_path, monkeypatch):
    path, _ = model_path
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    model = llm.engine.runner.model
    model.lm_head.cpu_kernel = CpuLinear(model.lm_head.weight, max_rows=ANY_ROWS)
    library = cpu_linear.load_library()
    dot_products = has_native_bf16() and bool(library.linear_bf16_pairs() or library.linear_amx())
    assert attach_greedy_head(model) == dot_products and (model.greedy_head is not None) == dot_products
    monkeypatch.setenv(FLAGS_ENV, "avx2 fma")
    assert not attach_greedy_head(model)
    model.lm_head.cpu_kernel = None  # float32 this small stays on MKL / oneDNN
    monkeypatch.delenv(FLAGS_ENV)
    assert not attach_greedy_head(model)
    off = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_greedy_head=False)
    assert off.engine.runner.model.greedy_head is None
