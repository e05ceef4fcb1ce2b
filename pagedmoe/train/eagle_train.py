"""Trains an EAGLE-3 head for a target model on a text corpus: the target (frozen, HF's own implementation)
runs online on each batch for its hidden states entering the aux layers and its next-token distributions;
the head (eagle_head.py) learns them with the multi-step unrolled loss; the target's embeddings and LM head
are used frozen. Exports an HF-style directory that `speculative_config={"method": "eagle3", "model": DIR}`
loads: config.json (LlamaForCausalLMEagle3) and model.safetensors with EAGLE-3's names."""
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedmoe.spec_decode.eagle import ARCHITECTURE, default_aux_layers
from pagedmoe.train.data import encode, read_splits
from pagedmoe.train.eagle_head import Eagle3TrainHead, ttt_loss


@dataclass
class EagleConfig:
    target: str = "models/pagedmoe-moe-default"
    out_dir: str = "runs/eagle3"
    corpus: str = "../shared/data/tinyshakespeare.txt"
    intermediate_size: int = 512
    seq_len: int = 256
    batch_size: int = 8
    num_steps: int = 4  # unrolled draft steps per position (training-time test)
    lr: float = 2e-3
    warmup_steps: int = 100
    max_steps: int = 2000
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2
    init: str = ""  # a head directory to start from (its model.safetensors), instead of a random head


def load_target(path: str):
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for param in target.parameters():
        param.requires_grad_(False)
    return target


def build_head(cfg: EagleConfig, target) -> tuple[Eagle3TrainHead, list[int]]:
    tc = target.config
    aux = default_aux_layers(tc.num_hidden_layers)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    head = Eagle3TrainHead(tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, head_dim,
                           cfg.intermediate_size, len(aux), tc.rms_norm_eps, tc.rope_parameters["rope_theta"])
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)
    return head, aux


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, aux: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states entering each aux layer (HF's hidden_states[i]), concatenated, and the logits."""
    out = target(tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in aux], dim=-1), out.logits


def learning_rate(cfg: EagleConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_eagle3(cfg: EagleConfig) -> Path:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_target(cfg.target), AutoTokenizer.from_pretrained(cfg.target)
    train_text, val_text = read_splits(cfg.corpus)
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    head, aux = build_head(cfg, target)
    if cfg.init:
        head.load_state_dict(load_file(str(Path(cfg.init) / "model.safetensors")))
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator, start, log = torch.Generator().manual_seed(cfg.seed), time.time(), []
    for step in (bar := tqdm(range(cfg.max_steps), desc="eagle3")):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss, accuracies = batch_loss(cfg, target, head, aux, random_windows(train_ids, cfg, generator))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=" ".join(f"{a:.2f}" for a in accuracies))
        log.append({"step": step, "loss": loss.item(), "accuracy_per_step": accuracies})
    validation = evaluate(cfg, target, head, aux, val_ids)
    return export(cfg, head, aux, target, {"minutes": (time.time() - start) / 60, "validation": validation,
                                           "last_train": log[-1]})


def random_windows(ids: torch.Tensor, cfg: EagleConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - cfg.seq_len, (cfg.batch_size,), generator=generator)
    return torch.stack([ids[s:s + cfg.seq_len] for s in starts.tolist()])


def batch_loss(cfg: EagleConfig, target, head, aux, tokens):
    fused, logits = target_features(target, tokens, aux)
    return ttt_loss(head, target.get_input_embeddings(), target.get_output_embeddings(), tokens, fused, logits,
                    cfg.num_steps)


@torch.no_grad()
def evaluate(cfg: EagleConfig, target, head, aux, val_ids: torch.Tensor, num_batches: int = 8) -> dict:
    """Top-1 agreement with the target per unrolled step on held-out windows (step s: draft s + 1)."""
    windows = val_ids[:num_batches * cfg.batch_size * cfg.seq_len].view(-1, cfg.seq_len)
    totals = [0.0] * cfg.num_steps
    for batch in windows.split(cfg.batch_size):
        _, accuracies = batch_loss(cfg, target, head, aux, batch)
        totals = [t + a / len(windows.split(cfg.batch_size)) for t, a in zip(totals, accuracies)]
    return {"top1_agreement_per_step": totals}


def export(cfg: EagleConfig, head, aux: list[int], target, record: dict) -> Path:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = target.config
    config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": tc.hidden_size,
              "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
              "head_dim": head.head_dim, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
              "rms_norm_eps": tc.rms_norm_eps, "vocab_size": tc.vocab_size, "draft_vocab_size": tc.vocab_size,
              "max_position_embeddings": tc.max_position_embeddings, "hidden_act": "silu",
              "rope_parameters": {"rope_type": "default", "rope_theta": head.rope_theta},
              "eagle_aux_hidden_state_layer_ids": aux, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: param.detach().contiguous() for name, param in head.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), **record}, indent=2) + "\n")
    return out
