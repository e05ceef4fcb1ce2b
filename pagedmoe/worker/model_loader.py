import json
import logging
import os
from glob import glob

import torch
from safetensors import safe_open

from pagedmoe.config import EngineConfig
from pagedmoe.layers.linear import attach_cpu_kernels, pack_weights
from pagedmoe.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir!r} (pickled checkpoints are never loaded)")
    return files


def prepare_model(config: EngineConfig) -> torch.nn.Module:
    """The model loaded, its weights pre-packed and its CPU kernels attached, as the config asks."""
    return finish_model(load_model(config), config)


def finish_model(model: torch.nn.Module, config: EngineConfig) -> torch.nn.Module:
    if config.prepack_weights:
        pack_weights(model)
    if torch.device(config.device).type == "cpu":
        try:
            if config.cpu_linear_kernel:
                attach_cpu_kernels(model, {"linear"})
            if config.cpu_moe_kernel:  # at every size: one call for all experts beats a matmul per expert
                attach_cpu_kernels(model, {"moe"}, min_bytes=0)
        except RuntimeError as error:
            logger.warning("linear and MoE layers fall back to oneDNN / MKL: %s", error)
    return model


def load_model(config: EngineConfig) -> torch.nn.Module:
    cls = resolve_model_class(config.hf_config)
    with torch.device(config.device):
        model = cls(config.hf_config)
    num_loaded = load_weights(model, config.model)
    num_expected = num_weight_elements(model)
    if num_loaded != num_expected:
        raise ValueError(f"model: checkpoint in {config.model!r} filled {num_loaded} of {num_expected} "
                         "weight elements; weights are missing or duplicated")
    return model.to(dtype=config.torch_dtype).eval()


def num_weight_elements(model: torch.nn.Module) -> int:
    """Elements of the model's weights, each shared (tied) tensor counted once."""
    return sum(t.numel() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())


def load_weights(model: torch.nn.Module, model_dir: str) -> int:
    """Every tensor of the directory's safetensors offered to model.load_weight; the elements it took."""
    num_loaded = 0
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if model.load_weight(name, tensor):
                    num_loaded += tensor.numel()
    return num_loaded
