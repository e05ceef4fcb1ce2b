"""LLM.embed / LLM.encode on a generative model, as vLLM pools a decoder LM by default: the last prompt
token's final hidden state (after the final norm), L2-normalised. One forward over the prompt alone whose
K/V go to a throwaway cache the size of the prompt: the engine's KV pool and prefix cache are untouched."""
import torch

from pagedmoe.worker.inputs import prepare_inputs
from pagedmoe.worker.model_runner import ModelRunner


@torch.inference_mode()
def pooled_embedding(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """[hidden_size] float32, unit L2 norm."""
    hidden = runner.model(*_prompt_inputs(runner, token_ids))
    return torch.nn.functional.normalize(hidden[-1].float(), dim=-1).cpu()


def _prompt_inputs(runner: ModelRunner, token_ids: list[int]):
    block_size = runner.config.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    kv = _throwaway_cache(runner.kv_cache.device_cache, len(table))
    input_ids, positions, meta = prepare_inputs([token_ids], [0], [table], block_size, kv, runner.workspace)
    meta.layer_slots = runner.layer_slots
    if runner.layer_slots is not None:  # hybrid KV: sliding-window layers read their own slots of these blocks
        meta.window = prepare_inputs([token_ids], [0], [table], block_size, kv, runner.workspace)[2]
        meta.window.layer_slots = runner.layer_slots
    return input_ids, positions, meta


def _throwaway_cache(device_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The paged layout [layers, kv tensors, blocks, block_size, ...] with only num_blocks blocks."""
    shape = (*device_cache.shape[:2], num_blocks, *device_cache.shape[3:])
    return torch.zeros(shape, dtype=device_cache.dtype, device=device_cache.device)
