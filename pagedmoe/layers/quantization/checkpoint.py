"""A checkpoint's tensors as the dense ones a model loads: each quantized weight (with its scale tensors, from
whichever file holds them) decoded exactly to float32 under the name of its dense counterpart, or with packed
set, each 4-bit one as a PackedFp4Weight (MXFP4 experts: a list of them, one an expert); every other tensor as
stored. Bad scales are refused here, naming the tensor."""
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open

from pagedmoe.layers.quantization.config import QuantizationConfig
from pagedmoe.layers.quantization.fp4_kernel import PackedFp4Weight
from pagedmoe.layers.quantization.fp8 import check_fp8, dequantize_fp8
from pagedmoe.layers.quantization.mxfp4 import check_mxfp4, dequantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import check_global_scale, check_nvfp4, dequantize_nvfp4


class Checkpoint:
    """Every tensor of a set of safetensors files, by name."""

    def __init__(self, files: list[str], stack: ExitStack):
        self.handles = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt"))
            self.handles.update({name: handle for name in handle.keys()})

    def get(self, name: str) -> torch.Tensor | None:
        handle = self.handles.get(name)
        return None if handle is None else handle.get_tensor(name)

    def dtype_of(self, name: str) -> torch.dtype:
        return self.handles[name].get_slice(name).get_dtype()


def checkpoint_tensors(files: list[str], quant: QuantizationConfig | None, packed: bool = False,
                       skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """skip: names never read (offloaded experts)."""
    with ExitStack() as stack:
        checkpoint = Checkpoint(files, stack)
        decoder = DECODERS[quant.method](checkpoint, quant, packed) if quant is not None else None
        for name in (n for n in checkpoint.handles if n not in skip):
            decoded = decoder.decode(name) if decoder is not None else (name, checkpoint.get(name))
            if decoded is not None:
                yield decoded


class Decoder:
    """decode(name): (dense name, tensor), or None for a scale tensor that its weight consumes."""

    def __init__(self, checkpoint: Checkpoint, quant: QuantizationConfig, packed: bool = False):
        self.checkpoint, self.quant, self.packed = checkpoint, quant, packed

    def decode(self, name: str) -> tuple[str, torch.Tensor] | None:
        raise NotImplementedError

    def check_not_excluded(self, module: str):
        if self.quant.is_excluded(module):
            raise ValueError(f"{module}: quantized in the checkpoint, but its quantization config excludes it")


class Mxfp4Decoder(Decoder):
    """`X_blocks` + `X_scales` -> `X` in HF's dense gpt-oss layout ([experts, in, out])."""

    def decode(self, name):
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in self.checkpoint.handles:
            return None
        if not name.endswith("_blocks"):
            return name, self.checkpoint.get(name)
        base = name.removesuffix("_blocks")
        self.check_not_excluded(base.rsplit(".", 1)[0])
        blocks, scales = self.checkpoint.get(name), self.checkpoint.get(base + "_scales")
        if scales is None:
            raise ValueError(f"{base}_scales: missing for {name}")
        check_mxfp4(base, blocks, scales)
        if self.packed and blocks.dim() == 4:
            return base, [PackedFp4Weight.from_mxfp4(b, s) for b, s in zip(blocks, scales)]
        return base, dequantize_mxfp4(blocks, scales).transpose(-1, -2).contiguous()


class ScaledWeightDecoder(Decoder):
    """`M.weight` stored in a narrow dtype beside its scale tensors -> the dense `M.weight`."""
    weight_dtype: torch.dtype
    scale_names: tuple[str, ...]

    def decode(self, name):
        module, _, leaf = name.rpartition(".")
        if leaf in self.scale_names and self.is_quantized(module):
            return None
        if leaf != "weight" or not self.is_quantized(module):
            return name, self.checkpoint.get(name)
        self.check_not_excluded(module)
        return name, self.dequantize(module)

    def is_quantized(self, module: str) -> bool:
        weight = module + ".weight"
        return weight in self.checkpoint.handles and self.checkpoint.dtype_of(weight) == self.dtype_name

    @property
    def dtype_name(self) -> str:
        return {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}[self.weight_dtype]

    def scale(self, module: str, leaf: str) -> torch.Tensor | None:
        return self.checkpoint.get(f"{module}.{leaf}")


class Nvfp4Decoder(ScaledWeightDecoder):
    weight_dtype, scale_names = torch.uint8, ("weight_scale", "weight_scale_2", "input_scale")

    def dequantize(self, module):
        weight, weight_scale = self.checkpoint.get(module + ".weight"), self.scale(module, "weight_scale")
        if weight_scale is None:
            raise ValueError(f"{module}.weight_scale: missing for an NVFP4 weight")
        scale_2 = self.scale(module, "weight_scale_2")
        check_nvfp4(module, weight, weight_scale, scale_2)
        if (input_scale := self.scale(module, "input_scale")) is not None:
            check_global_scale(f"{module}.input_scale", input_scale)
        if self.packed and weight.dim() == 2:
            return PackedFp4Weight.from_nvfp4(weight, weight_scale, scale_2)
        return dequantize_nvfp4(weight, weight_scale, scale_2)


class Fp8Decoder(ScaledWeightDecoder):
    weight_dtype, scale_names = torch.float8_e4m3fn, ("weight_scale_inv",)

    def dequantize(self, module):
        weight, scale_inv = self.checkpoint.get(module + ".weight"), self.scale(module, "weight_scale_inv")
        check_fp8(module, weight, scale_inv)
        return dequantize_fp8(weight, scale_inv)


DECODERS = {"mxfp4": Mxfp4Decoder, "nvfp4": Nvfp4Decoder, "fp8": Fp8Decoder}
