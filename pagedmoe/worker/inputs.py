import torch

from pagedmoe.layers.attention.metadata import AttentionMetadata, Workspace, build_attention_metadata


def prepare_inputs(token_lists: list[list[int]], starts: list[int], block_tables: list[list[int]],
                   block_size: int, kv_caches: torch.Tensor, workspace: Workspace, decode_kernel=None
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One forward's flat input ids, positions and attention metadata: sequence i adds token_lists[i] at
    positions starts[i]..., its K/V written into the slots its block table maps them to."""
    device = workspace.buffer.device
    query_lens = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(len(token_lists)), query_lens)
    query_start = torch.cumsum(query_lens, 0) - query_lens
    starts_tensor = torch.tensor(starts, dtype=torch.long)
    positions = torch.arange(int(query_lens.sum())) - (query_start - starts_tensor)[seq_index]
    tables = pad_block_tables(block_tables)
    slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
    meta = build_attention_metadata(query_lens, starts_tensor + query_lens, tables, slot_mapping, kv_caches,
                                    block_size, workspace, decode_kernel)
    input_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
    return input_ids, positions.to(device), meta


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
