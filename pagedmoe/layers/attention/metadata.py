import math
from dataclasses import dataclass

import torch

from pagedmoe.layers.attention.cpu_kernel import PagedDecodeKernel, check_tables
from pagedmoe.memory import empty_huge


class Workspace:
    """A grow-only scratch buffer that every layer and step reuses for gathered context. On CPU a fresh
    tensor over glibc's mmap threshold (32 MB) is page-faulted in on every use, which cost more than the gather."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.buffer = torch.empty(0, dtype=dtype, device=device)

    def get(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        if self.buffer.numel() < numel:
            self.buffer = empty_huge((numel,), self.buffer.dtype, self.buffer.device)
        return self.buffer[:numel].view(shape)


CHUNK_BYTES = 8 << 20  # CPU decode chunks: gathered context well inside a 32 MB L3


@dataclass
class DecodeChunk:
    """Decoding sequences attended together, padded to the longest among them."""
    token_index: torch.Tensor  # [n] step-token index of each sequence's query
    context_index: torch.Tensor  # [num_kv_tensors * n * num_blocks] rows of a layer's cache viewed [-1, block]
    padding: torch.Tensor  # [1, n, 1, num_blocks * block_size] gathered positions that are not context


@dataclass
class AttentionGroup:
    """Sequences attended together: all decodes, or all prefill chunks."""
    token_index: torch.Tensor  # [B, max_query_len] step-token index of each padded query row
    valid: torch.Tensor  # [B, max_query_len] which padded rows are real tokens
    block_tables: torch.Tensor  # [B, num_blocks] blocks covering the longest context in the group
    mask: torch.Tensor  # [B, 1, max_query_len, num_blocks * block_size] causal mask over the context
    context_index: torch.Tensor  # [num_kv_tensors, B, num_blocks] rows of a layer's cache viewed as [-1, block]
    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    seq_lens_tensor: torch.Tensor  # [B] the same, on the device
    decode_chunks: list[DecodeChunk]  # empty when a decode kernel attends the group

    @property
    def is_decode(self) -> bool:
        return self.token_index.shape[1] == 1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    kv_caches: torch.Tensor  # [num_layers, ...] paged storage, one entry per layer
    groups: list[AttentionGroup]
    block_size: int
    workspace: Workspace
    decode_kernel: PagedDecodeKernel | None = None  # CPU: attends decode groups in place
    expert_load: torch.Tensor | None = None  # [num_moe_layers, num_experts] tokens routed this step


def build_attention_metadata(query_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             slot_mapping: torch.Tensor, kv_caches: torch.Tensor, block_size: int,
                             workspace: Workspace, decode_kernel: PagedDecodeKernel | None = None
                             ) -> AttentionMetadata:
    device = workspace.buffer.device
    query_start = torch.cumsum(query_lens, 0) - query_lens
    is_decode = query_lens == 1
    groups = [_build_group(sel, query_lens, seq_lens, query_start, block_tables, block_size, kv_caches, device,
                           plan_chunks=decode_kernel is None)
              for sel in (is_decode, ~is_decode) if sel.any()]
    if decode_kernel is not None:  # once per step: the kernel then skips the check in each layer
        for group in (g for g in groups if g.is_decode):
            check_tables(group.block_tables, group.seq_lens_tensor, kv_caches.shape[2], block_size)
    return AttentionMetadata(slot_mapping.to(device), kv_caches, groups, block_size, workspace, decode_kernel)


def _build_group(sel, query_lens, seq_lens, query_start, block_tables, block_size, kv_caches,
                 device, plan_chunks: bool) -> AttentionGroup:
    query_lens, seq_lens, query_start = query_lens[sel], seq_lens[sel], query_start[sel]
    rows = torch.arange(int(query_lens.max()))
    valid = rows[None, :] < query_lens[:, None]
    token_index = torch.where(valid, query_start[:, None] + rows[None, :], 0)
    num_blocks = -(-int(seq_lens.max()) // block_size)
    query_pos = (seq_lens - query_lens)[:, None] + rows[None, :]
    key_pos = torch.arange(num_blocks * block_size)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    tables = block_tables[sel, :num_blocks]
    context_index = torch.arange(kv_caches.shape[1])[:, None, None] * kv_caches.shape[2] + tables[None]
    block_bytes = kv_caches[0, :, 0].numel() * kv_caches.element_size()
    chunks = _decode_chunks(token_index[:, 0], context_index, mask, seq_lens, block_size, block_bytes,
                            device) if rows.numel() == 1 and plan_chunks else []
    return AttentionGroup(token_index.to(device), valid.to(device), tables.to(device), mask.to(device),
                          context_index.to(device), query_start.tolist(), query_lens.tolist(), seq_lens.tolist(),
                          seq_lens.to(device), chunks)


def _decode_chunks(token_index, context_index, mask, seq_lens, block_size, block_bytes,
                   device) -> list[DecodeChunk]:
    """Longest context first, in chunks padded only to their own longest; on CPU each chunk's gathered context
    stays cache-resident (CHUNK_BYTES) between the gather and the two matmuls that read it."""
    order = torch.argsort(seq_lens, descending=True, stable=True)
    chunks, start = [], 0
    while start < len(order):
        num_blocks = -(-int(seq_lens[order[start]]) // block_size)
        size = max(1, CHUNK_BYTES // (num_blocks * block_bytes)) if device.type == "cpu" else len(order)
        rows = order[start:start + size]
        chunks.append(DecodeChunk(token_index[rows].to(device),
                                  context_index[:, rows, :num_blocks].flatten().to(device),
                                  ~mask[rows, 0, 0, :num_blocks * block_size][None, :, None].to(device)))
        start += size
    return chunks
