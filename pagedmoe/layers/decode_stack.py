"""Every decoder layer of a model for a step of decodes in one C++ call (decode_stack in
attention/csrc/decode_block.cpp): each layer's decode block, then its MLP (dense: the gated gate_up and the down
projection on the tile kernel; sparse: the CPU router and the fused-MoE kernel) and residual add. The kernels
and their order are those of the layers' modules, so the output is bit-identical; what goes is the Python and
dispatch between the layers. That cost more than a microbenchmark of it shows: every wrapper and torch op after a
kernel runs on caches the kernel's weights just flushed, ~0.5 ms a layer at 64 decodes against ~0.1 ms warm
(qwen3-100m, float32, AVX2 EPYC); on a MoE model, ~10% of a float32 decode (qwen3-moe-100m-active, Zen 4).
A dense model's larger steps on 2 threads run as two halves of the sequences, a thread each (in_halves)."""
import ctypes

import torch
from torch import Tensor

from pagedmoe.layers.attention import decode_block
from pagedmoe.layers.attention.decode_block import SUFFIXES, LayerArgs, ProjArgs, proj_args, step_args
from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.linear import GateUpLinear, Linear
from pagedmoe.layers.moe import cpu_router
from pagedmoe.layers.moe.cpu_kernel import Epilogue
from pagedmoe.layers.moe.cpu_router import RouterArgs
from pagedmoe.layers.moe.layer import FusedMoE


class MoeArgs(ctypes.Structure):
    _fields_ = [("router", RouterArgs), ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("epilogue", Epilogue),
                *((name, ctypes.c_int64) for name in ("num_experts", "inter", "amx"))]


class MlpArgs(ctypes.Structure):
    _fields_ = [("gate_up", ProjArgs), ("down", ProjArgs), ("intermediate", ctypes.c_int64),
                ("moe", ctypes.POINTER(MoeArgs))]


def unsupported_reason(model) -> str | None:
    """model.has_plain_layers(): every layer a decoder layer with a dense or sparse MLP, as the stack runs them."""
    if not model.has_plain_layers() or any(layer.decode_block is None for layer in model.layers):
        return "not every layer is a plain decoder layer with a decode block"
    if any(layer.decode_block.window for layer in model.layers):
        return "sliding-window layers attend with tables of their own"
    if not all(on_tile_kernel(layer.mlp) or on_moe_kernel(layer.mlp) for layer in model.layers):
        return "not every MLP runs on the tile kernel or the CPU router and MoE kernel"
    return None


def on_moe_kernel(mlp) -> bool:
    return isinstance(mlp, FusedMoE) and mlp.on_cpu_kernels_only()


def on_tile_kernel(mlp) -> bool:
    if isinstance(mlp, FusedMoE):
        return False
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return type(gate_up) is GateUpLinear and type(down) is Linear and all(
        linear.fp4 is None and linear.cpu_kernel is not None for linear in (gate_up, down))


def mlp_args(mlp, dtype: torch.dtype) -> tuple[MlpArgs, list]:
    """The MLP as the kernel reads it, and what it points into."""
    if isinstance(mlp, FusedMoE):
        return moe_args(mlp, dtype)
    (gate_up, gate_up_tensors), (down, down_tensors) = (proj_args(p, dtype) for p in (mlp.gate_up_proj,
                                                                                      mlp.down_proj))
    return MlpArgs(gate_up, down, mlp.down_proj.in_features), [*gate_up_tensors, *down_tensors]


def moe_args(moe: FusedMoE, dtype: torch.dtype) -> tuple[MlpArgs, list]:
    experts = moe.cpu_experts
    gate = moe.float_gate()  # the float32 copy the router's arguments point into
    args = MoeArgs(moe.cpu_router.args(dtype), experts.w13.data_ptr(), experts.w2.data_ptr(), experts.epilogue,
                   experts.num_experts, experts.inter, int(experts.amx_fn is not None))
    return MlpArgs(moe=ctypes.pointer(args)), [args, gate, experts.w13, experts.w2, experts.b13, experts.b2]


def max_mlp_rows(mlp) -> int:
    if isinstance(mlp, FusedMoE):
        return min(cpu_router.MAX_TOKENS, mlp.cpu_experts.max_tokens(mlp.router.top_k))
    return min(p.cpu_kernel.max_rows for p in (mlp.gate_up_proj, mlp.down_proj))


# From this many decodes a dense stack on 2 threads runs in halves, a thread each (decode_stack_halves in
# decode_block.cpp): 0.92-1.0x a step at 40-64 decodes, 1.01x at 32 (qwen3-100m float32 and bf16, Zen 4).
HALVES_MIN_ROWS = 40
# A decode's projections cost about as much as its attention over this many context tokens (qwen3-100m float32,
# Zen 4: ~118 us a layer against ~0.14 us a token); the halves split the step's work so, not its rows.
HALVES_ROW_TOKENS = 870


class DecodeStack:
    """model: a DecoderForCausalLM (models/llama.py) whose layers all have decode blocks, and dense MLPs on the
    tile kernel or MoE blocks on the CPU router and MoE kernel. Call it in place of the loop over the layers:
    their output, or None where it does not apply."""

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
        intermediate = max(args.intermediate for args, _ in mlps)
        self.block_width = max(block.scratch_width for block in self.blocks)
        self.scratch_width = 3 * self.hidden + self.block_width + intermediate  # per token, as the kernel lays it out
        self.float_width = max(block.float_scratch_width for block in self.blocks)
        mlp_rows = [max_mlp_rows(layer.mlp) for layer in layers]
        self.max_rows = min(*mlp_rows, *(block.max_rows for block in self.blocks))
        self.moe_indices = [getattr(layer.mlp, "moe_index", None) for layer in layers]
        self.experts = [(layer.mlp, layer.mlp.cpu_experts) for layer in layers if isinstance(layer.mlp, FusedMoE)]
        self.halves_min_rows = HALVES_MIN_ROWS

    def __call__(self, positions: Tensor, x: Tensor, meta: AttentionMetadata) -> Tensor | None:
        if meta.aux_hidden_layers or meta.output_rows is not None or not self.applies(x, meta):
            return None
        step = step_args(meta, positions)
        if step is None:
            return None
        caches = (ctypes.c_void_p * len(self.blocks))(*(meta.layer_cache(b.layer_idx).data_ptr() for b in self.blocks))
        out, rows = torch.empty_like(x), x.shape[0]
        scratch = torch.empty(rows * self.scratch_width, dtype=x.dtype)
        float_scratch = torch.empty(rows * self.float_width)
        widths = (ctypes.c_int64 * 3)(self.block_width, self.scratch_width, self.float_width)
        self.fn(self.layer_args, self.mlp_args, caches, self.expert_loads(meta), ctypes.c_int64(len(self.blocks)),
                ctypes.byref(step), ptr(x), ptr(out), ptr(scratch), widths, ptr(float_scratch), num_threads(),
                self.halves_split(rows, meta.groups[0].seq_lens_tensor))
        return out

    def halves_split(self, rows: int, seq_lens: Tensor) -> int:
        """The first row of the second half, where the halves' projections and attention weigh about the same
        (contexts differ by hundreds of tokens); 0 where the stack runs whole."""
        if not self.in_halves(rows):
            return 0
        work = seq_lens + HALVES_ROW_TOKENS
        middles = torch.cumsum(work, 0) - work // 2  # a row goes to the half its middle falls in
        return min(max(int(torch.searchsorted(middles, work.sum() // 2)), 1), rows - 1)

    def in_halves(self, rows: int) -> bool:
        """Whether the step runs as two halves, a thread each: a dense model on 2 threads, from
        halves_min_rows decodes (each half's experts would read their weights again)."""
        return not self.experts and num_threads().value == 2 and rows >= self.halves_min_rows

    def applies(self, x: Tensor, meta: AttentionMetadata) -> bool:
        load = meta.expert_load
        countable = load is None or load.dtype == torch.int64 and load.is_contiguous()
        return x.shape[0] <= self.max_rows and countable and self.blocks[0].applies(x, meta) and self.same_experts()

    def same_experts(self) -> bool:
        """The experts packed when the stack was built, still the layers' own (EPLB repacks them) and unmapped."""
        return all(moe.cpu_experts is experts and moe.expert_map is None for moe, experts in self.experts)

    def expert_loads(self, meta: AttentionMetadata):
        """Each layer's row of the step's expert load (MoEBlock counts into it; contiguous, see applies), or
        null."""
        load = meta.expert_load
        if load is None:
            return None
        base, row_bytes = load.data_ptr(), load.stride(0) * load.element_size()
        return (ctypes.c_void_p * len(self.blocks))(*(None if i is None else base + i * row_bytes
                                                      for i in self.moe_indices))


def attach_decode_stack(model: torch.nn.Module) -> bool:
    """Gives the model its decode stack where every layer can take part (after attach_decode_blocks)."""
    if not hasattr(model, "has_plain_layers"):
        return False
    model.decode_stack = None if unsupported_reason(model) else DecodeStack(model)
    return model.decode_stack is not None
