import torch
from torch import Tensor


def copy_weight(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)
