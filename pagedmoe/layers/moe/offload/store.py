"""Where each routed expert's weights lie in the checkpoint's safetensors files, and reading one expert's
bytes straight into a slot (pread, no memory map, so the pages read never count as the process's own)."""
import json
import os
import re
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

# Routed expert weights: one an expert (Mixtral, Qwen-MoE, DeepSeek, OLMoE) or all experts fused (gpt-oss);
# biases, routers and shared experts stay resident.
EXPERT_WEIGHT = re.compile(r"(^|\.)experts\.(\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|gate_up_proj|down_proj)$")
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True)
class ExpertWeightRef:
    """A checkpoint tensor left on disk: its file, the offset of its first byte, dtype and shape."""
    name: str
    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def read(self, index: int | None = None) -> Tensor:
        """The tensor, or with index its index-th slice along the first dim (one expert of a fused tensor)."""
        shape = self.shape if index is None else self.shape[1:]
        out = torch.empty(shape, dtype=self.dtype)
        nbytes = out.numel() * out.element_size()
        if index is not None and not 0 <= index < self.shape[0]:
            raise ValueError(f"{self.name}: expert {index} out of range for {self.shape[0]}")
        read_exactly(self.path, self.offset + (index or 0) * nbytes, out)
        return out

    def advise(self, index: int | None = None):
        """Asks the kernel to read the tensor (or its index-th slice) into the page cache, asynchronously."""
        nbytes = self.numel() * self.dtype.itemsize // (1 if index is None else self.shape[0])
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, self.offset + (index or 0) * nbytes, nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def read_into(self, dst: Tensor):
        """Reads the tensor into dst, converting its dtype where they differ."""
        if tuple(dst.shape) != self.shape:
            raise ValueError(f"{self.name}: expected shape {tuple(dst.shape)}, got {self.shape}")
        if dst.dtype == self.dtype and dst.is_contiguous() and dst.device.type == "cpu":
            read_exactly(self.path, self.offset, dst)
        else:
            dst.copy_(self.read())


def read_exactly(path: str, offset: int, dst: Tensor):
    view = memoryview(dst.view(torch.uint8).reshape(-1).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            num_read = os.preadv(fd, [view[done:]], offset + done)
            if num_read <= 0:
                raise ValueError(f"{path}: ends before byte {offset + len(view)}")
            done += num_read
    finally:
        os.close(fd)


def expert_refs(path: str) -> dict[str, ExpertWeightRef]:
    """The routed expert weights of a safetensors file, as references (the format: an 8-byte little-endian
    header length, a JSON header of dtype, shape and data offsets, then the data)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return {name: ExpertWeightRef(name, path, 8 + header_len + info["data_offsets"][0],
                                  _dtype(name, info["dtype"]), tuple(info["shape"]))
            for name, info in header.items() if is_expert_weight(name)}


def _dtype(name: str, code: str) -> torch.dtype:
    if code not in SAFETENSORS_DTYPES:
        raise ValueError(f"expert_cache_memory: expert weight {name} is {code}; offloaded experts must be "
                         f"one of {sorted(SAFETENSORS_DTYPES)} (quantized checkpoints are not offloaded yet)")
    return SAFETENSORS_DTYPES[code]


def is_expert_weight(name: str) -> bool:
    return EXPERT_WEIGHT.search(name) is not None
