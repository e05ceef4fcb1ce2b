import torch

from pagedmoe.layers.attention.cpu_kernel import check_tables
from pagedmoe.layers.attention.metadata import (AttentionMetadata, Workspace, build_attention_metadata,
                                                kernel_decode_group, long_tensor)


def prepare_inputs(token_lists: list[list[int]], starts: list[int], block_tables: list[list[int]],
                   block_size: int, kv_caches: torch.Tensor, workspace: Workspace, decode_kernel=None,
                   triton: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One forward's flat input ids, positions and attention metadata: sequence i adds token_lists[i] at
    positions starts[i]..., its K/V written into the slots its block table maps them to. triton: the Triton
    kernels attend (meta.triton), not the PyTorch groups."""
    device = workspace.buffer.device
    query_lens = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(len(token_lists)), query_lens)
    query_start = torch.cumsum(query_lens, 0) - query_lens
    starts_tensor = torch.tensor(starts, dtype=torch.long)
    positions = torch.arange(int(query_lens.sum())) - (query_start - starts_tensor)[seq_index]
    tables = pad_block_tables(block_tables)
    slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
    if triton:
        meta = triton_metadata(query_lens, starts_tensor + query_lens, tables, slot_mapping, kv_caches, block_size,
                               workspace)
    else:
        meta = build_attention_metadata(query_lens, starts_tensor + query_lens, tables, slot_mapping, kv_caches,
                                        block_size, workspace, decode_kernel)
    input_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
    return input_ids, positions.to(device), meta


def triton_metadata(query_lens, seq_lens, tables, slot_mapping, kv_caches, block_size, workspace
                    ) -> AttentionMetadata:
    from pagedmoe.layers.attention.triton_backend import build_triton_attention
    device = workspace.buffer.device
    meta = AttentionMetadata(slot_mapping.to(device), kv_caches, [], block_size, workspace)
    meta.triton = build_triton_attention(query_lens, seq_lens, tables, block_size, device)
    meta.triton.slot_mapping = meta.slot_mapping
    return meta


def decode_inputs(positions: torch.Tensor, tables: torch.Tensor, block_size: int, kv_caches: torch.Tensor,
                  workspace: Workspace, decode_kernel) -> AttentionMetadata:
    """One token per sequence at `positions` over padded block tables, attended by the decode kernel: the
    metadata of a draft model's later steps, without rebuilding the tables."""
    slot_mapping = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    group = kernel_decode_group(positions + 1, tables, block_size, workspace.buffer.device)
    check_tables(group.block_tables, group.seq_lens_tensor, kv_caches.shape[2], block_size)
    return AttentionMetadata(slot_mapping.to(workspace.buffer.device), kv_caches, [group], block_size, workspace,
                             decode_kernel)


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Padded with block 0, to which freed window entries (-1) point too: masked, never read."""
    width = max(len(t) for t in tables)
    return long_tensor([t + [0] * (width - len(t)) for t in tables]).clamp_(min=0)
