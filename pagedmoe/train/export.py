"""Export a training run as a plain HF checkpoint (config.json + model.safetensors + tokenizer).

The exported model is a freshly built HF model of the export class loaded with the trainer's
state dict; trainer-only tensors (the noisy router's noise projection) are left out. Routing
at inference is the HF class's own: no noise and no capacity drops.
"""

from pathlib import Path

import torch
from transformers import PreTrainedModel

from pagedmoe.train.config import TrainConfig
from pagedmoe.train.model import build_model, hf_model_class
from pagedmoe.train.tokenizer import copy_tokenizer_files, load_tokenizer
from pagedmoe.train.trainer import BEST_MODEL, CHECKPOINT, CONFIG

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trained_state(run_dir: Path, use_best: bool = True) -> dict:
    if use_best and (run_dir / BEST_MODEL).exists():
        return torch.load(run_dir / BEST_MODEL)
    return torch.load(run_dir / CHECKPOINT, weights_only=False)["model"]


def load_trained(run_dir: str | Path, use_best: bool = True) -> tuple[PreTrainedModel, TrainConfig]:
    run_dir = Path(run_dir)
    cfg = TrainConfig.load(run_dir / CONFIG)
    model = build_model(cfg, load_tokenizer(run_dir))
    model.load_state_dict(trained_state(run_dir, use_best))
    return model.eval(), cfg


def trainer_only_keys(model: PreTrainedModel, cfg: TrainConfig) -> list[str]:
    exported = hf_model_class(cfg)(model.config).state_dict().keys()
    return sorted(set(model.state_dict()) - set(exported))


def to_hf(model: PreTrainedModel, cfg: TrainConfig) -> PreTrainedModel:
    clean = hf_model_class(cfg)(model.config)
    state = model.state_dict()
    clean.load_state_dict({key: state[key] for key in clean.state_dict()}, strict=True)
    return clean.eval()


def export(run_dir: str | Path, out_dir: str | Path, dtype: str = "float32", use_best: bool = True) -> Path:
    model, cfg = load_trained(run_dir, use_best)
    out_dir = Path(out_dir)
    to_hf(model, cfg).to(DTYPES[dtype]).save_pretrained(str(out_dir))
    copy_tokenizer_files(run_dir, out_dir)
    return out_dir
