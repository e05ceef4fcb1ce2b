"""A decoder layer's attention half for a step of decodes in one C++ call (csrc/decode_block.cpp): input norm,
qkv, q/k norms, rotary, KV write, paged decode attention, o projection, residual add and the post-attention
norm. Each is the kernel the layer's modules call one by one (cpu_ops, cpu_linear, cpu_kernel), in the same
order, so the output is bit-identical; what goes is the Python and dispatch between them, about 100 us a
layer at one token. It applies where every one of those kernels would run: CPU, a step of decodes attended by
the decode kernel, projections on the tile kernel or (packed 4-bit) on the int8-dot kernel at this row count.
Elsewhere the layer's modules run."""
import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.layers import cpu_build, cpu_ops
from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.linear import Linear, MergedLinear
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.layers.quantization.fp4_kernel import ACT_BLOCK
from pagedmoe.layers.quantization import fp4_linear
from pagedmoe.layers.rotary import RotaryEmbedding

SOURCE = Path(__file__).with_name("csrc") / "decode_block.cpp"
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
QK_NORMS = {None: 0, "head": 1, "full": 2}


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class ProjArgs(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("weight", "bias", "scales", "row_scale")),
                ("kind", ctypes.c_int64), ("block", ctypes.c_int64)]


class LayerArgs(ctypes.Structure):
    _fields_ = [("qkv", ProjArgs), ("o", ProjArgs),
                *((name, ctypes.c_void_p) for name in (
                    "input_norm", "post_norm", "q_norm", "k_norm", "cos", "sin", "sinks")),
                *((name, ctypes.c_int64) for name in (
                    "hidden", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "window")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class StepArgs(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("positions", "slots", "block_tables", "seq_lens")),
                *((name, ctypes.c_int64) for name in ("tokens", "max_blocks", "num_blocks", "block_size"))]


def unsupported_reason(layer) -> str | None:
    attn = layer.self_attn
    if type(attn.qkv_proj) is not MergedLinear or type(attn.o_proj) is not Linear:
        return "the projections are split over ranks or not plain linears"
    if max_rows_of(attn.qkv_proj) == 0 or max_rows_of(attn.o_proj) == 0:
        return "the projections run on neither the CPU tile kernel nor the 4-bit one"
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *filter(None, (attn.q_norm, attn.k_norm))]
    if any(type(norm) is not RMSNorm for norm in norms) or len({norm.eps for norm in norms}) > 1:
        return "the norms are not RMSNorms of one eps"
    if attn.clip_qkv is not None or attn.qk_norm not in QK_NORMS or type(attn.rotary) is not RotaryEmbedding:
        return "the layer clips qkv, or its q/k norm or rotary is another kind"
    if attn.rotary.cos.shape[-1] != attn.head_dim or layer.input_layernorm.weight.dtype not in SUFFIXES:
        return "partial rotary, or a dtype the kernels do not take"
    return None


def max_rows_of(linear: Linear) -> int:
    """The most rows for which the projection runs the kernel the block runs (0: it never does)."""
    if linear.fp4 is not None:
        usable = fp4_linear.fp4_kernel() is not None and linear.fp4.shape[1] % ACT_BLOCK == 0
        return fp4_linear.MAX_DOT_ROWS if usable else 0
    return 0 if linear.cpu_kernel is None else linear.cpu_kernel.max_rows


def proj_args(linear: Linear, dtype: torch.dtype) -> tuple[ProjArgs, list[Tensor]]:
    """The projection as the kernel reads it, and the tensors it points into."""
    bias = None if linear.bias is None else linear.bias.detach().to(dtype).contiguous()
    if linear.fp4 is not None:
        w = linear.fp4
        return ProjArgs(*(_address(t) for t in (w.codes, bias, w.scales, w.row_scale)), 2, w.block), \
            [w.codes, bias, w.scales, w.row_scale]
    kernel = linear.cpu_kernel
    return ProjArgs(_address(kernel.weight), _address(bias), None, None, int(kernel.on_amx), 0), [kernel.weight, bias]


def _address(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class DecodeBlock:
    """layer: a DecoderLayer (models/llama.py) whose projections run on the CPU tile kernel or the 4-bit one.
    Call it as the layer's attention half: (x + attention(norm(x)), post_norm of that), or None where it does
    not apply."""

    def __init__(self, layer, library: ctypes.CDLL | None = None):
        if reason := unsupported_reason(layer):
            raise ValueError(f"decode block: {reason}")
        attn = layer.self_attn
        self.dtype = layer.input_layernorm.weight.dtype
        self.fn = getattr(library if library is not None else load_library(), f"decode_block_{SUFFIXES[self.dtype]}")
        self.fn.restype = None
        self.layer_idx, self.window = attn.attn.layer_idx, attn.attn.window
        self.max_rows = min(max_rows_of(attn.qkv_proj), max_rows_of(attn.o_proj))
        self.hidden = layer.input_layernorm.weight.shape[0]
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        self.scratch_width = self.hidden + 2 * q_size + 2 * kv_size + q_size
        packed = attn.qkv_proj.fp4 is not None or attn.o_proj.fp4 is not None  # 4-bit projections take float rows
        self.float_scratch_width = 2 * self.hidden + q_size + 2 * kv_size if packed else 0
        self.args, self.tensors = self._args(layer)  # tensors: held, the struct points into them

    def _tensors(self, layer) -> dict[str, Tensor | None]:
        attn = layer.self_attn
        sinks = None if attn.sinks is None else attn.sinks.detach().float().contiguous()
        cos, sin = attn.rotary.float_tables()
        return {"input_norm": layer.input_layernorm.weight.detach().contiguous(),
                "post_norm": layer.post_attention_layernorm.weight.detach().contiguous(),
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight.detach().contiguous(),
                "k_norm": None if attn.k_norm is None else attn.k_norm.weight.detach().contiguous(),
                "cos": cos, "sin": sin, "sinks": sinks}

    def _args(self, layer) -> tuple[LayerArgs, list[Tensor | None]]:
        attn, tensors = layer.self_attn, self._tensors(layer)
        (qkv, qkv_tensors), (o, o_tensors) = (proj_args(p, self.dtype) for p in (attn.qkv_proj, attn.o_proj))
        pointers = {name: _address(t) for name, t in tensors.items()}
        args = LayerArgs(qkv, o, **pointers, hidden=self.hidden, num_heads=attn.num_heads,
                         num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, qk_norm=QK_NORMS[attn.qk_norm],
                         window=self.window, eps=layer.input_layernorm.eps, scale=attn.attn.scale)
        return args, [*tensors.values(), *qkv_tensors, *o_tensors]

    def __call__(self, positions: Tensor, x: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor] | None:
        meta = meta.for_layer(self.window)
        if not self.applies(x, meta):
            return None
        step = step_args(meta, positions)
        if step is None:
            return None
        out = torch.empty(2, *x.shape, dtype=x.dtype)
        scratch = torch.empty(x.shape[0] * self.scratch_width, dtype=x.dtype)
        float_scratch = torch.empty(x.shape[0] * self.float_scratch_width)
        self.fn(ctypes.byref(self.args), ctypes.byref(step), ptr(x), ptr(meta.layer_cache(self.layer_idx)),
                ptr(out[0]), ptr(out[1]), ptr(scratch), ptr(float_scratch), num_threads())
        return out[0], out[1]

    def applies(self, x: Tensor, meta: AttentionMetadata) -> bool:
        """meta: the metadata this layer attends with (for_layer)."""
        if not cpu_ops.enabled or meta.decode_kernel is None or meta.triton is not None:
            return False
        if x.dtype != self.dtype or x.dim() != 2 or not x.is_contiguous() or x.shape[0] > self.max_rows:
            return False
        groups = meta.groups
        return len(groups) == 1 and groups[0].is_decode and not (torch.is_grad_enabled() and x.requires_grad)


def step_args(meta: AttentionMetadata, positions: Tensor) -> StepArgs | None:
    """The step's inputs as the kernel reads them, built once per metadata and positions (every layer that
    attends with this metadata shares them); None where a layout does not fit."""
    cached = getattr(meta, "_decode_block_step", None)
    if cached is not None and cached[0] is positions:
        return cached[1]
    group, cache = meta.groups[0], meta.kv_caches
    tensors = (positions, meta.slot_mapping, group.block_tables, group.seq_lens_tensor)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors) or not cache.is_contiguous():
        return None
    step = StepArgs(*(t.data_ptr() for t in tensors), tokens=positions.shape[0],
                    max_blocks=group.block_tables.shape[1], num_blocks=cache.shape[2], block_size=cache.shape[3])
    meta._decode_block_step = (positions, step)
    return step


def attach_decode_blocks(model: torch.nn.Module) -> int:
    """Gives every decoder layer that can take one its decode block (after the CPU kernels are attached);
    returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "decode_block") and hasattr(m, "self_attn")]
    for layer in layers:
        layer.decode_block = None if unsupported_reason(layer) else DecodeBlock(layer)
    return sum(layer.decode_block is not None for layer in layers)
