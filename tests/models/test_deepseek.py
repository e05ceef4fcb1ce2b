"""DeepSeek-V2/V3 (MLA over a latent-only paged cache) against HF transformers in float32: greedy tokens,
prompt logprobs, chunked prefill, forced preemption, legacy config keys, an MTP-layer checkpoint, KV bytes."""
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import VOCAB, assert_all_blocks_free, hf_greedy, make_prompts
from pagedmoe import LLM, SamplingParams

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, first_k_dense_replace=1,
              max_position_embeddings=512, eos_token_id=None, bos_token_id=0, pad_token_id=0)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim, "beta_fast": 32, "beta_slow": 1}


def deepseek_configs():
    v3 = dict(COMMON, n_shared_experts=1, num_experts_per_tok=3, routed_scaling_factor=2.5)
    return {
        "v3": transformers.DeepseekV3Config(**v3, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True,
                                            rope_parameters=yarn(1.0, 0.8)),
        "v3_legacy_mtp": transformers.DeepseekV3Config(**v3, q_lora_rank=None, n_group=2, topk_group=1,
                                                       norm_topk_prob=False, rope_parameters=yarn(0.9, 1.0)),
        "v3_neox_rope": transformers.DeepseekV3Config(**v3, q_lora_rank=40, n_group=4, topk_group=2,
                                                      rope_interleave=False, rope_parameters=yarn(1.0, 1.0)),
        "v3_default_rope_tied": transformers.DeepseekV3Config(**v3, q_lora_rank=None, n_group=1, topk_group=1,
                                                              tie_word_embeddings=True),
        "v2": transformers.DeepseekV2Config(**dict(COMMON, num_experts_per_tok=2), q_lora_rank=40, n_group=4,
                                            topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
                                            routed_scaling_factor=1.5, rope_parameters=yarn(0.707, 0.707)),
    }


def save_deepseek(cfg, path, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.5, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def add_mtp_layer(path, cfg):
    """Append a DeepSeek multi-token-prediction module as layer num_hidden_layers, as released checkpoints do."""
    file = os.path.join(path, "model.safetensors")
    tensors, last, mtp = load_file(file), cfg.num_hidden_layers - 1, cfg.num_hidden_layers
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = tensors[name].clone()
    hidden = cfg.hidden_size
    extra = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
             "eh_proj.weight": torch.randn(hidden, 2 * hidden), "embed_tokens.weight": torch.randn(VOCAB, hidden),
             "shared_head.norm.weight": torch.ones(hidden), "shared_head.head.weight": torch.randn(VOCAB, hidden)}
    tensors |= {f"model.layers.{mtp}.{name}": t for name, t in extra.items()}
    save_file(tensors, file, metadata={"format": "pt"})


def to_legacy_config(path):
    """Rewrite config.json the way released DeepSeek-V3 checkpoints spell it (rope_theta + rope_scaling)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"], rope["type"] = rope.pop("rope_theta"), rope.pop("rope_type")
    for key in ("head_dim", "qk_head_dim", "num_mtp_layers"):
        cfg.pop(key, None)
    cfg |= dict(rope_scaling=rope, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
                num_nextn_predict_layers=1, transformers_version="4.33.1")
    with open(file, "w") as f:
        json.dump(cfg, f)


def build_checkpoint(name: str, path):
    cfg = deepseek_configs()[name]
    model = save_deepseek(cfg, path, seed=3)
    if name == "v3_legacy_mtp":
        add_mtp_layer(path, cfg)
        to_legacy_config(path)
    return str(path), model


NUM_NEW = 32
GREEDY_MODELS = ["v3", "v3_legacy_mtp", "v2"]
SCENARIOS = {"batch": dict(), "chunked": dict(max_num_batched_tokens=20),
             "recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
             "swap": dict(num_kv_blocks=12, preemption_mode="swap")}


@pytest.fixture(scope="module", params=list(deepseek_configs()))
def checkpoint(request, tmp_path_factory):
    return (request.param, *build_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module", params=GREEDY_MODELS)
def reference(request, tmp_path_factory):
    path, model = build_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-greedy"))
    prompts = make_prompts(8, seed=11, max_len=48)
    return path, prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_deepseek_greedy_matches_hf(reference, scenario):
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if scenario in ("recompute", "swap"):
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{scenario}") > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("chunk", [None, 7])
def test_deepseek_prompt_logprobs_match_hf(checkpoint, chunk):
    _, path, model = checkpoint
    prompts = make_prompts(3, seed=5, max_len=50)
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        diffs = [abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
                 for i in range(1, len(prompt))]
        assert max(diffs) < 1e-4
    assert_all_blocks_free(llm.engine)


def test_deepseek_checkpoint_features_are_exercised(checkpoint):
    name, path, hf_model = checkpoint
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=4)
    model, cfg = llm.engine.runner.model, llm.engine.config.hf_config
    assert [hasattr(layer.mlp, "moe_index") for layer in model.layers] == [False, True, True]
    attn = model.layers[0].self_attn.attn
    assert attn.scale == hf_model.model.layers[0].self_attn.scaling
    if cfg.rope_parameters["rope_type"] == "yarn":
        assert attn.scale != pytest.approx((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    if name.startswith("v3"):
        bias = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0 and torch.equal(model.layers[1].mlp.e_score_correction_bias, bias)
    if name == "v3_legacy_mtp":
        with open(os.path.join(path, "config.json")) as f:
            assert "rope_parameters" not in json.load(f)
        assert cfg.rope_parameters["rope_type"] == "yarn"
        assert any(n.startswith("model.layers.3.") for n in load_file(os.path.join(path, "model.safetensors")))


def mla_kv_elements(cfg) -> int:
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def full_kv_elements(cfg) -> int:
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


def test_kv_cache_holds_only_the_latent(checkpoint):
    _, path, _ = checkpoint
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=5, block_size=8)
    runner, cfg = llm.engine.runner, llm.engine.config.hf_config
    cache = runner.kv_cache.device_cache
    bytes_per_token_layer = cache.numel() * cache.element_size() // (cfg.num_hidden_layers * 5 * 8)
    assert bytes_per_token_layer == runner.block_bytes // (cfg.num_hidden_layers * 8)
    assert bytes_per_token_layer == mla_kv_elements(cfg) * torch.float32.itemsize
    full_bytes = full_kv_elements(cfg) * torch.float32.itemsize
    assert full_bytes > bytes_per_token_layer
    real = transformers.DeepseekV3Config()
    print(f"\nKV bytes/token/layer, tiny model float32: MLA {bytes_per_token_layer} vs full K/V {full_bytes} "
          f"({full_bytes / bytes_per_token_layer:.1f}x); DeepSeek-V3 bf16: MLA {mla_kv_elements(real) * 2} vs "
          f"full K/V {full_kv_elements(real) * 2} ({full_kv_elements(real) / mla_kv_elements(real):.1f}x)")
