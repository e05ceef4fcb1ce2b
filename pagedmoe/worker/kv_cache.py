import math
import os
import tempfile

import torch

from pagedmoe.memory import zeros_huge
from safetensors.torch import load_file, save_file

from pagedmoe.engine.kv_cache_manager import BlockTransfers


class KVCacheStorage:
    """Paged KV storage: [num_layers, num_kv_tensors, num_blocks, block_size, *token_shape] on the device,
    a host pool of the same block shape (swap preemption and the offload tier share it) and an optional
    disk tier (one safetensors file per block hash). Every block copy goes through `_copy_blocks`."""

    copy_kernel = None  # copies within the device pool: Triton's (triton_cache_ops.copy_blocks) where it runs

    def __init__(self, num_layers: int, num_kv_tensors: int, token_shape: tuple[int, ...], num_blocks: int,
                 num_host_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 disk_dir: str | None = None):
        shape = (num_layers, num_kv_tensors, num_blocks, block_size, *token_shape)
        self.device_cache = zeros_huge(shape, dtype, device)
        host_shape = (num_layers, num_kv_tensors, num_host_blocks, block_size, *token_shape)
        if torch.device(device).type == "cuda":
            self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=True)
        else:
            self.host_cache = zeros_huge(host_shape, dtype)
        self.disk_dir = tempfile.mkdtemp(prefix="kv-", dir=disk_dir) if disk_dir is not None else None

    def prefault(self, num_bytes: int | None = None) -> int:
        """Writes the first blocks of the CPU pool, up to num_bytes in all (None: every block), and returns how
        many. The pool is a lazily zeroed mapping (zeros_huge), and the block pool hands out its blocks in turn
        (freed ones go to the back), so a long run keeps reaching fresh pages: every run of a throughput
        benchmark paid 0.7-1.2 s of first touches in its 49 s (AVX2 EPYC VM)."""
        cache = self.device_cache
        if cache.device.type != "cpu":
            return 0
        block_bytes = cache[:, :, 0].numel() * cache.element_size()
        num_blocks = cache.shape[2] if num_bytes is None else min(cache.shape[2], max(num_bytes, 0) // block_bytes)
        cache[:, :, :num_blocks].zero_()
        return num_blocks

    def apply(self, transfers: BlockTransfers):
        device, host = self.device_cache, self.host_cache
        for host_id, block_hash in transfers.spill:
            save_file({"kv": host[:, :, host_id].contiguous()}, self._path(block_hash))
        self.apply_copies(transfers)
        for block_hash, block_id in transfers.load_disk:
            device[:, :, block_id] = load_file(self._path(block_hash))["kv"].to(device.device)
        for block_hash in transfers.delete:
            os.remove(self._path(block_hash))

    def apply_copies(self, transfers: BlockTransfers):
        """The copies between device and host blocks, in BlockTransfers' order."""
        device, host = self.device_cache, self.host_cache
        _copy_blocks(device, host, transfers.offload)
        _copy_blocks(device, host, transfers.swap_out)
        _copy_blocks(host, device, transfers.swap_in)
        if self.copy_kernel is not None:
            self.copy_kernel(device, transfers.copy)
        else:
            _copy_blocks(device, device, transfers.copy)
        _copy_blocks(host, device, transfers.load_host)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.disk_dir, block_hash.hex() + ".safetensors")


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]):
    if pairs:
        src_ids, dst_ids = zip(*pairs)
        dst[:, :, list(dst_ids)] = src[:, :, list(src_ids)].to(dst.device)


def block_bytes(num_layers: int, num_kv_tensors: int, token_shape: tuple[int, ...], block_size: int,
                dtype: torch.dtype) -> int:
    return num_layers * num_kv_tensors * block_size * math.prod(token_shape) * dtype.itemsize


def available_memory(device: torch.device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
