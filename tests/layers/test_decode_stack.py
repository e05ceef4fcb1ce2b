"""The decode stack (layers/decode_stack.py): every layer of a model for a step of decodes in one C++ call must
give bit-identical tokens and logprobs to the layers run one by one (through their decode blocks, or their
modules), and match HF's greedy tokens in float32: Llama and Qwen3, and the sparse Qwen3-MoE and Mixtral (their
expert load counted alike), float32 and bfloat16, on the AMX tiles and on the vector tiles. Where it does not
apply the layers run: prefill steps, EAGLE-3's hidden states, the last layer's row selection, rows over a
kernel's limit; models with sliding-window layers, shared experts or MoE layers off the kernels never take it."""
import pytest
import torch

from conftest import TINY_MOE_CONFIGS, hf_greedy, make_prompts, save_random_model, tiny_dense_config
from pagedmoe import LLM
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.moe import cpu_kernel, cpu_router
from pagedmoe.layers.attention.metadata import MAX_SHORT_QUERY
from pagedmoe.layers.cpu_linear import ANY_ROWS, CpuLinear
from pagedmoe.layers.decode_stack import HALVES_ROW_TOKENS, DecodeStack, attach_decode_stack
from test_decode_block import NUM_NEW, check_speculative_verify_rows, count_rows, generate, on_tile_kernels


def saved_reference(name: str, config, tmp_path_factory):
    """The tiny random model saved (its path), HF's model and six prompts."""
    path = tmp_path_factory.mktemp(name)
    model = save_random_model(config, path, seed=3)
    return str(path), model, make_prompts(6, seed=5, max_len=30)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def reference(request, tmp_path_factory):
    return saved_reference(request.param, tiny_dense_config(request.param), tmp_path_factory)


def stacked(llm: LLM, amx: bool = True):
    """The model with its linears on the tile kernel at any row count (gate_up too: on_tile_kernels leaves it
    to MKL), its decode blocks and its stack."""
    on_tile_kernels(llm, amx)
    model = llm.engine.runner.model
    for layer in model.layers:
        gate_up = layer.mlp.gate_up_proj
        gate_up.cpu_kernel = CpuLinear(gate_up.weight, max_rows=ANY_ROWS, gated=True)
        if gate_up.cpu_kernel.on_amx and not amx:
            gate_up.cpu_kernel.on_amx, gate_up.cpu_kernel.fn = False, cpu_linear.load_library().gated_linear_bf16
    assert attach_decode_stack(model)
    return model


def run_stacked(reference, dtype: str, amx: bool, attach, monkeypatch, run=generate):
    """An engine on the reference's model with attach's kernels and stack: it, the model and run's output, whose
    decode steps ran in the stack and prefill steps did not."""
    path, _, prompts = reference
    llm = LLM(path, dtype=dtype, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False)
    model = attach(llm, amx)
    rows = count_rows(monkeypatch, DecodeStack)
    output = run(llm, prompts)
    assert sum(map(bool, rows)) >= NUM_NEW - 1 and not all(rows)
    return llm, model, output


@pytest.mark.parametrize("dtype, amx", [("float32", False), ("bfloat16", True), ("bfloat16", False)])
def test_the_stack_equals_the_layers(reference, dtype, amx, monkeypatch):
    prompts = reference[2]
    llm, model, fused = run_stacked(reference, dtype, amx, stacked, monkeypatch)
    model.decode_stack = None
    assert generate(llm, prompts) == fused
    for layer in model.layers:
        layer.decode_block = None
    assert generate(llm, prompts) == fused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dense_stack_in_halves_equals_it_whole(reference, dtype, monkeypatch):
    """On 2 threads, from halves_min_rows decodes, a dense stack runs two halves of the sequences, a thread
    each: the same tokens and logprobs as the stack whole and as the layers (11 prompts, split by their work)."""
    llm = LLM(reference[0], dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False, num_threads=2)
    model, prompts = stacked(llm, amx=False), make_prompts(11, seed=7, max_len=30)
    halves, in_halves = [], DecodeStack.in_halves

    def counted(stack, rows):
        halves.append(in_halves(stack, rows))
        return halves[-1]
    monkeypatch.setattr(DecodeStack, "in_halves", counted)
    model.decode_stack.halves_min_rows = 2
    split = generate(llm, prompts)
    assert any(halves)
    model.decode_stack.halves_min_rows, halves[:] = 1 << 62, []
    assert generate(llm, prompts) == split and halves and not any(halves)
    model.decode_stack = None
    assert generate(llm, prompts) == split


def test_the_halves_split_a_step_by_its_work(reference):
    """The second half starts where the rows' projections (HALVES_ROW_TOKENS each) and contexts are even;
    0 (the stack whole) below halves_min_rows."""
    llm = LLM(reference[0], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False, num_threads=2)
    stack = stacked(llm, amx=False).decode_stack
    stack.halves_min_rows = 4
    assert stack.halves_split(8, torch.full((8,), 100)) == 4
    assert stack.halves_split(3, torch.full((3,), 100)) == 0
    row = HALVES_ROW_TOKENS
    assert stack.halves_split(8, torch.tensor([3 * row, 3 * row] + [0] * 6)) == 2  # 8 rows' work against 6
    assert stack.halves_split(4, torch.tensor([0, 0, 0, 20 * row])) == 3  # never an empty half
    assert stack.halves_split(5, torch.tensor([row, 0, 0, 0, 0])) == 2


def check_hf_greedy(reference, attach, monkeypatch):
    """Float32 greedy tokens with the stack running (attach puts it in place), preemptions included, are HF's."""
    path, model, prompts = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=14, preemption_mode="recompute")
    attach(llm)
    rows = count_rows(monkeypatch, DecodeStack)
    tokens = [out[0] for out in generate(llm, prompts)]
    assert any(rows)
    assert tokens == [hf_greedy(model, p, NUM_NEW) for p in prompts]


def test_the_stack_matches_hf_greedy(reference, monkeypatch):
    check_hf_greedy(reference, stacked, monkeypatch)


def test_the_stack_steps_aside_over_a_kernels_rows(reference, monkeypatch):
    path, _, prompts = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    model = stacked(llm)
    expected = generate(llm, prompts)
    calls = []
    model.decode_stack.fn = lambda *args: calls.append(args)
    model.decode_stack.max_rows = len(prompts) - 1
    rows = count_rows(monkeypatch, DecodeStack)
    assert generate(llm, prompts) == expected
    assert calls == [] and max(rows) == 0


@pytest.mark.parametrize("reason", ["aux hidden layers", "output rows", "prefill"])
def test_the_stack_steps_aside_for_the_step(reference, reason):
    """EAGLE-3 keeps some layers' inputs, and a step that reads only some rows selects them before the last
    layer's MLP: the loop over the layers does both. A prefill over MAX_SHORT_QUERY tokens is no decode."""
    path, _, _ = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    model = stacked(llm)
    calls = []
    model.decode_stack.fn = lambda *args: calls.append(args)
    runner = llm.engine.runner
    tokens = [list(range(1, MAX_SHORT_QUERY + 3))] if reason == "prefill" else [[1], [2]]
    with torch.inference_mode():
        input_ids, positions, meta = runner._inputs(tokens, [0] * len(tokens), [[0, 1, 2]] * len(tokens))
        meta.aux_hidden_layers = (1,) if reason == "aux hidden layers" else ()
        meta.output_rows = torch.tensor([0]) if reason == "output rows" else None
        assert model.decode_stack(positions, model.embed_tokens(input_ids), meta) is None
    assert calls == []


def test_the_stack_takes_speculative_verify_rows(reference, monkeypatch):
    """A speculating sequence's verify rows are decodes of their own to the stack, as to the decode block."""
    path, _, prompts = reference
    check_speculative_verify_rows(path, prompts, stacked, DecodeStack, monkeypatch)


def test_models_the_stack_cannot_run_keep_their_layers(reference, tmp_path):
    path, _, _ = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    model = stacked(llm)
    model.layers[1].mlp.down_proj.cpu_kernel = None
    with pytest.raises(ValueError, match="decode stack: not every MLP runs on the tile kernel"):
        DecodeStack(model)
    assert not attach_decode_stack(model) and model.decode_stack is None
    model.layers[1].mlp.down_proj.cpu_kernel = model.layers[0].mlp.down_proj.cpu_kernel
    model.layers[0].decode_block.window = 8
    assert not attach_decode_stack(model)
    save_random_model(TINY_MOE_CONFIGS["qwen2_moe"](), tmp_path)  # shared experts: the MoE kernel has none
    moe_llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    on_tile_kernels(moe_llm)
    assert not attach_decode_stack(moe_llm.engine.runner.model)


def test_the_engine_attaches_the_stack_where_the_kernels_run(tmp_path):
    """As the decode blocks: bfloat16 linears take the tile kernel at any size on AMX and on AVX2-only CPUs;
    float32 ones this small stay on MKL. cpu_decode_block=False takes the blocks and the stack away."""
    save_random_model(tiny_dense_config("llama"), tmp_path)
    assert LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True).engine.runner.model.decode_stack is None
    model = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True).engine.runner.model
    on_kernels = all(layer.self_attn.o_proj.cpu_kernel is not None and layer.mlp.down_proj.cpu_kernel is not None
                     for layer in model.layers)
    assert (model.decode_stack is not None) == on_kernels
    off = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, cpu_decode_block=False)
    assert off.engine.runner.model.decode_stack is None


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_reference(request, tmp_path_factory):
    return saved_reference(request.param, TINY_MOE_CONFIGS[request.param](), tmp_path_factory)


def moe_stacked(llm: LLM, amx: bool = True):
    """The MoE model's attention on the tile kernel, its experts on the fused-MoE kernel (amx False: bf16 on the
    vector tiles), its decode blocks and its stack."""
    on_tile_kernels(llm, amx)
    model = llm.engine.runner.model
    for moe in model.moe_layers:
        assert moe.cpu_router is not None and moe.cpu_experts is not None
        if moe.cpu_experts.amx_fn is not None and not amx:
            moe.cpu_experts.amx_fn, moe.cpu_experts.fn = None, cpu_kernel.load_library().fused_moe_bf16
    assert attach_decode_stack(model)
    return model


def generate_counting(llm: LLM, prompts: list[list[int]]):
    """generate's output, and the expert load the engine counted for it."""
    before = llm.engine.expert_load.clone()
    return generate(llm, prompts), (llm.engine.expert_load - before).tolist()


@pytest.mark.parametrize("dtype, amx", [("float32", False), ("bfloat16", True), ("bfloat16", False)])
def test_the_moe_stack_equals_the_layers(moe_reference, dtype, amx, monkeypatch):
    prompts = moe_reference[2]
    llm, model, (fused, load) = run_stacked(moe_reference, dtype, amx, moe_stacked, monkeypatch, generate_counting)
    # top-2 of every token the first layer ran; the last layer runs only the rows sampled from
    assert [sum(load[0]), sum(load[-1])] == [2 * sum(len(p) + NUM_NEW - 1 for p in prompts), 2 * len(prompts) * NUM_NEW]
    model.decode_stack = None
    assert generate_counting(llm, prompts) == (fused, load)


def test_the_moe_stack_matches_hf_greedy(moe_reference, monkeypatch):
    check_hf_greedy(moe_reference, moe_stacked, monkeypatch)


def test_the_moe_stack_takes_the_rows_its_kernels_take(moe_reference):
    """The router's limit, and the experts' where they are not on AMX tiles; experts repacked since the stack was
    built step aside, and an MoE layer off the fused kernel (as offloaded or expert-parallel ones) keeps the
    layers."""
    path, _, _ = moe_reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    model = moe_stacked(llm)
    experts = model.moe_layers[0].cpu_experts
    assert not model.decode_stack.in_halves(64)  # each half's experts would read their weights again
    assert model.decode_stack.max_rows == min(cpu_router.MAX_TOKENS, experts.max_pairs // 2,
                                              model.layers[0].decode_block.max_rows)
    repacked = cpu_kernel.CpuFusedMoE(model.moe_layers[1].w13, model.moe_layers[1].w2)
    model.moe_layers[1].cpu_experts, experts = repacked, model.moe_layers[1].cpu_experts
    assert not model.decode_stack.same_experts()  # as EPLB repacks moved experts: the stack steps aside
    model.moe_layers[1].cpu_experts = experts
    assert model.decode_stack.same_experts()
    model.moe_layers[1].cpu_experts = None
    with pytest.raises(ValueError, match="not every MLP runs on the tile kernel or the CPU router and MoE kernel"):
        DecodeStack(model)
