import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig

from pagedmoe.cpu_info import cpu_compute_dtype
from pagedmoe.kv_transfer.connector import parse_kv_transfer_config
from pagedmoe.kv_transfer.kv_events import parse_kv_events_config
from pagedmoe.spec_decode.config import SpeculativeConfig, parse_speculative_config

GIB = 1 << 30
BACKENDS = ("auto", "torch", "triton")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.2
    swap_space: float = 0.25  # GiB of host memory for swapped-out and offloaded KV blocks, as vLLM's
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"  # or "static": reserve prompt + max_tokens contiguously at admission
    static_reserve_tokens: int | None = None  # static mode: output slots reserved (default: max_tokens)
    disable_hybrid_kv_cache_manager: bool = False  # as vLLM's: sliding-window layers keep every block too
    kv_offload: bool = False  # evicted cached blocks go to the host pool (swap_space), then to disk
    kv_offload_disk_bytes: int = 0
    kv_offload_dir: str | None = None
    max_num_batched_tokens: int = 2048
    # as vLLM's: the most tokens of one request's prefill in a step while other requests run or wait (0: no
    # cap). Lower: shorter steps beside decodes (ITL), more steps to a prompt's first token (TTFT).
    long_prefill_token_threshold: int = 0
    max_num_seqs: int = 128
    max_model_len: int | None = None
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (-1: the vocab size), as vLLM
    num_threads: int | None = None  # CPU threads for the model (default: physical cores, see worker/cpu_threads.py)
    adaptive_threads: bool = True  # CPU: use fewer threads while other processes hold cores
    prepack_weights: bool = True  # CPU: linear layers run on oneDNN pre-packed weight copies (more memory)
    cpu_attention_kernel: bool = True  # CPU: decode attention reads KV blocks in place (C++, built on first use)
    cpu_decode_block: bool = True  # CPU: steps of decodes run a layer's attention half (a dense model: every
    # layer) in one C++ call
    cpu_moe_kernel: bool = True  # CPU: decode-sized MoE batches run all experts in one C++ call (built on first use)
    attention_backend: str = "auto"  # "triton", "torch" or "auto": Triton kernels on CUDA, PyTorch + C++ on CPU
    moe_backend: str = "auto"  # routed experts: "triton", "torch" or "auto" (the same choice as attention's)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (CPU never uses them)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory for weights, activations and KV
    cpu_linear_kernel: bool = True  # CPU: decode-sized float32 linears run on a C++ tile GEMM (built on first use)
    # CPU, float32 or bf16, AVX2 and up: plain greedy steps take their tokens from an int8 LM head (bf16 for float32
    # on AMX) and a float32 check of the few candidates its error bound leaves: the same tokens (layers/greedy_head.py)
    cpu_greedy_head: bool = True
    keep_freed_memory: bool = True  # CPU: glibc keeps freed large blocks for reuse (process-wide mallopt)
    # CPU: bytes of the KV pool (the blocks handed out first) that start-up writes once, so that steps do not wait
    # for the kernel to zero fresh pages (about 1 GiB/s on the VMs measured); None: the whole pool, as vLLM's
    # zeroed cache; 0: none (pages are zeroed on first use)
    kv_prefault_memory: int | None = None
    speculative_config: dict | str | SpeculativeConfig | None = None  # as vLLM's (spec_decode/config.py)
    quantization_mode: str = "packed"  # 4-bit checkpoints on CPU: "packed" (kept 4-bit) or "dequantize" (exact)
    quantization: str | None = None  # as vLLM's: the method the checkpoint must be in (mxfp4, modelopt_fp4, fp8)
    tensor_parallel_size: int = 1  # ranks, each a spawned process holding a shard (distributed/)
    enable_expert_parallel: bool = False  # MoE experts whole on each rank instead of split like the MLP
    enable_eplb: bool = False  # expert parallel: rebalance experts over ranks by their measured load
    num_redundant_experts: int = 0  # EPLB: extra expert slots, replicas of the busiest experts
    eplb_window_size: int = 1000  # EPLB: steps of expert load the placement is computed from
    eplb_step_interval: int = 3000  # EPLB: steps between rebalances
    data_parallel_size: int = 1
    nnodes: int = 1  # machines the ranks run on (torchrun's names); node 0 holds rank 0, the engine
    node_rank: int = 0  # this machine's index: nodes > 0 run their ranks headless (`pagedmoe serve --node-rank 1`)
    master_addr: str = "127.0.0.1"  # torchrun's convention: where rank 0's process group listens
    master_port: int | None = None  # None: a free port (one process group on one node only)
    distributed_timeout_s: float = 60.0  # a rank silent this long in a collective fails the engine
    expert_cache_memory: int | None = None  # bytes for routed experts; the rest stay in the checkpoint's files
    expert_cache_policy: str = "lru"  # which resident expert an offloaded layer evicts: "lru" or "lfu"
    expert_prefetch: str = "auto"  # offloaded experts: "slots", "readahead", "off"; auto: readahead on CPU
    kv_transfer_config: dict | str | None = None  # as vLLM's: {"kv_connector": ..., "kv_role": ..., ...}
    kv_events_config: dict | str | None = None  # as vLLM's: {"enable_kv_cache_events": true, "endpoint": ...}
    hf_config: PretrainedConfig = field(init=False, repr=False)
    swap_space_bytes: int = field(init=False)

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"model: directory {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: no config.json in {self.model!r}")
        self.hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=False)
        self.tokenizer = self.tokenizer or self.model
        self.swap_space_bytes = _swap_space_bytes(self.swap_space)
        self._check_choices()
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        self._check_parallel()
        self._check_expert_cache()
        limit = self.hf_config.max_position_embeddings
        self.max_model_len = min(self.max_model_len or limit, limit)

    def _check_choices(self):
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.quantization_mode not in ("packed", "dequantize"):
            raise ValueError(f"quantization_mode must be 'packed' or 'dequantize', got {self.quantization_mode!r}")
        if self.kv_allocation not in ("paged", "static"):
            raise ValueError(f"kv_allocation must be 'paged' or 'static', got {self.kv_allocation!r}")
        if self.kv_allocation == "static":
            self.enable_prefix_caching = False
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap), "
                             f"got {self.long_prefill_token_threshold}")
        for name in ("attention_backend", "moe_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {BACKENDS}, got {getattr(self, name)!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def _check_parallel(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1 or self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(f"data_parallel_size must be >= 1, and 1 with tensor_parallel_size > 1 for now, "
                             f"got {self.data_parallel_size}")
        if self.world_size > 1 and self.speculative_config is not None:
            raise ValueError("speculative_config cannot be combined with tensor_parallel_size > 1 yet")
        if self.world_size > 1 and self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config: KV connectors run with one rank for now")
        if self.data_parallel_size > 1 and self.kv_events_config is not None:
            raise ValueError("kv_events_config: not published with data_parallel_size > 1 yet")
        if self.enable_eplb and not (self.enable_expert_parallel and self.world_size > 1):
            raise ValueError("enable_eplb needs enable_expert_parallel and tensor_parallel_size > 1")
        if self.num_redundant_experts < 0 or self.num_redundant_experts and not self.enable_expert_parallel:
            raise ValueError(f"num_redundant_experts must be >= 0 and needs enable_expert_parallel, "
                             f"got {self.num_redundant_experts}")
        if min(self.eplb_window_size, self.eplb_step_interval) < 1:
            raise ValueError("eplb_window_size and eplb_step_interval must be >= 1")
        if self.nnodes < 1 or self.world_size % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide the ranks ({self.world_size}) "
                             f"and node_rank ({self.node_rank}) be in [0, nnodes)")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port: several nodes must be told where rank 0 listens")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")

    def _check_expert_cache(self):
        if self.expert_prefetch not in ("auto", "slots", "readahead", "off"):
            raise ValueError(f"expert_prefetch must be 'auto', 'slots', 'readahead' or 'off', got {self.expert_prefetch!r}")
        if self.expert_cache_policy not in ("lru", "lfu"):
            raise ValueError(f"expert_cache_policy must be 'lru' or 'lfu', got {self.expert_cache_policy!r}")
        if self.expert_cache_memory is None:
            return
        if isinstance(self.expert_cache_memory, bool) or not isinstance(self.expert_cache_memory, int) \
                or self.expert_cache_memory < 1:
            raise ValueError(f"expert_cache_memory must be a number of bytes >= 1, got {self.expert_cache_memory!r}")
        if self.world_size > 1:
            raise ValueError("expert_cache_memory: offloaded experts run with one rank for now")

    @property
    def world_size(self) -> int:
        """Ranks: tensor_parallel_size x data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_prefetch_mode(self) -> str:
        """auto: slots filled by a background thread on an accelerator (copies overlap compute there), the page
        cache's readahead on a CPU (where a filling thread competes with the compute threads)."""
        if self.expert_prefetch != "auto":
            return self.expert_prefetch
        return "readahead" if torch.device(self.device).type == "cpu" else "slots"

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        dtype = getattr(self.hf_config, "dtype", None) or torch.float32
        dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        if torch.device(self.device).type != "cpu":
            return dtype
        return cpu_compute_dtype(dtype)  # float32 for a 16-bit checkpoint where the CPU has no native bf16


def _swap_space_bytes(gib) -> int:
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 <= gib < float("inf"):
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {gib!r}")
    return round(gib * GIB)
