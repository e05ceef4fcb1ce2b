"""The EAGLE-3 head's draft steps as one C++ call (csrc/eagle_step.cpp) for small float32 heads on CPU: the
head is one small decoder layer, so eager PyTorch spends its step dispatching ops (~1 ms, a third of the
bundled target's whole decode step), which is what a draft must not cost; greedy drafts chain every step of
a proposal in the call. `FusedEagleStep.of(head)` is None where it does not apply (another dtype or device,
biases, q/k norms, a head over MAX_WEIGHT_BYTES, no compiler): the proposer then runs the head's modules, the
reference the kernel is tested against."""
import ctypes
import functools
import itertools
import logging
from pathlib import Path

import torch

from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "eagle_step.cpp"
MAX_ROWS = 32  # above this many rows a step's matmuls are cheaper as MKL GEMMs than as one GEMV per row
MAX_WEIGHT_BYTES = 16 << 20  # larger heads stream their weights (a 32k-vocabulary LM head is ~100 MB): there
#                              one core's GEMV loses to MKL on all cores, and dispatching ops costs little
enabled = True  # False: always the head's PyTorch modules (tests compare the two)
WEIGHTS = ("embed", "input_norm", "hidden_norm", "qkv", "o", "post_norm", "gate_up", "down", "norm", "lm_head",
           "cos", "sin")


class Weights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in WEIGHTS]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab", "num_blocks", "block_size",
        "max_blocks", "max_positions")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL | None:
    try:
        library = cpu_build.load_library(SOURCE, compiler, march)
    except RuntimeError as error:
        logger.warning("the EAGLE-3 draft step falls back to PyTorch: %s", error)
        return None
    library.eagle3_draft_f32.restype = ctypes.c_int
    return library


def head_tensors(head) -> dict[str, torch.Tensor]:
    attn, target = head.self_attn, head.target[0]
    return {"embed": target.embed_tokens.weight, "input_norm": head.input_layernorm.weight,
            "hidden_norm": head.hidden_norm.weight, "qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight,
            "post_norm": head.post_attention_layernorm.weight, "gate_up": head.mlp.gate_up_proj.weight,
            "down": head.mlp.down_proj.weight, "norm": head.norm.weight, "lm_head": target.lm_head.weight,
            "cos": attn.rotary.cos, "sin": attn.rotary.sin}


def is_supported(head, tensors: dict[str, torch.Tensor]) -> bool:
    attn = head.self_attn
    plain = attn.qk_norm is None and attn.clip_qkv is None and attn.qkv_proj.bias is None and attn.o_proj.bias is None
    num_bytes = sum(t.numel() * t.element_size() for name, t in tensors.items() if name not in ("cos", "sin"))
    on_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values())
    return plain and on_cpu and num_bytes <= MAX_WEIGHT_BYTES


class FusedEagleStep:
    def __init__(self, head, tensors: dict[str, torch.Tensor], library: ctypes.CDLL):
        self.head, self.fn, self.shapes = head, library.eagle3_draft_f32, {}
        self.tensors = tensors
        self.weights = Weights(*(self.tensors[name].data_ptr() for name in WEIGHTS))
        self.vocab_size = tensors["lm_head"].shape[0]

    @classmethod
    def of(cls, head, library: ctypes.CDLL | None = None) -> "FusedEagleStep | None":
        tensors = head_tensors(head)
        library = library or (load_library() if is_supported(head, tensors) else None)
        return cls(head, tensors, library) if library is not None and is_supported(head, tensors) else None

    def fits(self, cache: torch.Tensor) -> bool:
        return enabled and cache.dtype == torch.float32 and cache.is_contiguous()

    def __call__(self, cache: torch.Tensor, token_lists: list[list[int]], starts: list[int], hidden: torch.Tensor,
                 block_tables: torch.Tensor, num_drafts: list[int] | None = None, firsts: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Row j of sequence i is token_lists[i][j] at position starts[i] + j with input hidden state
        hidden[row] (the target's fused states, or the head's own); after its last row, num_drafts[i] (default
        1) greedy draft steps. Sequence i attends its positions from firsts[i] (default 0) on. Returns the
        last step's hidden state and logits per sequence, and the drafts."""
        if hidden.shape[-1] != self.head.hidden_size:
            hidden = self.head.fc(hidden)
        hidden, n = hidden.float().contiguous(), len(token_lists)
        lens, num_drafts = [len(tokens) for tokens in token_lists], num_drafts or [1] * n
        rows = torch.tensor([0, *itertools.accumulate(lens), *(t for ts in token_lists for t in ts),
                             *(s + j for s, num in zip(starts, lens) for j in range(num)), *num_drafts,
                             *(firsts or [0] * n)], dtype=torch.long)
        offsets = (0, n + 1, n + 1 + len(hidden), n + 1 + 2 * len(hidden), 2 * n + 1 + 2 * len(hidden))
        row_start, tokens, positions, counts, first = (ctypes.c_void_p(rows.data_ptr() + 8 * o) for o in offsets)
        tables, max_drafts = block_tables.contiguous(), max(num_drafts)
        drafts = torch.empty(n, max_drafts, dtype=torch.long)
        hidden_out, logits = hidden.new_empty(n, self.head.hidden_size), hidden.new_empty(n, self.vocab_size)
        status = self.fn(ctypes.byref(self.weights), ctypes.byref(self.shape(cache, tables)), ptr(cache),
                         ctypes.c_int64(n), row_start, tokens, positions, first, ptr(hidden), ptr(tables), counts,
                         ctypes.c_int64(max_drafts), *map(ptr, (drafts, hidden_out, logits)), num_threads())
        if status:
            raise ValueError("the EAGLE-3 draft step's positions, tokens or block tables are out of range")
        return hidden_out, logits, [row[:k] for row, k in zip(drafts.tolist(), num_drafts)]

    def shape(self, cache: torch.Tensor, tables: torch.Tensor) -> Shape:
        key = (*cache.shape, tables.shape[1])
        if key not in self.shapes:
            config, attn = self.head.config, self.head.self_attn
            self.shapes[key] = Shape(self.head.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     config.intermediate_size, self.vocab_size, cache.shape[1], cache.shape[2],
                                     tables.shape[1], self.tensors["cos"].shape[0], config.rms_norm_eps,
                                     attn.head_dim ** -0.5)
        return self.shapes[key]
