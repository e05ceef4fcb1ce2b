"""Model card: data, configuration, parameter counts, validation loss, command, wall time, samples."""

import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedmoe.train.config import TrainConfig
from pagedmoe.train.data import resolve_corpus
from pagedmoe.train.export import load_trained
from pagedmoe.train.model import parameter_counts
from pagedmoe.train.trainer import CONFIG, read_metrics

SAMPLE_PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY VI:\nMy lords,"]
CHAT_SAMPLE = [{"role": "juliet", "content": "Where art thou?"}]
PURPOSE = {
    "moe": "the default model bundled with pagedmoe (Mixture of Experts)",
    "dense": "a dense draft model sharing the default model's tokenizer, meant for speculative decoding",
}
ROUTING_NOTES = {
    "noisy_topk": "Gaussian noise on the router logits (the noise projection is not exported)",
    "switch": "top-1 with expert capacity (tokens over capacity skipped the layer) and a load-balancing loss",
    "top2": "top-2 with expert capacity (GShard; over-capacity assignments dropped) and a load-balancing loss",
    "sigmoid_bias": "sigmoid affinities, a selection bias updated after each step, a small sequence-wise loss",
    "none": "plain softmax top-k, no balancing",
}
CARD = """---
library_name: transformers
pipeline_tag: text-generation
---

# {title}

A tiny model trained from scratch by `pagedmoe.train` on CPU: {purpose}.

## Data

- {corpus}: first 90% train, last 10% validation
- tokenizer: byte-level BPE, vocab {vocab}, trained with HF `tokenizers` on the training split;
  `<|endoftext|>` is bos and eos; the chat template renders each message as `ROLE:\\ncontent\\n\\n` (play format)

## Configuration

{config}

## Parameters

- total {total:,}
- active per token {active:,}
- size on disk {size_mb:.2f} MB (weights, config and tokenizer files)

## Validation

- validation loss {best_loss:.4f} nats/token (perplexity {best_ppl:.1f}) at the exported step {best_step}
- last step {final_step}: {final_loss:.4f}

## Training

{training}

```bash
{command}
```

## Samples

Temperature 0.8, top-k 40, 120 new tokens, seed 0, loaded with `AutoModelForCausalLM.from_pretrained`.

{samples}
"""


def generate_samples(model_dir: Path, max_new_tokens: int = 120, seed: int = 0) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template(CHAT_SAMPLE, tokenize=False, add_generation_prompt=True, speaker="romeo")
    torch.manual_seed(seed)
    return [sample_one(model, tokenizer, prompt, max_new_tokens) for prompt in SAMPLE_PROMPTS + [chat]]


def sample_one(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    settings = dict(do_sample=True, temperature=0.8, top_k=40, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(model.generate(ids, max_new_tokens=max_new_tokens, **settings)[0], skip_special_tokens=True)


def config_lines(cfg: TrainConfig, hf_config: dict) -> list[str]:
    lines = [f"- architecture `{hf_config['architectures'][0]}`, stored as `{hf_config.get('dtype')}`"]
    lines.append(f"- hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, tied embeddings")
    if cfg.arch == "dense":
        return lines + [f"- dense MLP, intermediate {cfg.dense_intermediate_size}"]
    lines.append(f"- MoE in every layer: {cfg.num_experts} experts (intermediate {cfg.moe_intermediate_size}), "
                 f"top-{cfg.effective_top_k}, router `{cfg.router}`")
    lines.append(f"- training routing: {ROUTING_NOTES[cfg.router]}; aux coefficient {cfg.effective_aux_coef}")
    return lines + ["- inference routing (this checkpoint): the HF class's own routing, i.e. the trained router "
                    "without noise and without capacity drops"]


def training_lines(cfg: TrainConfig, steps: int, wall_s: float) -> list[str]:
    return [
        f"- {steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens = {steps * cfg.batch_size * cfg.seq_len:,} tokens",
        f"- AdamW lr {cfg.lr}, warmup {cfg.warmup_steps}, cosine to {cfg.min_lr_ratio}x, weight decay {cfg.weight_decay}",
        f"- wall time {wall_s / 60:.1f} min on {cfg.threads} CPU thread(s) of a shared machine, seed {cfg.seed}",
    ]


def corpus_line(cfg: TrainConfig) -> str:
    path = resolve_corpus(cfg.corpus)
    fraction = "" if cfg.corpus_fraction == 1.0 else f", the first {cfg.corpus_fraction:.0%} of it"
    return f"`{cfg.corpus}` ({path.stat().st_size:,} bytes{fraction})"


def card_fields(run_dir: Path, hf_config: dict) -> dict:
    cfg = TrainConfig.load(run_dir / CONFIG)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if m["kind"] == "train"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    best = min(evals, key=lambda m: m["val_loss"])
    counts = parameter_counts(load_trained(run_dir)[0], cfg)
    return dict(
        purpose=PURPOSE[cfg.arch], corpus=corpus_line(cfg), vocab=hf_config["vocab_size"], config="\n".join(config_lines(cfg, hf_config)),
        total=counts["total"], active=counts["active"], best_loss=best["val_loss"], best_ppl=math.exp(best["val_loss"]),
        best_step=best["step"], final_step=evals[-1]["step"], final_loss=evals[-1]["val_loss"],
        training="\n".join(training_lines(cfg, len(steps), steps[-1]["elapsed_s"])),
    )


def write_model_card(model_dir: str | Path, run_dir: str | Path, command: str, title: str) -> Path:
    model_dir = Path(model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    size_mb = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file() and p.name != "README.md") / 1e6
    samples = "\n\n".join(f"```text\n{sample}\n```" for sample in generate_samples(model_dir))
    fields = card_fields(Path(run_dir), hf_config)
    text = CARD.format(title=title, command=command, samples=samples, size_mb=size_mb, **fields)
    (model_dir / "README.md").write_text(text)
    return model_dir / "README.md"
