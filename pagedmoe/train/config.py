"""Training configuration: one dataclass, saved as JSON next to every checkpoint."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

ROUTERS = ("noisy_topk", "switch", "top2", "sigmoid_bias", "none")
DEFAULT_AUX_COEF = {"noisy_topk": 1e-1, "switch": 1e-2, "top2": 1e-2, "sigmoid_bias": 1e-4, "none": 0.0}
DEFAULT_CORPUS = "../shared/data/tinyshakespeare.txt"


@dataclass
class TrainConfig:
    out_dir: str = "runs/moe"
    tokenizer_dir: str = "runs/tokenizer"
    corpus: str = DEFAULT_CORPUS
    arch: str = "moe"
    router: str = "top2"
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float | None = None
    bias_update_speed: float = 1e-3
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 256
    dense_intermediate_size: int = 512
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 1000
    max_minutes: float | None = None
    eval_interval: int = 100
    eval_batches: int = 16
    checkpoint_interval: int = 100
    corpus_fraction: float = 1.0
    threads: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.arch not in ("moe", "dense"):
            raise ValueError(f"arch must be 'moe' or 'dense', got {self.arch!r}")

    @property
    def effective_top_k(self) -> int:
        return 1 if self.router == "switch" else self.top_k

    @property
    def label(self) -> str:
        return self.router if self.arch == "moe" else "dense"

    @property
    def effective_aux_coef(self) -> float:
        return DEFAULT_AUX_COEF[self.router] if self.aux_loss_coef is None else self.aux_loss_coef

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TrainConfig":
        return cls(**json.loads(Path(path).read_text()))

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)
