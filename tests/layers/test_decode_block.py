"""The decode block (layers/attention/decode_block.py): a decoder layer's attention half for a step of decodes
in one C++ call must give bit-identical tokens and logprobs to the layer's modules run one by one, and match
HF's greedy tokens in float32: Llama, Qwen3 (q/k norms per head), OLMoE (q/k norms over all heads), gpt-oss
(biases, sinks, sliding-window layers with their own block tables); float32 and bfloat16; on the AMX tiles
and on the vector tiles. The tiny test linears are put on the tile kernel whatever their size, so that every
machine drives the block."""
import pytest
import torch
import transformers

from conftest import MOE_COMMON, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, \
    tiny_dense_config
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers import cpu_build, cpu_linear, cpu_ops
from pagedmoe.layers.attention import decode_block
from pagedmoe.layers.attention.decode_block import DecodeBlock, attach_decode_blocks
from pagedmoe.layers.cpu_linear import ANY_ROWS, CpuLinear
from pagedmoe.layers.linear import Linear, MergedLinear
from pagedmoe.layers.quantization.quantize import quantize_checkpoint

NUM_NEW = 12
CONFIGS = {
    "llama": lambda: tiny_dense_config("llama"),
    "qwen3": lambda: tiny_dense_config("qwen3"),
    "olmoe": lambda: transformers.OlmoeConfig(**MOE_COMMON, intermediate_size=48, num_experts=4,
                                              num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(**MOE_COMMON | {"num_hidden_layers": 3}, head_dim=32,
                                                 intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                                 sliding_window=8),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_random_model(CONFIGS[request.param](), path, seed=3)
    prompts = make_prompts(6, seed=5, max_len=30)
    return request.param, str(path), model, prompts


def on_tile_kernels(llm: LLM, amx: bool = True) -> list:
    """Every plain linear of the model that the tile kernel takes, on it at any row count (amx False: on the
    vector tiles), then the decode blocks attached; the decoder layers."""
    model = llm.engine.runner.model
    for layer in model.modules():
        if type(layer) in (Linear, MergedLinear) and layer.fp4 is None:
            try:
                layer.cpu_kernel, layer.packed_weight = CpuLinear(layer.weight, max_rows=ANY_ROWS), None
            except ValueError:  # a router's few outputs: not a whole panel
                continue
            if layer.cpu_kernel.on_amx and not amx:
                layer.cpu_kernel.on_amx, layer.cpu_kernel.fn = False, cpu_linear.load_library().linear_bf16
    assert attach_decode_blocks(model) == len(model.layers)
    model.decode_stack = None  # these tests drive the blocks layer by layer (tests/layers/test_decode_stack.py)
    return list(model.layers)


def generate(llm: LLM, prompts: list[list[int]]):
    """Greedy tokens and top logprobs (run twice, the engine must not cache prefixes: a prefix hit computes
    the prompt in other shapes, with other float rounding)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outputs]


def count_calls(monkeypatch) -> list:
    ran, call = [], DecodeBlock.__call__

    def counted(self, *args):
        out = call(self, *args)
        ran.append(out is not None)
        return out
    monkeypatch.setattr(DecodeBlock, "__call__", counted)
    return ran


@pytest.mark.parametrize("dtype, amx", [("float32", False), ("bfloat16", True), ("bfloat16", False)])
def test_the_block_equals_the_layers_modules(reference, dtype, amx, monkeypatch):
    """amx: bf16 linears on the AMX tiles where the CPU has them (float32 has no AMX path)."""
    arch, path, _, prompts = reference
    llm = LLM(path, dtype=dtype, skip_tokenizer_init=True, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    layers = on_tile_kernels(llm, amx)
    ran = count_calls(monkeypatch)
    fused = generate(llm, prompts)
    assert sum(ran) >= (NUM_NEW - 1) * len(layers) and not all(ran)  # decodes fused, prefill steps not
    for layer in layers:
        layer.decode_block = None
    assert generate(llm, prompts) == fused


def test_the_block_matches_hf_greedy(reference, monkeypatch):
    arch, path, model, prompts = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=14, preemption_mode="recompute")
    on_tile_kernels(llm)
    ran = count_calls(monkeypatch)
    tokens = [out[0] for out in generate(llm, prompts)]
    assert any(ran)
    assert tokens == [hf_greedy(model, p, NUM_NEW) for p in prompts]


ASIDE = {"no decode kernel": dict(cpu_attention_kernel=False), "rows over a linear's limit": dict(),
         "PyTorch pointwise ops": dict()}


@pytest.mark.parametrize("reason", list(ASIDE))
def test_the_block_steps_aside(reference, reason, monkeypatch):
    """Where one of its kernels would not run, the layer's modules run, with the same output."""
    _, path, _, prompts = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False, **ASIDE[reason])
    layers = on_tile_kernels(llm)
    calls = []
    for layer in layers:
        layer.decode_block.fn = lambda *args: calls.append(args)
        layer.decode_block.max_rows = 0 if reason == "rows over a linear's limit" else layer.decode_block.max_rows
    monkeypatch.setattr(cpu_ops, "enabled", reason != "PyTorch pointwise ops")
    outputs = generate(llm, prompts)
    assert calls == []
    for layer in layers:
        layer.decode_block = None
    assert generate(llm, prompts) == outputs


def test_unsupported_layers_are_refused(reference):
    _, path, _, _ = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_decode_block=False)
    layers = on_tile_kernels(llm)
    layers[0].self_attn.o_proj.cpu_kernel = None
    with pytest.raises(ValueError, match="decode block: the projections run on neither the CPU tile kernel nor"):
        DecodeBlock(layers[0])
    assert attach_decode_blocks(llm.engine.runner.model) == len(layers) - 1 and layers[0].decode_block is None


def test_the_engine_attaches_blocks_where_the_kernels_run(tmp_path):
    """bfloat16 linears take the tile kernel at any size on AMX and on AVX2-only CPUs; float32 ones this small
    stay on MKL, so their layers keep their modules."""
    save_random_model(tiny_dense_config("llama"), tmp_path)
    layers = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True).engine.runner.model.layers
    assert all(layer.decode_block is None for layer in layers)
    layers = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True).engine.runner.model.layers
    assert all((layer.decode_block is not None) == (layer.self_attn.o_proj.cpu_kernel is not None)
               for layer in layers)


def test_the_build_key_covers_the_kernels_it_includes():
    """The block compiles the other kernels' sources into itself: an edit to any of them must rebuild it."""
    closure = cpu_build.source_closure(decode_block.SOURCE)
    csrc = decode_block.SOURCE.parent.parent.parent / "csrc"
    for path in (csrc / "linear.cpp", csrc / "pointwise.cpp", csrc / "amx_tile.h",
                 decode_block.SOURCE.with_name("paged_decode.cpp")):
        assert path.read_bytes() in closure


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_block_runs_packed_4bit_projections(reference, dtype, tmp_path, monkeypatch):
    """NVFP4 quantises the attention projections too: the block runs them on the int8-dot kernel, bit-identical
    to fp4_linear, with no tile kernel forced (the engine attaches it on any CPU)."""
    arch, path, _, prompts = reference
    quantize_checkpoint(path, str(tmp_path / "nvfp4"), "nvfp4")
    llm = LLM(str(tmp_path / "nvfp4"), dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False)
    layers = llm.engine.runner.model.layers
    assert all(layer.self_attn.qkv_proj.fp4 is not None and layer.decode_block is not None for layer in layers)
    ran = count_calls(monkeypatch)
    fused = generate(llm, prompts)
    assert sum(ran) >= (NUM_NEW - 1) * len(layers)  # every decode step
    for layer in layers:
        layer.decode_block = None
    assert generate(llm, prompts) == fused


def count_rows(monkeypatch, cls) -> list:
    """Per call of cls (DecodeBlock, or layers/decode_stack.py's DecodeStack): the rows it ran, 0 where it
    stepped aside."""
    rows, call = [], cls.__call__

    def counted(self, positions, x, meta):
        out = call(self, positions, x, meta)
        rows.append(0 if out is None else x.shape[0])
        return out
    monkeypatch.setattr(cls, "__call__", counted)
    return rows


def check_speculative_verify_rows(path: str, prompts: list[list[int]], attach, cls, monkeypatch):
    """Greedy output with n-gram drafts is the plain output, bit for bit, and a step of verify rows (several a
    sequence) ran in cls; attach puts each engine's kernels in place."""
    repeated = [p[:6] * 4 for p in prompts]  # prompts the n-gram proposer finds drafts in
    plain = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    attach(plain)
    expected = generate(plain, repeated)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              speculative_config=spec)
    attach(llm)
    rows = count_rows(monkeypatch, cls)
    assert [out[0] for out in generate(llm, repeated)] == [out[0] for out in expected]
    assert llm.engine.get_stats().spec_decode.num_drafts > 0
    assert max(rows) > len(repeated)


def test_the_block_takes_speculative_verify_rows(reference, monkeypatch):
    """A speculating sequence's k + 1 verify rows reach attention as decodes of their own (rows_as_decodes):
    the block runs them."""
    arch, path, _, prompts = reference
    check_speculative_verify_rows(path, prompts, on_tile_kernels, DecodeBlock, monkeypatch)
