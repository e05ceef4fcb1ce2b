"""KV pool sizing on CUDA, as vLLM's gpu_memory_utilization: the engine may take that share of the device's
total memory; the weights, a forward at the largest batch (profiled) and memory outside PyTorch's allocator
(the CUDA context, other processes) take theirs, and the KV pool gets what is left."""
import torch

from pagedmoe.config import GIB, EngineConfig
from pagedmoe.layers.attention.metadata import Workspace
from pagedmoe.worker.inputs import prepare_inputs


def kv_cache_budget(total: int, utilization: float, weights: int, peak_activations: int, non_torch: int) -> int:
    """Bytes the KV pool may take; ValueError where nothing is left for it."""
    budget = int(total * utilization) - weights - peak_activations - non_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total / GIB:.2f} GiB leaves no memory for the KV cache "
            f"after weights ({weights / GIB:.2f} GiB), activations at the largest batch ({peak_activations / GIB:.2f} "
            f"GiB) and memory outside PyTorch ({non_torch / GIB:.2f} GiB); raise gpu_memory_utilization, or lower "
            "max_num_batched_tokens or max_num_seqs")
    return budget


def profiled_kv_budget(config: EngineConfig, model, kv_layout: tuple[int, int, tuple[int, ...]],
                       triton: bool) -> int:
    """Runs one forward of max_num_batched_tokens prompt tokens (on a temporary KV pool just large enough)
    and sizes the KV pool from the peak it allocated."""
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(config, model, kv_layout, triton)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    return kv_cache_budget(total, config.gpu_memory_utilization, weights, peak, non_torch)


@torch.inference_mode()
def profile_forward(config: EngineConfig, model, kv_layout: tuple[int, int, tuple[int, ...]], triton: bool):
    """The largest step: max_num_batched_tokens prompt tokens in sequences of at most max_model_len, then the
    logits of max_num_seqs rows."""
    num_layers, num_kv_tensors, token_shape = kv_layout
    lengths = prompt_lengths(config.max_num_batched_tokens, config.max_model_len)
    blocks_per_seq = [-(-n // config.block_size) for n in lengths]
    cache = torch.zeros(num_layers, num_kv_tensors, sum(blocks_per_seq), config.block_size, *token_shape,
                        dtype=config.torch_dtype, device=config.device)
    starts = [sum(blocks_per_seq[:i]) for i in range(len(lengths))]
    tables = [list(range(start, start + n)) for start, n in zip(starts, blocks_per_seq)]
    workspace = Workspace(config.torch_dtype, torch.device(config.device))
    input_ids, positions, meta = prepare_inputs([[0] * n for n in lengths], [0] * len(lengths), tables,
                                                config.block_size, cache, workspace, triton=triton)
    hidden = model(input_ids, positions, meta)
    model.compute_logits(hidden[-min(config.max_num_seqs, len(hidden)):])


def prompt_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])
