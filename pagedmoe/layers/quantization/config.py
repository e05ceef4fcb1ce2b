"""Which format a checkpoint's weights are in, and which modules it leaves unquantized, read from the checkpoint:
config.json's `quantization_config` (quant_method "mxfp4", "fp8" or "modelopt"), or ModelOpt's older
hf_quant_config.json. Exclusions are fnmatch patterns of module names; a pattern also covers the modules
under it (vLLM #28072), and "model." prefixes are matched with or without."""
import json
import os
from dataclasses import dataclass
from fnmatch import fnmatch

METHODS = ("mxfp4", "nvfp4", "fp8")
VLLM_NAMES = {"mxfp4": "mxfp4", "modelopt_fp4": "nvfp4", "modelopt": "nvfp4", "nvfp4": "nvfp4", "fp8": "fp8"}


def check_requested(requested: str | None, found: "QuantizationConfig | None", model_dir: str):
    """vLLM's --quantization: the method the checkpoint must hold (pagedmoe quantizes nothing online)."""
    if requested is None:
        return
    if requested not in VLLM_NAMES:
        raise ValueError(f"quantization: {requested!r} is not supported; known: {sorted(VLLM_NAMES)}")
    if found is None:
        raise ValueError(f"quantization: {requested!r} asked for, but the checkpoint in {model_dir!r} is not "
                         "quantized (write one with `pagedmoe quantize`)")
    if VLLM_NAMES[requested] != found.method:
        raise ValueError(f"quantization: {requested!r} asked for, but the checkpoint holds {found.method}")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str
    exclude: tuple[str, ...] = ()

    def is_excluded(self, module: str) -> bool:
        names = {module, module.removeprefix("model.")}
        return any(fnmatch(name, p) or fnmatch(name, p + ".*") or fnmatch(name, p.removeprefix("model."))
                   for name in names for p in self.exclude)


def read_quantization_config(model_dir: str, hf_config) -> QuantizationConfig | None:
    legacy = os.path.join(model_dir, "hf_quant_config.json")
    config = getattr(hf_config, "quantization_config", None)
    if config is None and os.path.isfile(legacy):
        with open(legacy) as f:
            return _modelopt(json.load(f).get("quantization", {}), "hf_quant_config.json: quantization")
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = str(config.get("quant_method", "")).lower()
    if method == "mxfp4":
        return QuantizationConfig("mxfp4", tuple(config.get("modules_to_not_convert") or ()))
    if method == "fp8":
        return _fp8(config)
    if method == "modelopt":
        return _modelopt(config, "quantization_config")
    raise ValueError(f"quantization_config.quant_method: {method!r} is not supported; known: mxfp4, fp8, modelopt")


def _fp8(config: dict) -> QuantizationConfig:
    if list(config.get("weight_block_size") or []) != [128, 128]:
        raise ValueError(f"quantization_config.weight_block_size: only [128, 128] blocks are supported, got "
                         f"{config.get('weight_block_size')}")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("quantization_config.activation_scheme: only 'dynamic' is supported (weights only)")
    return QuantizationConfig("fp8", tuple(config.get("modules_to_not_convert") or ()))


def _modelopt(config: dict, where: str) -> QuantizationConfig:
    algo = str(config.get("quant_algo", "")).upper()
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise ValueError(f"{where}.quant_algo: {algo!r} is not supported; known: NVFP4, W4A16_NVFP4")
    group_size = config.get("group_size") or _group_size(config)
    if group_size != 16:
        raise ValueError(f"{where}.group_size: NVFP4 groups are 16 elements, got {group_size}")
    return QuantizationConfig("nvfp4", tuple(config.get("exclude_modules") or config.get("ignore") or ()))


def _group_size(config: dict) -> int | None:
    for group in (config.get("config_groups") or {}).values():
        return (group.get("weights") or {}).get("group_size")
    return None
