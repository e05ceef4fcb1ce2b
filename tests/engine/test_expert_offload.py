"""Expert offloading (layers/moe/offload): with an expert cache of 1, 2 and half the experts of each layer,
greedy float32 tokens equal the all-resident engine's and prompt logprobs stay within 1e-4 (slots plain or
packed for the CPU MoE kernel, LRU or LFU, each prefetch mode), on tiny Mixtral,
Qwen3-MoE, DeepSeek-V3 and gpt-oss checkpoints (gpt-oss: all experts fused in one tensor) and the bundled
model, with chunked prefill and a pool small enough to force preemption; the pool is free afterwards, the cache
never holds more than its budget and the model keeps no dense copy of the experts."""
import os

import pytest
import transformers

from conftest import MOE_COMMON, TINY_MOE_CONFIGS, assert_all_blocks_free, make_prompts, save_random_model
from pagedmoe import LLM, SamplingParams

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "models", "pagedmoe-moe-default")
CONFIGS = {arch: TINY_MOE_CONFIGS[arch] for arch in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")}
NUM_NEW = 24
# chunks of at most 24 tokens; 12 blocks of 16 for 8 sequences of up to 40 + 24 tokens: preemption is forced
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=24, num_kv_blocks=12)


def generate(path: str, prompts, **engine_args):
    llm = LLM(path, **ENGINE, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    return outputs, stats, llm.engine.runner.model


def prompt_logprobs(output) -> list[float]:
    return [output.prompt_logprobs[i][t].logprob for i, t in enumerate(output.prompt_token_ids) if i]


def expert_bytes(model) -> tuple[int, int, int]:
    """An expert's float32 bytes, the MoE layers and the experts a layer."""
    layer = model.moe_layers[0]
    cache = layer.expert_cache
    return (cache.expert_bytes if cache else (layer.w13[0].numel() + layer.w2[0].numel()) * 4,
            len(model.moe_layers), layer.num_experts)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each model's checkpoint and the all-resident engine's outputs, made on first use."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = BUNDLED if arch == "bundled" else str(tmp_path_factory.mktemp(arch))
            if arch != "bundled":
                save_random_model(CONFIGS[arch](), path)
            prompts = make_prompts(8, seed=5, max_len=40)
            outputs, _, model = generate(path, prompts)
            cache[arch] = path, prompts, outputs, expert_bytes(model)
        return cache[arch]
    return get


CASES = [(arch, slots) for arch in [*CONFIGS, "bundled"] for slots in (1, 2, "half")]


@pytest.mark.parametrize("arch, slots", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_offloaded_experts_match_all_resident(references, arch, slots):
    path, prompts, expected, (per_expert, num_layers, num_experts) = references(arch)
    num_slots = num_experts // 2 if slots == "half" else slots
    budget = num_slots * per_expert * num_layers + per_expert - 1  # not enough for one more slot a layer
    policy = "lfu" if slots == 2 else "lru"
    kernel = slots != 2  # the slots packed for the CPU MoE kernel, or plain (one expert at a time)
    prefetch = "slots" if slots == "half" else "readahead" if slots == 1 else "off"
    swap = {"preemption_mode": "swap"} if arch == "mixtral" else {}
    got, stats, model = generate(path, prompts, expert_cache_memory=budget, expert_cache_policy=policy,
                                 cpu_moe_kernel=kernel, expert_prefetch=prefetch, **swap)
    assert all((layer.expert_cache.kernel is not None) == kernel for layer in model.moe_layers)
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        errors = [abs(a - b) for a, b in zip(prompt_logprobs(out), prompt_logprobs(want))]
        assert max(errors) < 1e-4
    cache = stats.expert_cache
    assert cache.num_slots == num_slots and cache.resident_bytes <= budget
    assert all(len(resident) <= num_slots for resident in cache.resident)
    assert cache.misses > 0 and cache.bytes_loaded == (cache.misses + cache.prefetch_loads) * per_expert
    assert all(layer.w13.numel() == 0 and layer.w2.numel() == 0 for layer in model.moe_layers)


def test_budget_below_one_expert_a_layer_is_refused(references):
    path, _, _, (per_expert, num_layers, _) = references("qwen3_moe")
    with pytest.raises(ValueError, match="expert_cache_memory"):
        LLM(path, **ENGINE, expert_cache_memory=per_expert * num_layers - 1)


@pytest.mark.parametrize("field, value", [("expert_cache_memory", 0), ("expert_cache_memory", "1GB"),
                                          ("expert_cache_policy", "fifo"), ("expert_prefetch", True)])
def test_bad_settings_name_the_field(references, field, value):
    path = references("qwen3_moe")[0]
    with pytest.raises(ValueError, match=field):
        LLM(path, **ENGINE, **{field: value})


RSS_SCRIPT = """
import sys
from pagedmoe import LLM, SamplingParams

def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

path, budget = sys.argv[1], int(sys.argv[2])
before = rss()
llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, expert_cache_memory=budget)
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
llm.generate([{"prompt_token_ids": list(range(1, 40))}, {"prompt_token_ids": list(range(50, 60))}], params,
             use_tqdm=False)
print(rss() - before, llm.engine.get_stats().expert_cache.resident_bytes)
"""


def test_process_memory_grows_by_the_budget_not_the_experts(tmp_path):
    """In fresh processes: RSS growth with 2 of 16 experts a layer resident is below the growth with all 16
    by at least 80% of the 14 experts a layer not held (the checkpoint is read with pread, never mapped)."""
    import subprocess
    import sys
    config = transformers.Qwen3MoeConfig(**MOE_COMMON | {"hidden_size": 256}, head_dim=32, intermediate_size=256,
                                         moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2)
    save_random_model(config, str(tmp_path))
    per_expert, num_layers = 3 * 256 * 512 * 4, 2

    def growth(num_slots: int) -> int:
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(num_slots * per_expert * num_layers)],
                             capture_output=True, text=True, timeout=300, check=True)
        grown, resident = map(int, out.stdout.split()[-2:])
        assert resident == num_slots * per_expert * num_layers
        return grown
    not_held = 14 * per_expert * num_layers  # 2 x 14 x 1.5 MiB = 42 MiB
    assert growth(2) <= growth(16) - 0.8 * not_held
