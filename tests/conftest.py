import platform
from pathlib import Path

import pytest
import torch
import transformers

from pagedmoe import cpu_info
from pagedmoe.engine.llm_engine import LLMEngine
from pagedmoe.train.config import TrainConfig
from pagedmoe.train.tokenizer import build_tokenizer
from pagedmoe.worker import model_runner

CORPUS = Path(__file__).resolve().parent / "data" / "shakespeare_excerpt.txt"  # see tests/data/README.md

VOCAB = 320
TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ") * 20


@pytest.fixture(autouse=True)
def fixed_engine_threads(monkeypatch):
    """Engines built in a test keep their thread count. The governor drops a thread while another process (the
    host, a kernel's compiler) holds a core, and MKL's float32 GEMM rounds differently at 1 and 2 threads (a 6-row
    linear here), so two runs a test compares bit for bit could differ. tests/test_cpu_threads.py tests the
    governor itself."""
    governor = model_runner.ThreadGovernor
    monkeypatch.setattr(model_runner, "ThreadGovernor",
                        lambda max_threads, adaptive=True, **kwargs: governor(max_threads, False, **kwargs))


def tiny_dense_config(arch: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=0, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_moe_config():
    return transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                       moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                       norm_topk_prob=True, max_position_embeddings=512, eos_token_id=None,
                                       bos_token_id=0, pad_token_id=0)


MOE_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=0, pad_token_id=0)
# tiny random MoE configs of every routed family (tests/distributed, tests/engine/test_expert_offload.py)
TINY_MOE_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**MOE_COMMON, intermediate_size=96, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**MOE_COMMON, intermediate_size=128, moe_intermediate_size=48,
                                                     shared_expert_intermediate_size=80, num_experts=8,
                                                     num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE_COMMON, head_dim=32, intermediate_size=128,
                                                     moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                                     norm_topk_prob=True),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **MOE_COMMON | {"num_hidden_layers": 3, "num_key_value_heads": 4}, intermediate_size=96,
        moe_intermediate_size=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
        n_routed_experts=8, first_k_dense_replace=1, n_shared_experts=1, num_experts_per_tok=3,
        routed_scaling_factor=2.5, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True),
    "gpt_oss": lambda: transformers.GptOssConfig(**MOE_COMMON | {"num_hidden_layers": 3}, head_dim=32,
                                                 intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                                 sliding_window=8),
}


def save_random_model(cfg, path, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def dense_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_random_model(tiny_dense_config(request.param), path)
    return str(path), model


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """A tiny Qwen3 with a real (tiny) byte-level BPE tokenizer and chat template."""
    path = tmp_path_factory.mktemp("qwen3-text")
    tokenizer = save_tokenizer(path)
    cfg = tiny_dense_config("qwen3", eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = save_random_model(cfg, path, seed=1)
    return str(path), model, tokenizer


def make_prompts(num: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def pagedmoe_greedy(path: str, prompts: list[list[int]], num_new: int, **kwargs) -> list[list[int]]:
    """pagedmoe's float32 greedy tokens for token-id prompts; the pool is checked free afterwards."""
    from pagedmoe import LLM, SamplingParams
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return [o.outputs[0].token_ids for o in outputs]


def pagedmoe_prompt_logprobs(path: str, prompts: list[list[int]], **kwargs) -> list[list[float]]:
    """Each prompt token's logprob after the tokens before it, from pagedmoe in float32."""
    from pagedmoe import LLM, SamplingParams
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return [[out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))] for p, out in zip(prompts, outputs)]


def max_logprob_error(hf_model, prompts: list[list[int]], logprobs: list[list[float]]) -> float:
    """The largest difference between those logprobs and HF's for the same prompts."""
    errors = []
    for prompt, row in zip(prompts, logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1)
        errors += [abs(lp - ref[i, prompt[i + 1]].item()) for i, lp in enumerate(row)]
    return max(errors)


def assert_all_blocks_free(engine: LLMEngine):
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.kv.host_pool.num_free_blocks == engine.kv.host_pool.num_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_counts)


# trainer fixtures (tests/train)

@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(str(CORPUS), tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture
def tiny_config(tmp_path, tokenizer_dir):
    def make(**changes) -> TrainConfig:
        base = TrainConfig(
            out_dir=str(tmp_path / "run"),
            tokenizer_dir=str(tokenizer_dir),
            corpus=str(CORPUS),
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=16,
            num_experts=4,
            moe_intermediate_size=32,
            dense_intermediate_size=64,
            seq_len=32,
            batch_size=8,
            max_steps=6,
            warmup_steps=2,
            eval_interval=1000,
            eval_batches=2,
            checkpoint_interval=1000,
            corpus_fraction=1.0,
            threads=1,
        )
        return base.replace(**changes)

    return make


# what each x86-64 level adds that its code may use (Linux /proc/cpuinfo names; abm is LZCNT)
X86_64_LEVELS = {"x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"),
                 "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}


def missing_for(target: str) -> str | None:
    """Why this CPU cannot run code built for target, or None; from the real flags, never the override."""
    if not cpu_info.is_x86():
        return f"{target} is an x86-64 target; this CPU is {platform.machine()}"
    levels = list(X86_64_LEVELS)[:list(X86_64_LEVELS).index(target) + 1]
    missing = [f for level in levels for f in X86_64_LEVELS[level] if f not in cpu_info.detected_cpu_flags()]
    return f"{target} needs {missing[0]}" if missing else None


def x86_targets() -> list:
    """The -march targets a kernel test builds for: AVX2 and AVX-512 where this CPU runs them, and native."""
    return [pytest.param(t, marks=pytest.mark.skipif(bool(missing_for(t)), reason=str(missing_for(t))))
            for t in ("x86-64-v3", "x86-64-v4")] + ["native"]
