import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedmoe.layers.attention.cpu_kernel import PagedDecodeKernel, check_tables
from pagedmoe.layers.attention.cpu_prefill import PagedPrefillKernel
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
MAX_SHORT_QUERY = 8  # queries up to this long (a speculating sequence's k + 1 rows) attend one row at a time


@dataclass
class DecodeChunk:
    """Decoding sequences attended together, padded to the longest among them."""
    token_index: torch.Tensor  # [n] step-token index of each sequence's query
    context_index: torch.Tensor  # [num_kv_tensors * n * num_blocks] rows of a layer's cache viewed [-1, block]
    padding: torch.Tensor  # [1, n, 1, num_blocks * block_size] gathered positions that are not context
    seq_lens: torch.Tensor  # [n] each sequence's context length (a sliding window masks from it)


@dataclass
class AttentionGroup:
    """Sequences attended together: all decodes, or all prefill chunks."""
    token_index: torch.Tensor  # [B, max_query_len] step-token index of each padded query row
    valid: torch.Tensor | None  # [B, max_query_len] which padded rows are real tokens (None: all, decodes)
    block_tables: torch.Tensor  # [B, num_blocks] blocks covering the longest context in the group
    mask: torch.Tensor | None  # [B, 1, max_query_len, num_blocks * block_size] causal mask over the context
    context_index: torch.Tensor | None  # [num_kv_tensors, B, num_blocks] rows of a layer's cache viewed [-1, block]
    #                                      (mask and context_index: None where the decode kernel attends)
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
    prefill_kernel: PagedPrefillKernel | None = None  # CPU: attends prefill chunks in place (cpu_prefill.py)
    expert_load: torch.Tensor | None = None  # [num_moe_layers, num_experts] tokens routed this step
    aux_hidden_layers: tuple[int, ...] = ()  # layers whose input hidden states the forward keeps (EAGLE-3)
    aux_hidden: list = field(default_factory=list)  # those hidden states, [num_tokens, hidden] each
    layer_slots: list[int] | None = None  # hybrid KV: the kv_caches entry of each layer (None: its index)
    window: "AttentionMetadata | None" = None  # hybrid KV: what sliding-window layers attend (their tables)
    triton: "TritonAttention | None" = None  # the Triton kernels' step inputs (triton_backend.py), None: PyTorch
    output_rows: torch.Tensor | None = None  # the rows read past the last layer (logits); None: every row

    def layer_cache(self, layer_idx: int) -> torch.Tensor:
        return self.kv_caches[self.layer_slots[layer_idx] if self.layer_slots is not None else layer_idx]

    def for_layer(self, window: int) -> "AttentionMetadata":
        return self.window if window and self.window is not None else self


def build_attention_metadata(query_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             slot_mapping: torch.Tensor, kv_caches: torch.Tensor, block_size: int,
                             workspace: Workspace, decode_kernel: PagedDecodeKernel | None = None
                             ) -> AttentionMetadata:
    device = workspace.buffer.device
    query_lens, seq_lens, block_tables = rows_as_decodes(query_lens, seq_lens, block_tables)
    query_start = torch.cumsum(query_lens, 0) - query_lens
    is_decode = query_lens == 1
    if decode_kernel is not None and bool(is_decode.all()):
        groups = [kernel_decode_group(seq_lens, block_tables, block_size, device)]
    else:
        groups = [_build_group(sel, query_lens, seq_lens, query_start, block_tables, block_size, kv_caches, device,
                               plan_chunks=decode_kernel is None)
                  for sel in (is_decode, ~is_decode) if sel.any()]
    if decode_kernel is not None:  # once per step: the kernels (decode, prefill) then skip it in each layer
        for group in groups:
            check_tables(group.block_tables, group.seq_lens_tensor, kv_caches.shape[2], block_size)
    return AttentionMetadata(slot_mapping.to(device), kv_caches, groups, block_size, workspace, decode_kernel)


def rows_as_decodes(query_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor):
    """Each row of a short query as a decode of its own over the same block table, its context ending at its
    own position: one batched decode instead of a causal attention call per sequence (the step's tokens keep
    their order). In Python lists, made tensors through numpy: a dozen ops on tensors of a few elements cost
    ~45 us a step, torch.tensor of the lists ~14."""
    lens_of_queries = query_lens.tolist()
    if not any(1 < n <= MAX_SHORT_QUERY for n in lens_of_queries):
        return query_lens, seq_lens, block_tables
    seq_index, lens, new_query_lens = [], [], []
    for i, (n, seq_len) in enumerate(zip(lens_of_queries, seq_lens.tolist())):
        rows = n if 1 < n <= MAX_SHORT_QUERY else 1
        seq_index += [i] * rows
        lens += range(seq_len - rows + 1, seq_len + 1)
        new_query_lens += [1] * rows if rows > 1 else [n]
    device = query_lens.device
    return long_tensor(new_query_lens, device), long_tensor(lens, device), block_tables[long_tensor(seq_index, device)]


def long_tensor(values: list, device=None) -> torch.Tensor:
    """An int64 tensor of (nested) Python lists through numpy: torch.tensor of a list is 2-3x slower."""
    tensor = torch.from_numpy(np.array(values, dtype=np.int64))
    return tensor if device is None else tensor.to(device)


def kernel_decode_group(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                         device) -> AttentionGroup:
    """Every token a decode, attended by the decode kernel in place: only the tables and lengths it reads
    (no mask, gather index or chunks)."""
    num_seqs, num_blocks = len(seq_lens), -(-int(seq_lens.max()) // block_size)
    return AttentionGroup(torch.arange(num_seqs, device=device)[:, None], None,
                          block_tables[:, :num_blocks].contiguous().to(device), None, None,
                          list(range(num_seqs)), [1] * num_seqs, seq_lens.tolist(), seq_lens.to(device), [])


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
                                  ~mask[rows, 0, 0, :num_blocks * block_size][None, :, None].to(device),
                                  seq_lens[rows].to(device)))
        start += size
    return chunks
