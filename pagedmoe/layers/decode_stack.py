"""Every decoder layer of a dense model for a step of decodes in one C++ call (decode_stack in
attention/csrc/decode_block.cpp): each layer's decode block, then its MLP (the gated gate_up and the down
projection on the tile kernel) and residual add. The kernels and their order are those of the layers' modules,
so the output is bit-identical; what goes is the Python and dispatch between the layers. That cost more than a
microbenchmark of it shows: every wrapper and torch op after a kernel runs on caches the kernel's weights just
flushed, ~0.5 ms a layer at 64 decodes against ~0.1 ms warm (qwen3-100m, float32, AVX2 EPYC)."""
import ctypes

import torch
from torch import Tensor

from pagedmoe.layers.attention import decode_block
from pagedmoe.layers.attention.decode_block import SUFFIXES, LayerArgs, ProjArgs, proj_args, step_args
from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.linear import GateUpLinear, Linear


class MlpArgs(ctypes.Structure):
    _fields_ = [("gate_up", ProjArgs), ("down", ProjArgs), ("intermediate", ctypes.c_int64)]


def unsupported_reason(model) -> str | None:
    """model.has_plain_layers(): every layer a decoder layer with a dense MLP, as the stack runs them."""
    if not model.has_plain_layers() or any(layer.decode_block is None for layer in model.layers):
        return "not every layer is a plain decoder layer with a dense MLP and a decode block"
    if any(layer.decode_block.window for layer in model.layers):
        return "sliding-window layers attend with tables of their own"
    if not all(on_tile_kernel(layer.mlp) for layer in model.layers):
        return "not every MLP runs on the tile kernel"
    return None


def on_tile_kernel(mlp) -> bool:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return type(gate_up) is GateUpLinear and type(down) is Linear and all(
        linear.fp4 is None and linear.cpu_kernel is not None for linear in (gate_up, down))


def mlp_args(mlp, dtype: torch.dtype) -> tuple[MlpArgs, list[Tensor | None]]:
    (gate_up, gate_up_tensors), (down, down_tensors) = (proj_args(p, dtype) for p in (mlp.gate_up_proj,
                                                                                      mlp.down_proj))
    return MlpArgs(gate_up, down, mlp.down_proj.in_features), [*gate_up_tensors, *down_tensors]


class DecodeStack:
    """model: a DecoderForCausalLM (models/llama.py) whose layers all have decode blocks and dense MLPs on the
    tile kernel. Call it in place of the loop over the layers: their output, or None where it does not apply."""

    def __init__(self, model, library: ctypes.CDLL | None = None):
        if reason := unsupported_reason(model):
            raise ValueError(f"decode stack: {reason}")
        layers = list(model.layers)
        self.blocks = [layer.decode_block for layer in layers]
        self.dtype, self.hidden = self.blocks[0].dtype, self.blocks[0].hidden
        library = library if library is not None else decode_block.load_library()
        self.fn = getattr(library, f"decode_stack_{SUFFIXES[self.dtype]}")
        self.fn.restype = None
        mlps = [mlp_args(layer.mlp, self.dtype) for layer in layers]
        self.layer_args = (LayerArgs * len(layers))(*(block.args for block in self.blocks))
        self.mlp_args = (MlpArgs * len(layers))(*(args for args, _ in mlps))
        self.tensors = [tensor for _, tensors in mlps for tensor in tensors]  # held: the structs point into them
        self.intermediate = max(layer.mlp.down_proj.in_features for layer in layers)
        self.block_width = max(block.scratch_width for block in self.blocks)
        self.float_width = max(block.float_scratch_width for block in self.blocks)
        mlp_rows = [p.cpu_kernel.max_rows for layer in layers for p in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.max_rows = min(*mlp_rows, *(block.max_rows for block in self.blocks))

    def __call__(self, positions: Tensor, x: Tensor, meta: AttentionMetadata) -> Tensor | None:
        if meta.aux_hidden_layers or meta.output_rows is not None or not self.applies(x, meta):
            return None
        step = step_args(meta, positions)
        if step is None:
            return None
        caches = (ctypes.c_void_p * len(self.blocks))(*(meta.layer_cache(b.layer_idx).data_ptr() for b in self.blocks))
        out, rows = torch.empty_like(x), x.shape[0]
        scratch = torch.empty(rows * (3 * self.hidden + self.block_width + self.intermediate), dtype=x.dtype)
        float_scratch = torch.empty(rows * self.float_width)
        self.fn(self.layer_args, self.mlp_args, caches, ctypes.c_int64(len(self.blocks)), ctypes.byref(step), ptr(x),
                ptr(out), ptr(scratch), ctypes.c_int64(self.block_width), ptr(float_scratch), num_threads())
        return out

    def applies(self, x: Tensor, meta: AttentionMetadata) -> bool:
        return x.shape[0] <= self.max_rows and self.blocks[0].applies(x, meta)


def attach_decode_stack(model: torch.nn.Module) -> bool:
    """Gives the model its decode stack where every layer can take part (after attach_decode_blocks)."""
    if not hasattr(model, "has_plain_layers"):
        return False
    model.decode_stack = None if unsupported_reason(model) else DecodeStack(model)
    return model.decode_stack is not None
