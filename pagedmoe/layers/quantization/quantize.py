"""`pagedmoe quantize --format mxfp4|nvfp4|fp8 SRC DST`: a float checkpoint rewritten with the tensors and config
that OpenAI (MXFP4 gpt-oss experts), NVIDIA ModelOpt (NVFP4, weights only) and DeepSeek (FP8, 128x128 blocks)
write, so such checkpoints can be made without a hub, and a bf16 model shrunk for CPU serving. Fused 3-D
experts are written per expert and projection, as ModelOpt and DeepSeek ship them. round_trip gives what the
written checkpoint decodes to, in the source layout (the dense twin tests compare HF against)."""
import json
import os
import shutil

import torch
from safetensors.torch import save_file

from pagedmoe.layers.quantization.config import QuantizationConfig
from pagedmoe.layers.quantization.fp8 import dequantize_fp8, quantize_fp8
from pagedmoe.layers.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import BLOCK as NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4

FORMATS = ("mxfp4", "nvfp4", "fp8")
DEFAULT_EXCLUDE = {
    "mxfp4": ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"),
    "nvfp4": ("lm_head", "model.embed_tokens", "model.layers.*.mlp.gate", "model.layers.*.mlp.router",
              "model.layers.*.mlp.shared_expert_gate"),
    "fp8": ("lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"),
}
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def plan(fmt: str, name: str, tensor: torch.Tensor, model_type: str) -> str | None:
    """How a tensor is written: "mxfp4_experts", "experts" / "gpt_oss_experts" (fused, split per expert),
    "linear" or None (as is)."""
    quant = QuantizationConfig(fmt, DEFAULT_EXCLUDE[fmt])
    fused = name.endswith(FUSED_EXPERTS) and tensor.dim() == 3
    if fmt == "mxfp4":
        return "mxfp4_experts" if fused and model_type == "gpt_oss" else None
    if fused:
        return "gpt_oss_experts" if model_type == "gpt_oss" else "experts"
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or tensor.dim() != 2 or ".layers." not in f".{module}" or quant.is_excluded(module):
        return None
    return "linear" if fmt == "fp8" or tensor.shape[-1] % NVFP4_BLOCK == 0 else None


def quantize_linear(fmt: str, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt == "nvfp4":
        return {f"{module}.{leaf}": t for leaf, t in quantize_nvfp4(weight).items()}
    q, scale_inv = quantize_fp8(weight)
    return {f"{module}.weight": q, f"{module}.weight_scale_inv": scale_inv}


def expert_matrices(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's fused [E, 2I, H] gate_up (gate rows first) and [E, H, I] down, as experts.E.{gate,up,down}_proj."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("down_proj"):
        return {f"{prefix}.{e}.down_proj": w for e, w in enumerate(tensor)}
    half = tensor.shape[1] // 2
    return {f"{prefix}.{e}.{proj}": w for e in range(len(tensor))
            for proj, w in (("gate_proj", tensor[e, :half]), ("up_proj", tensor[e, half:]))}


def gpt_oss_expert_matrices(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's fused [E, in, out] experts (gate and up interleaved along out) as experts.E.{gate,up,down}_proj
    [out, in] matrices."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("down_proj"):
        return {f"{prefix}.{e}.down_proj": w.T for e, w in enumerate(tensor)}
    return {f"{prefix}.{e}.{proj}": w[:, first::2].T for e, w in enumerate(tensor)
            for proj, first in (("gate_proj", 0), ("up_proj", 1))}


def quantize_tensor(fmt: str, name: str, tensor: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    kind = plan(fmt, name, tensor, model_type)
    if kind == "mxfp4_experts":
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
        return {name + "_blocks": blocks, name + "_scales": scales}
    if kind in ("experts", "gpt_oss_experts"):
        matrices = (expert_matrices if kind == "experts" else gpt_oss_expert_matrices)(name, tensor)
        return {k: v for module, w in matrices.items() for k, v in quantize_linear(fmt, module, w).items()}
    if kind == "linear":
        return quantize_linear(fmt, name.rsplit(".", 1)[0], tensor)
    return {name: tensor}


def round_trip_matrix(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    if fmt == "nvfp4":
        q = quantize_nvfp4(weight)
        return dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
    return dequantize_fp8(*quantize_fp8(weight))


def round_trip(fmt: str, name: str, tensor: torch.Tensor, model_type: str) -> torch.Tensor:
    """The float32 tensor the quantized checkpoint decodes to, in the source's layout."""
    kind = plan(fmt, name, tensor, model_type)
    if kind == "mxfp4_experts":
        return dequantize_mxfp4(*quantize_mxfp4(tensor.transpose(1, 2))).transpose(1, 2)
    if kind == "experts":
        half = tensor.shape[1] // 2 if name.endswith("gate_up_proj") else tensor.shape[1]
        return torch.stack([torch.cat([round_trip_matrix(fmt, part) for part in w.split(half)]) for w in tensor])
    if kind == "gpt_oss_experts":
        out = tensor.float().clone()
        for e, w in enumerate(tensor):
            for first in (0, 1) if name.endswith("gate_up_proj") else (None,):
                columns = slice(first, None, 2) if first is not None else slice(None)
                out[e][:, columns] = round_trip_matrix(fmt, w[:, columns].T).T
        return out
    return round_trip_matrix(fmt, tensor) if kind == "linear" else tensor


def quantization_config_json(fmt: str) -> dict:
    exclude = list(DEFAULT_EXCLUDE[fmt])
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": exclude}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": exclude}
    return {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "ignore": exclude,
            "producer": {"name": "pagedmoe"}, "kv_cache_quant_algo": None}


def quantize_checkpoint(src: str, dst: str, fmt: str) -> dict[str, int]:
    """Writes DST; returns the number of tensors quantized and the bytes before and after."""
    from pagedmoe.worker.model_loader import weight_files
    from safetensors import safe_open
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"src: {src!r} is already quantized ({config['quantization_config'].get('quant_method')})")
    out, stats = {}, {"quantized": 0, "bytes_before": 0, "bytes_after": 0}
    for path in weight_files(src):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                written = quantize_tensor(fmt, name, tensor, config.get("model_type", ""))
                stats["quantized"] += written.get(name) is not tensor
                stats["bytes_before"] += tensor.nbytes
                stats["bytes_after"] += sum(t.nbytes for t in written.values())
                out.update(written)
    if not stats["quantized"]:
        raise ValueError(f"src: no tensor of {src!r} takes the {fmt} format")
    write_checkpoint(src, dst, out, config | {"quantization_config": quantization_config_json(fmt)})
    return stats


def write_checkpoint(src: str, dst: str, tensors: dict[str, torch.Tensor], config: dict):
    os.makedirs(dst, exist_ok=True)
    for entry in os.listdir(src):  # the tokenizer and generation config come along
        if not entry.endswith((".safetensors", ".safetensors.index.json")) and entry != "config.json":
            if os.path.isfile(os.path.join(src, entry)):
                shutil.copy(os.path.join(src, entry), dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if config["quantization_config"]["quant_method"] == "modelopt":
        qc = config["quantization_config"]
        legacy = {"producer": qc["producer"], "quantization": {"quant_algo": qc["quant_algo"], "group_size": 16,
                                                               "exclude_modules": qc["ignore"],
                                                               "kv_cache_quant_algo": None}}
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(legacy, f, indent=2)
