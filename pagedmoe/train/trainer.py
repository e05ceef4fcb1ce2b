"""Training loop: AdamW + warmup/cosine, periodic validation, resumable checkpoints, tqdm progress."""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pagedmoe.train.balance import dropped_fraction, layer_stats
from pagedmoe.train.config import TrainConfig
from pagedmoe.train.data import encode, random_windows, read_splits, tiled_windows
from pagedmoe.train.model import build_model, routers_of
from pagedmoe.train.tokenizer import copy_tokenizer_files, load_tokenizer

CHECKPOINT = "checkpoint.pt"
BEST_MODEL = "best_model.pt"
METRICS = "metrics.jsonl"
CONFIG = "train_config.json"


@dataclass
class RunState:
    step: int = 0
    elapsed_s: float = 0.0
    best_val_loss: float = math.inf


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg: TrainConfig):
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = load_tokenizer(copy_tokenizer_files(cfg.tokenizer_dir, self.out_dir))
        train_text, val_text = read_splits(cfg.corpus, cfg.corpus_fraction)
        self.train_ids = encode(self.tokenizer, train_text)
        self.val_windows = tiled_windows(encode(self.tokenizer, val_text), cfg.seq_len, cfg.eval_batches * cfg.batch_size)
        self.model = build_model(cfg, self.tokenizer)
        self.routers = routers_of(self.model)
        self.optimizer = make_optimizer(self.model, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.state = RunState()
        self.metrics: list[dict] = []
        self.restore()

    def restore(self) -> None:
        path = self.out_dir / CHECKPOINT
        if not path.exists():
            return
        saved = torch.load(path, weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        self.state = RunState(**saved["state"])
        self.metrics = [m for m in read_metrics(self.out_dir) if m["step"] <= self.state.step]

    def save(self) -> None:
        saved = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "state": asdict(self.state),
        }
        torch.save(saved, self.out_dir / (CHECKPOINT + ".tmp"))
        (self.out_dir / (CHECKPOINT + ".tmp")).replace(self.out_dir / CHECKPOINT)
        self.cfg.save(self.out_dir / CONFIG)
        write_metrics(self.out_dir, self.metrics)

    def train_step(self, batch: torch.Tensor) -> tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.cfg, self.state.step)
        output = self.model(input_ids=batch, labels=batch)
        aux = sum((router.last_aux_loss for router in self.routers), torch.zeros(()))
        (output.loss + self.cfg.effective_aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for router in self.routers:
            router.after_step()
        return output.loss.item(), aux.detach().item()

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        losses, loads = [], [torch.zeros(self.cfg.num_experts) for _ in self.routers]
        for batch in self.val_windows.split(self.cfg.batch_size):
            losses.append(self.model(input_ids=batch, labels=batch).loss.item() * len(batch))
            loads = [total + router.last_load for total, router in zip(loads, self.routers)]
        self.model.train()
        record = {"kind": "eval", "step": self.state.step, "val_loss": sum(losses) / len(self.val_windows)}
        return record | {f"val_{k}": v for k, v in layer_stats(loads).items()} if self.routers else record

    def step_record(self, loss: float, aux: float, seconds: float) -> dict:
        record = {"kind": "train", "step": self.state.step, "loss": round(loss, 4), "aux": round(aux, 5)}
        record |= {"tokens_per_s": round(self.cfg.batch_size * self.cfg.seq_len / seconds, 1)}
        record |= {"elapsed_s": round(self.state.elapsed_s, 2), "lr": learning_rate(self.cfg, self.state.step - 1)}
        if self.routers:
            stats = layer_stats([router.last_load for router in self.routers])
            record |= {"cv": stats["cv"], "max_over_mean": stats["max_over_mean"], "dropped": dropped_fraction(self.routers)}
        return record

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and self.state.elapsed_s >= self.cfg.max_minutes * 60

    def run_evaluation(self) -> None:
        record = self.evaluate()
        self.metrics.append(record)
        if record["val_loss"] < self.state.best_val_loss:
            self.state.best_val_loss = record["val_loss"]
            torch.save(self.model.state_dict(), self.out_dir / BEST_MODEL)

    def one_step(self, bar: tqdm) -> None:
        start = time.perf_counter()
        batch = random_windows(self.train_ids, self.cfg.batch_size, self.cfg.seq_len, self.generator)
        loss, aux = self.train_step(batch)
        step_seconds = time.perf_counter() - start
        self.state.step += 1
        if self.state.step % self.cfg.eval_interval == 0:
            self.run_evaluation()
        if self.state.step % self.cfg.checkpoint_interval == 0:
            self.save()
        self.state.elapsed_s += time.perf_counter() - start
        self.metrics.append(self.step_record(loss, aux, step_seconds))
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.metrics[-1]['tokens_per_s']:.0f}")
        bar.update(1)

    def run(self) -> Path:
        with tqdm(total=self.cfg.max_steps, initial=self.state.step, desc=f"train {self.cfg.label}") as bar:
            while self.state.step < self.cfg.max_steps and not self.out_of_time():
                self.one_step(bar)
        if not any(m["kind"] == "eval" and m["step"] == self.state.step for m in self.metrics):
            self.run_evaluation()
        self.save()
        return self.out_dir


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_metrics(out_dir: Path, metrics: list[dict]) -> None:
    (Path(out_dir) / METRICS).write_text("".join(json.dumps(m) + "\n" for m in metrics))


def train(cfg: TrainConfig) -> Path:
    return Trainer(cfg).run()
