"""Which kernels a model runs: "auto" is Triton on CUDA (where triton imports) and the PyTorch path on CPU,
whose decode attention and MoE then take the C++ kernels; "triton" on CPU runs the Triton kernels in Triton's
interpreter (slow: for tests)."""
import importlib.util
import logging

import torch

from pagedmoe.config import EngineConfig

logger = logging.getLogger(__name__)


def select_attention_backend(config: EngineConfig) -> str:
    return _select("attention_backend", config.attention_backend, config.device)


def select_moe_backend(config: EngineConfig) -> str:
    return _select("moe_backend", config.moe_backend, config.device)


def _select(name: str, choice: str, device: str) -> str:
    if choice == "auto":
        if torch.device(device).type != "cuda":
            return "torch"
        if importlib.util.find_spec("triton") is None:
            logger.warning("%s: triton is not installed; CUDA runs the PyTorch path", name)
            return "torch"
        return "triton"
    if choice == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"{name}: 'triton' needs the triton package (pip install triton)")
    return choice
