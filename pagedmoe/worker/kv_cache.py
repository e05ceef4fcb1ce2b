import math
import os

import torch

from pagedmoe.engine.kv_cache_manager import BlockTransfers


class KVCacheStorage:
    """Paged KV storage: [num_layers, num_kv_tensors, num_blocks, block_size, *token_shape] on the device,
    plus a host pool of the same block shape for swapped-out blocks. All block copies go through `apply`."""

    def __init__(self, num_layers: int, num_kv_tensors: int, token_shape: tuple[int, ...], num_blocks: int,
                 num_host_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_tensors, num_blocks, block_size, *token_shape)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, num_kv_tensors, num_host_blocks, block_size, *token_shape)
        pin = torch.device(device).type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    def apply(self, transfers: BlockTransfers):
        if transfers.swap_out:
            src, dst = zip(*transfers.swap_out)
            self.host_cache[:, :, list(dst)] = self.device_cache[:, :, list(src)].cpu()
        if transfers.swap_in:
            src, dst = zip(*transfers.swap_in)
            self.device_cache[:, :, list(dst)] = self.host_cache[:, :, list(src)].to(self.device_cache.device)
        if transfers.copy:
            src, dst = zip(*transfers.copy)
            self.device_cache[:, :, list(dst)] = self.device_cache[:, :, list(src)]


def block_bytes(num_layers: int, num_kv_tensors: int, token_shape: tuple[int, ...], block_size: int,
                dtype: torch.dtype) -> int:
    return num_layers * num_kv_tensors * block_size * math.prod(token_shape) * dtype.itemsize


def available_memory(device: torch.device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
