"""vLLM's engine arguments that EngineConfig has no field for, or whose meaning differs on CPU: mapped onto a
field (gpu_memory_utilization on CPU), checked (tokenizer_mode) or accepted without effect."""
import logging
from dataclasses import fields

from pagedmoe.config import EngineConfig

TOKENIZER_MODES = ("auto", "hf")
logger = logging.getLogger(__name__)


def engine_config(model: str, **kwargs) -> EngineConfig:
    kwargs = _map_vllm_args(kwargs)
    unknown = set(kwargs) - _config_fields()
    if unknown:
        raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
    return EngineConfig(model=model, **kwargs)


def _map_vllm_args(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    _check_tokenizer_mode(kwargs.pop("tokenizer_mode", "auto"))
    if kwargs.pop("trust_remote_code", False):
        logger.info("trust_remote_code is ignored: pagedmoe never runs a checkpoint's code")
    kwargs.pop("disable_log_stats", None)  # pagedmoe logs no periodic stats
    if "gpu_memory_utilization" in kwargs and kwargs.get("device", "cpu") == "cpu":
        kwargs["kv_cache_memory_fraction"] = _memory_fraction(kwargs)
    return kwargs


def _config_fields() -> set[str]:
    return {f.name for f in fields(EngineConfig) if f.init}


def _check_tokenizer_mode(mode):
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be one of {TOKENIZER_MODES} (HF fast tokenizers), got {mode!r}")


def _memory_fraction(kwargs: dict) -> float:
    """vLLM's gpu_memory_utilization on CPU: the fraction of available memory the KV pool may take (on CUDA
    it is EngineConfig's field of that name)."""
    value = kwargs.pop("gpu_memory_utilization")
    if "kv_cache_memory_fraction" in kwargs:
        raise ValueError("gpu_memory_utilization: give it or kv_cache_memory_fraction, not both")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    return float(value)
