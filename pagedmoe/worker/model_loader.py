import json
import logging
import os
from glob import glob

import torch

from pagedmoe.config import EngineConfig
from pagedmoe.layers.attention.decode_block import attach_decode_blocks
from pagedmoe.layers.decode_stack import attach_decode_stack
from pagedmoe.layers.greedy_head import attach_greedy_head
from pagedmoe.layers.linear import attach_cpu_kernels, pack_weights
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.offload.setup import offload_experts
from pagedmoe.layers.moe.offload.store import expert_refs
from pagedmoe.layers.quantization.checkpoint import checkpoint_tensors
from pagedmoe.layers.quantization.config import check_requested, read_quantization_config
from pagedmoe.models.registry import resolve_model_class
from pagedmoe.worker.backends import select_moe_backend

logger = logging.getLogger(__name__)


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir!r} (pickled checkpoints are never loaded)")
    return files


def prepare_model(config: EngineConfig, rank=None) -> torch.nn.Module:
    """The model loaded (this rank's shard of it, under tensor parallelism), its weights pre-packed and its
    CPU kernels attached, as the config asks."""
    model = load_model(config)
    if rank is not None and rank.world_size > 1:
        from pagedmoe.distributed.tensor_parallel import shard_model
        if keeps_fp4_packed(model, config) and read_quantization_config(config.model, config.hf_config):
            raise ValueError("tensor_parallel_size: 4-bit packed checkpoints are not split yet; "
                             "use quantization_mode='dequantize'")
        if config.data_parallel_size > 1:
            from pagedmoe.distributed.data_parallel import shard_model_dp
            model = shard_model_dp(model, rank, config.enable_expert_parallel, config.num_redundant_experts)
        else:
            model = shard_model(model, rank, config.enable_expert_parallel, config.num_redundant_experts)
    return finish_model(model, config)


def finish_model(model: torch.nn.Module, config: EngineConfig) -> torch.nn.Module:
    triton_moe = select_moe_backend(config) == "triton"
    if triton_moe:  # before packing: the Triton experts read the plain weights, no packed copies are kept
        for layer in model.modules():
            if isinstance(layer, FusedMoE):
                layer.use_triton()
    if config.prepack_weights:
        pack_weights(model)
    if torch.device(config.device).type == "cpu":
        try:
            if config.cpu_linear_kernel:
                attach_cpu_kernels(model, {"linear"})
            # at every size: one call for all experts beats a matmul per expert
            if config.cpu_moe_kernel and not triton_moe:
                attach_cpu_kernels(model, {"moe"}, min_bytes=0)
            if config.cpu_attention_kernel and config.cpu_decode_block:
                attach_decode_blocks(model)
                attach_decode_stack(model)
            if config.cpu_linear_kernel and config.cpu_greedy_head and unsharded(config):
                attach_greedy_head(model)
        except RuntimeError as error:
            logger.warning("linear and MoE layers fall back to oneDNN / MKL: %s", error)
    return model


def unsharded(config: EngineConfig) -> bool:
    return config.tensor_parallel_size == 1 and config.data_parallel_size == 1


def load_model(config: EngineConfig) -> torch.nn.Module:
    cls = resolve_model_class(config.hf_config)
    with torch.device(config.device):
        model = cls(config.hf_config)
    quant = read_quantization_config(config.model, config.hf_config)
    check_requested(config.quantization, quant, config.model)
    num_expected = num_weight_elements(model)  # before packed 4-bit layers drop their dense weights
    offload = config.expert_cache_memory is not None
    num_loaded = load_weights(model, config.model, quant, keeps_fp4_packed(model, config), offload)
    if num_loaded != num_expected:
        raise ValueError(f"model: checkpoint in {config.model!r} filled {num_loaded} of {num_expected} "
                         "weight elements; weights are missing or duplicated")
    if offload:
        offload_model_experts(model, config)
    return model.to(dtype=config.torch_dtype).eval()


def offload_model_experts(model: torch.nn.Module, config: EngineConfig):
    """The routed experts stay in the checkpoint, read into each MoE layer's expert cache as needed."""
    model.expert_prefetch_pool = offload_experts(getattr(model, "moe_layers", []), config.expert_cache_memory,
                                                 config.expert_cache_policy, config.torch_dtype,
                                                 config.expert_prefetch_mode)


def num_weight_elements(model: torch.nn.Module) -> int:
    """Elements of the model's weights, each shared (tied) tensor counted once."""
    return sum(t.numel() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())


def keeps_fp4_packed(model: torch.nn.Module, config: EngineConfig) -> bool:
    """quantization_mode "packed" (the default): 4-bit weights stay packed, on CPU, in the models that take
    them; elsewhere they are decoded to the model's dtype as they load."""
    packed = config.quantization_mode == "packed" and torch.device(config.device).type == "cpu"
    return packed and getattr(model, "takes_fp4_packed", False)


def load_weights(model: torch.nn.Module, model_dir: str, quant=None, packed: bool = False,
                 offload: bool = False) -> int:
    """Every tensor of the directory's safetensors offered to model.load_weight (quantized weights decoded to
    float32 first, or 4-bit ones kept packed, see layers/quantization); with offload, the routed experts'
    weights as references, never read here; the elements it took."""
    if offload and quant is not None:
        raise ValueError(f"expert_cache_memory: {quant.method} checkpoints are not offloaded yet")
    files = weight_files(model_dir)
    refs = {name: ref for path in files for name, ref in expert_refs(path).items()} if offload else {}
    num_loaded = sum(ref.numel() for name, ref in refs.items() if model.load_weight(name, ref))
    for name, tensor in checkpoint_tensors(files, quant, packed, skip=refs):
        if model.load_weight(name, tensor):
            num_loaded += sum(t.numel() for t in tensor) if isinstance(tensor, list) else tensor.numel()
    return num_loaded
