"""vLLM's SharedStorageConnector (its debug / single-host connector, ExampleConnector in newer vLLM): the
prefill side writes the prompt's KV to a safetensors file named by a hash of the prompt's tokens under
kv_connector_extra_config.shared_storage_path; the decode side reads it into its own blocks. Works between
processes on one host, or hosts sharing a file system."""
import hashlib
import os
from array import array

import torch
from safetensors.torch import load_file, save_file

from pagedmoe.kv_transfer.connector import CONNECTORS, KVConnector, KVLoad


class SharedStorageConnector(KVConnector):
    def __init__(self, config):
        super().__init__(config)
        self.path = config.kv_connector_extra_config.get("shared_storage_path")
        if not self.path:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path is required")
        os.makedirs(self.path, exist_ok=True)

    def key_of(self, seq, num_tokens: int) -> str:
        digest = hashlib.sha256(array("q", seq.token_ids[:num_tokens]).tobytes())
        return digest.hexdigest()

    def file(self, key: str) -> str:
        return os.path.join(self.path, f"{key}.safetensors")

    def get_num_new_matched_tokens(self, seq) -> int:
        num_tokens = seq.num_prompt_tokens - 1
        return num_tokens if num_tokens > 0 and os.path.isfile(self.file(self.key_of(seq, num_tokens))) else 0

    def save_kv(self, save: KVLoad, cache: torch.Tensor, block_size: int):
        """cache: [layers, kv_tensors, blocks, block_size, ...]; the first num_tokens slots of the blocks."""
        slots = token_slots(save.block_ids, save.num_tokens, block_size)
        tokens = cache.flatten(2, 3)[:, :, slots].contiguous()
        tmp = self.file(save.key) + f".{os.getpid()}.tmp"
        save_file({"kv": tokens}, tmp)
        os.replace(tmp, self.file(save.key))  # readers never see half a file

    def start_load_kv(self, load: KVLoad, cache: torch.Tensor, block_size: int):
        tokens = load_file(self.file(load.key))["kv"]
        expected = (*cache.shape[:2], load.num_tokens, *cache.shape[4:])
        if tuple(tokens.shape) != expected or tokens.dtype != cache.dtype:
            raise ValueError(f"kv_transfer: stored KV {tuple(tokens.shape)} {tokens.dtype} does not fit this "
                             f"engine's {expected} {cache.dtype} (another model, dtype or block layout)")
        cache.flatten(2, 3)[:, :, token_slots(load.block_ids, load.num_tokens, block_size)] = tokens


def token_slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(num_tokens)
    return torch.tensor(block_ids, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


CONNECTORS["SharedStorageConnector"] = SharedStorageConnector
