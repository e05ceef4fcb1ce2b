"""Random-weight benchmark checkpoints (float32 safetensors), built with transformers.

    python scripts/make_bench_models.py OUT_DIR

writes OUT_DIR/qwen3-100m: a ~100M-parameter dense Qwen3-shaped model (hidden 768, 12 layers, 12 heads /
4 KV heads, head_dim 64, intermediate 2048, vocab 32000, tied embeddings), and OUT_DIR/qwen3-moe-100m-active:
the same shape with each MLP replaced by 8 experts of intermediate 1024, top-2 (active expert parameters per
token equal to the dense MLP's; ~280M total parameters, ~100M active). Each gets a word-level tokenizer, one token
per id, so a server can stream text. OUT_DIR/qwen3-100m-bf16 holds the dense model's weights in bfloat16 (a
bf16 checkpoint, for what `--dtype auto` picks on each CPU). For speculative decoding on the dense model:
OUT_DIR/qwen3-100m-draft, a 2-layer Qwen3 of hidden 256 with its vocabulary, and OUT_DIR/qwen3-100m-eagle3, an
EAGLE-3 head for it as `pagedmoe.train eagle3` exports one, untrained. Both have random weights, so their
drafts are rarely accepted: they measure what drafting costs, and what the adaptive switch saves of it.
OUT_DIR/gpt-oss-200m is gpt-oss-shaped (hidden 576, 10 layers alternating a 128-token window and full
attention, 9 heads / 3 KV heads of 64 with sinks, 16 experts of intermediate 576, top-4, vocab 32000, untied):
205M parameters, 66M active, for `pagedmoe bench quantization`.
"""
import os
import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers


def qwen3_100m_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                    num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                                    max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=None)


def qwen3_moe_config() -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                       moe_intermediate_size=1024, num_experts=8, num_experts_per_tok=2,
                                       norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=12,
                                       num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                                       tie_word_embeddings=True, eos_token_id=None)


def gpt_oss_200m_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(vocab_size=32000, hidden_size=576, intermediate_size=576, num_hidden_layers=10,
                                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_local_experts=16,
                                     num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
                                     tie_word_embeddings=False, eos_token_id=None)


def save_tokenizer(vocab_size: int, path: str):
    """One word-level token per id ("<17>"): random weights have no real vocabulary, but a server needs a
    tokenizer to detokenize its streams."""
    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)


def save(config, path: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(path)
    save_tokenizer(config.vocab_size, path)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{path}: {num_params / 1e6:.1f}M parameters")


def draft_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=None)


def save_eagle3_head(target: str, path: str, seed: int = 0):
    from pagedmoe.train.eagle_train import EagleConfig, build_head, export, load_target
    cfg = EagleConfig(target=target, out_dir=path, intermediate_size=2048, seed=seed)
    model = load_target(target)
    torch.manual_seed(seed)
    head, aux = build_head(cfg, model)
    export(cfg, head, aux, model, {})
    print(f"{path}: EAGLE-3 head, {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/bench-models"
    save(qwen3_100m_config(), os.path.join(out, "qwen3-100m"))
    save(qwen3_moe_config(), os.path.join(out, "qwen3-moe-100m-active"))
    save(qwen3_100m_config(), os.path.join(out, "qwen3-100m-bf16"), dtype=torch.bfloat16)
    save(draft_config(), os.path.join(out, "qwen3-100m-draft"), seed=1)
    save_eagle3_head(os.path.join(out, "qwen3-100m"), os.path.join(out, "qwen3-100m-eagle3"))
    save(gpt_oss_200m_config(), os.path.join(out, "gpt-oss-200m"))
