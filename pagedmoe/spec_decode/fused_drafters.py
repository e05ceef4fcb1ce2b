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
from pagedmoe.layers.attention.metadata import long_tensor
from pagedmoe.layers.cpu_build import num_threads, ptr

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "draft_steps.cpp"
MAX_ROWS = 32  # above this many rows a step's matmuls are cheaper as MKL GEMMs than as one GEMV per row
MAX_WEIGHT_BYTES = 16 << 20  # larger heads stream their weights (a 32k-vocabulary LM head is ~100 MB): there
#                              one core's GEMV loses to MKL on all cores, and dispatching ops costs little
enabled = True  # False: always the head's PyTorch modules (tests compare the two)
LAYER_WEIGHTS = ("input_norm", "qkv", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")
WEIGHTS = ("embed", "input_norm", "hidden_norm", "qkv", "o", "post_norm", "gate_up", "down", "norm", "lm_head",
           "cos", "sin", "fc")


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
        logger.warning("draft steps fall back to PyTorch: %s", error)
        return None
    library.eagle3_draft_f32.restype = library.dense_draft_f32.restype = ctypes.c_int
    return library


def pack_rows(token_lists: list[list[int]], starts: list[int], num_drafts: list[int], firsts: list[int]):
    """The kernels' per-row and per-sequence int64 arrays in one tensor: (the tensor, its row starts, tokens,
    positions, draft counts and first attended positions as pointers)."""
    n, lens = len(token_lists), [len(tokens) for tokens in token_lists]
    rows = long_tensor([0, *itertools.accumulate(lens), *(t for ts in token_lists for t in ts),
                        *(s + j for s, num in zip(starts, lens) for j in range(num)), *num_drafts, *firsts])
    num_rows = sum(lens)
    offsets = (0, n + 1, n + 1 + num_rows, n + 1 + 2 * num_rows, 2 * n + 1 + 2 * num_rows)
    return rows, *(ctypes.c_void_p(rows.data_ptr() + 8 * o) for o in offsets)


def head_tensors(head) -> dict[str, torch.Tensor]:
    attn, target = head.self_attn, head.target[0]
    return {"embed": target.embed_tokens.weight, "input_norm": head.input_layernorm.weight,
            "hidden_norm": head.hidden_norm.weight, "qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight,
            "post_norm": head.post_attention_layernorm.weight, "gate_up": head.mlp.gate_up_proj.weight,
            "down": head.mlp.down_proj.weight, "norm": head.norm.weight, "lm_head": target.lm_head.weight,
            "cos": attn.rotary.cos, "sin": attn.rotary.sin, "fc": head.fc.weight}


def supported_tensors(tensors: list[torch.Tensor]) -> bool:
    """Contiguous float32 CPU weights of at most MAX_WEIGHT_BYTES in all."""
    on_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    return on_cpu and sum(t.numel() * t.element_size() for t in tensors) <= MAX_WEIGHT_BYTES


def is_supported(head, tensors: dict[str, torch.Tensor]) -> bool:
    attn = head.self_attn
    plain = attn.qk_norm is None and attn.clip_qkv is None and attn.qkv_proj.bias is None and attn.o_proj.bias is None
    weights = [t for name, t in tensors.items() if name not in ("cos", "sin")]
    return plain and supported_tensors(weights) and supported_tensors([tensors["cos"], tensors["sin"]])


class FusedDrafter:
    """What both kernels' wrappers share: config, attn (a layer's attention) and vocab_size are set by each."""
    config = attn = vocab_size = None
    shapes: dict

    def fits(self, cache: torch.Tensor) -> bool:
        return enabled and cache.dtype == torch.float32 and cache.is_contiguous()

    def shape(self, layer_cache: torch.Tensor, tables: torch.Tensor) -> Shape:
        """layer_cache: one layer's, [2 * kv_heads, num_blocks, block_size, head_dim]."""
        key = (*layer_cache.shape, tables.shape[1])
        if key not in self.shapes:
            config, attn = self.config, self.attn
            self.shapes[key] = Shape(config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     config.intermediate_size, self.vocab_size, layer_cache.shape[1],
                                     layer_cache.shape[2], tables.shape[1], attn.rotary.cos.shape[0],
                                     config.rms_norm_eps, attn.head_dim ** -0.5)
        return self.shapes[key]


class FusedEagleStep(FusedDrafter):
    def __init__(self, head, tensors: dict[str, torch.Tensor], library: ctypes.CDLL):
        self.head, self.fn, self.shapes = head, library.eagle3_draft_f32, {}
        self.config, self.attn, self.tensors = head.config, head.self_attn, tensors
        self.weights = Weights(*(self.tensors[name].data_ptr() for name in WEIGHTS))
        self.vocab_size = tensors["lm_head"].shape[0]

    @classmethod
    def of(cls, head, library: ctypes.CDLL | None = None) -> "FusedEagleStep | None":
        tensors = head_tensors(head)
        library = library or (load_library() if is_supported(head, tensors) else None)
        return cls(head, tensors, library) if library is not None and is_supported(head, tensors) else None

    def __call__(self, cache: torch.Tensor, token_lists: list[list[int]], starts: list[int], hidden: torch.Tensor,
                 block_tables: torch.Tensor, num_drafts: list[int] | None = None, firsts: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Row j of sequence i is token_lists[i][j] at position starts[i] + j with input hidden state
        hidden[row] (the target's fused states, or the head's own); after its last row, num_drafts[i] (default
        1) greedy draft steps. Sequence i attends its positions from firsts[i] (default 0) on. Returns the
        last step's hidden state and logits per sequence, and the drafts."""
        if hidden.shape[-1] not in (self.head.hidden_size, self.tensors["fc"].shape[1]):
            raise ValueError(f"hidden must be the head's or the target's fused states, got {tuple(hidden.shape)}")
        hidden, n = hidden.float().contiguous(), len(token_lists)  # fc in the kernel: ~40 us as an MKL call here
        num_drafts = num_drafts or [1] * n
        firsts = firsts or [0] * n
        rows, row_start, tokens, positions, counts, first = pack_rows(token_lists, starts, num_drafts, firsts)
        tables, max_drafts = block_tables.contiguous(), max(num_drafts)
        drafts = torch.empty(n, max_drafts, dtype=torch.long)
        hidden_out, logits = hidden.new_empty(n, self.head.hidden_size), hidden.new_empty(n, self.vocab_size)
        status = self.fn(ctypes.byref(self.weights), ctypes.byref(self.shape(cache, tables)), ptr(cache),
                         ctypes.c_int64(n), row_start, tokens, positions, first, ptr(hidden),
                         ctypes.c_int64(hidden.shape[-1]), ptr(tables), counts,
                         ctypes.c_int64(max_drafts), *map(ptr, (drafts, hidden_out, logits)), num_threads())
        if status:
            raise ValueError("the EAGLE-3 draft step's positions, tokens or block tables are out of range")
        return hidden_out, logits, [row[:k] for row, k in zip(drafts.tolist(), num_drafts)]


class Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in LAYER_WEIGHTS]


class Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_void_p), ("num_layers", ctypes.c_int64), ("layer_stride", ctypes.c_int64)] + \
        [(name, ctypes.c_void_p) for name in ("embed", "norm", "lm_head", "cos", "sin")]


def layer_tensors(layer) -> dict[str, torch.Tensor | None]:
    attn = layer.self_attn
    return {"input_norm": layer.input_layernorm.weight, "qkv": attn.qkv_proj.weight,
            "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
            "k_norm": attn.k_norm.weight if attn.k_norm is not None else None, "o": attn.o_proj.weight,
            "post_norm": layer.post_attention_layernorm.weight, "gate_up": layer.mlp.gate_up_proj.weight,
            "down": layer.mlp.down_proj.weight}


def is_plain_dense(model) -> bool:
    """A Llama-family model whose layers the kernel computes as the modules do: dense SiLU MLPs, no biases,
    per-head q/k norms or none, neox RoPE from a table."""
    from pagedmoe.layers.rotary import RotaryEmbedding
    from pagedmoe.models.llama import MLP, Attention, DecoderForCausalLM, DecoderLayer
    if not isinstance(model, DecoderForCausalLM) or getattr(model.config, "sliding_window", None):
        return False
    for layer in model.layers:
        attn = layer.self_attn
        if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP or type(attn) is not Attention:
            return False
        if attn.qk_norm not in (None, "head") or attn.clip_qkv is not None or type(attn.rotary) is not RotaryEmbedding:
            return False
        if attn.qkv_proj.bias is not None or attn.o_proj.bias is not None:
            return False
    return True


class FusedDraftModel(FusedDrafter):
    def __init__(self, model, tensors: list[dict], library: ctypes.CDLL):
        self.model, self.fn, self.tensors, self.shapes = model, library.dense_draft_f32, tensors, {}
        self.config, self.attn = model.config, model.layers[0].self_attn
        self.layers = (Layer * len(model.layers))(*(Layer(*(ptr(t[name]).value for name in LAYER_WEIGHTS))
                                                    for t in tensors))
        self.vocab_size = model.lm_head.weight.shape[0]
        shared = (model.embed_tokens.weight, model.norm.weight, model.lm_head.weight, *self.attn.rotary.float_tables())
        self.struct = Model(ctypes.addressof(self.layers), len(model.layers), 0, *(ptr(t).value for t in shared))

    @classmethod
    def of(cls, model, library: ctypes.CDLL | None = None) -> "FusedDraftModel | None":
        if not is_plain_dense(model):
            return None
        tensors = [layer_tensors(layer) for layer in model.layers]
        others = [model.embed_tokens.weight, model.norm.weight, model.lm_head.weight]
        every = [t for layer in tensors for t in layer.values() if t is not None] + others
        if not supported_tensors(every):
            return None
        library = library or load_library()
        return cls(model, tensors, library) if library is not None else None

    def __call__(self, cache: torch.Tensor, token_lists: list[list[int]], starts: list[int],
                 block_tables: torch.Tensor, num_drafts: list[int], firsts: list[int] | None = None
                 ) -> tuple[torch.Tensor, list[list[int]]]:
        """Sequence i's tokens token_lists[i] at positions starts[i]... through every layer (cache: all the
        draft's layers), attending its positions from firsts[i] (default 0) on, then num_drafts[i] greedy draft
        steps: the last step's logits and the drafts."""
        n = len(token_lists)
        rows, row_start, tokens, positions, counts, first = pack_rows(token_lists, starts, num_drafts,
                                                                      firsts or [0] * n)
        tables, max_drafts = block_tables.contiguous(), max(num_drafts)
        drafts, logits = torch.empty(n, max_drafts, dtype=torch.long), torch.empty(n, self.vocab_size)
        self.struct.layer_stride = cache.stride(0)
        status = self.fn(ctypes.byref(self.struct), ctypes.byref(self.shape(cache[0], tables)), ptr(cache),
                         ctypes.c_int64(n), row_start, tokens, positions, first, ptr(tables), counts,
                         ctypes.c_int64(max_drafts), ptr(drafts), ptr(logits), num_threads())
        if status:
            raise ValueError("the draft model's positions, tokens or block tables are out of range")
        return logits, [row[:k] for row, k in zip(drafts.tolist(), num_drafts)]
