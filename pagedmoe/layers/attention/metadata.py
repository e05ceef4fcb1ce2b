import math
from dataclasses import dataclass

import torch

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


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded SDPA call: all decodes, or all prefill chunks."""
    token_index: torch.Tensor  # [B, max_query_len] step-token index of each padded query row
    valid: torch.Tensor  # [B, max_query_len] which padded rows are real tokens
    block_tables: torch.Tensor  # [B, num_blocks] blocks covering the longest context in the group
    mask: torch.Tensor  # [B, 1, max_query_len, num_blocks * block_size] causal mask over the context
    context_index: torch.Tensor  # [num_kv_tensors, B, num_blocks] rows of a layer's cache viewed as [-1, block]
    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]

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
    expert_load: torch.Tensor | None = None  # [num_moe_layers, num_experts] tokens routed this step


def build_attention_metadata(query_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             slot_mapping: torch.Tensor, kv_caches: torch.Tensor, block_size: int,
                             workspace: Workspace) -> AttentionMetadata:
    device = workspace.buffer.device
    query_start = torch.cumsum(query_lens, 0) - query_lens
    is_decode = query_lens == 1
    num_kv_tensors, num_cache_blocks = kv_caches.shape[1:3]
    groups = [_build_group(sel, query_lens, seq_lens, query_start, block_tables, block_size, device)
              for sel in (is_decode, ~is_decode) if sel.any()]
    for group in groups:
        head_offsets = torch.arange(num_kv_tensors, device=device)[:, None, None] * num_cache_blocks
        group.context_index = head_offsets + group.block_tables[None]
    return AttentionMetadata(slot_mapping.to(device), kv_caches, groups, block_size, workspace)


def _build_group(sel, query_lens, seq_lens, query_start, block_tables, block_size, device) -> AttentionGroup:
    query_lens, seq_lens, query_start = query_lens[sel], seq_lens[sel], query_start[sel]
    rows = torch.arange(int(query_lens.max()))
    valid = rows[None, :] < query_lens[:, None]
    token_index = torch.where(valid, query_start[:, None] + rows[None, :], 0)
    num_blocks = -(-int(seq_lens.max()) // block_size)
    query_pos = (seq_lens - query_lens)[:, None] + rows[None, :]
    key_pos = torch.arange(num_blocks * block_size)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    return AttentionGroup(token_index.to(device), valid.to(device), block_tables[sel, :num_blocks].to(device),
                          mask.to(device), None, query_start.tolist(), query_lens.tolist(), seq_lens.tolist())
