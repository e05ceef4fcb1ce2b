import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe.cpu_info import can_prepack_bf16
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.activation import silu_and_mul
from pagedmoe.layers.quantization.fp4_kernel import PackedFp4Weight
from pagedmoe.layers.quantization.fp4_linear import fp4_linear

PACK_MIN_BYTES = 1 << 20  # smaller float32 weights stay in a core's L2, where MKL's per-call packing is cheap
#                           and oneDNN's call overhead (~11 us more at one row) is not. bf16 weights take the
#                           tile kernel at any size: F.linear's oneDNN bf16 path reorders the weight on every
#                           call (Xeon with AMX: 576 x 576 at one row 45 us against 18; 128 x 128 26 against 13)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN pre-packing applies to CPU float32 matrices when torch was built with it, and to bfloat16 ones
    where oneDNN has a bf16 path on this CPU (AVX-512 or AVX-NE-CONVERT): elsewhere it refuses them."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and can_prepack_bf16())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight: a thin GEMM then streams it once, without MKL's per-call
    packing, which dominates decode-shaped (few-row) matmuls on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can run on a pre-packed copy of its weight (`pack`, after the weights are loaded), or on
    a 4-bit one from the checkpoint (`set_fp4`), which replaces the dense weight."""

    packed_weight: torch.Tensor | None = None
    cpu_kernel: cpu_linear.CpuLinear | None = None
    cpu_kernel_kind = "linear"
    fp4: PackedFp4Weight | None = None

    def set_fp4(self, weight: PackedFp4Weight):
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(f"4-bit weight of shape {weight.shape} for a {tuple(self.weight.shape)} linear layer")
        self.fp4 = weight
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    def pack(self, min_bytes: int = 0):
        if self.fp4 is None and can_pack(self.weight) and nbytes(self.weight) >= min_bytes:
            self.packed_weight = pack_weight(self.weight)

    gated = False  # GateUpLinear: the kernel applies silu(gate) * up itself

    def use_cpu_kernel(self, min_bytes: int = 0) -> bool:
        """Runs decode-sized inputs through the CPU tile-GEMM kernel and larger ones through MKL (as fast as
        oneDNN's packed copy there in float32 on Intel), so the weight is held twice, not three times; elsewhere
        a weight that the kernel takes at decode sizes only keeps oneDNN's packed copy for the rest
        (cpu_linear.keeps_packed_copy). False where it does not apply (dtype, shape, a float32 weight under
        min_bytes)."""
        if self.fp4 is not None:
            return False
        panel = cpu_linear.load_library().linear_panel()
        small = self.weight.dtype == torch.float32 and nbytes(self.weight) < min_bytes
        if cpu_linear.unsupported_reason(self.weight, panel) or small:
            return False
        if self.gated and self.bias is not None:
            return False
        kernel = cpu_linear.CpuLinear(self.weight, gated=self.gated)
        if kernel.max_rows == 0:  # native bf16 without AMX or pair dot products: oneDNN's kernels stay faster
            return False
        self.cpu_kernel = kernel
        if not cpu_linear.keeps_packed_copy(self.weight.dtype, kernel.max_rows):
            self.packed_weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp4 is not None:
            return fp4_linear(x, self.fp4, self.bias)
        if self.cpu_kernel is not None and self.cpu_kernel.fits(x):
            return self.cpu_kernel(x, self.bias)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed_weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several HF projections (q/k/v, gate/up); each checkpoint tensor loads into its row range."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False, **factory):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, **factory)
        self.shard_offsets, offset = {}, 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor | PackedFp4Weight):
        offset, size = self.shard_offsets[shard]
        if isinstance(tensor, PackedFp4Weight):
            return self.load_fp4_shard(shard, tensor)
        target = getattr(self, param_name)
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}.{param_name}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[offset:offset + size].copy_(tensor)

    def load_fp4_shard(self, shard: str, weight: PackedFp4Weight):
        """4-bit shards are kept until all have loaded, then joined in row order into one packed weight."""
        if weight.shape[0] != self.shard_offsets[shard][1]:
            raise ValueError(f"shard {shard}: expected {self.shard_offsets[shard][1]} rows, got {weight.shape}")
        self.fp4_shards = {**getattr(self, "fp4_shards", {}), shard: weight}
        if len(self.fp4_shards) == len(self.shard_offsets):
            self.set_fp4(PackedFp4Weight.cat([self.fp4_shards[name] for name in self.shard_offsets]))
            del self.fp4_shards


class GateUpLinear(MergedLinear):
    """The gate and up projections of a SiLU-gated MLP in one matmul, returning silu(gate) * up."""

    gated = True

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False, **factory):
        super().__init__(in_features, {"gate": intermediate_size, "up": intermediate_size}, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel is not None and self.cpu_kernel.fits(x):
            return self.cpu_kernel(x)
        return silu_and_mul(super().forward(x))


def nbytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size()


def pack_weights(model: nn.Module):
    """Pre-packs every layer that supports it (Linear, FusedMoE experts) whose weight matrices are at least
    PACK_MIN_BYTES; call once the weights are final."""
    for module in model.modules():
        if hasattr(module, "pack"):
            module.pack(PACK_MIN_BYTES)


def attach_cpu_kernels(model: nn.Module, kinds: set[str], min_bytes: int | None = None) -> int:
    """Gives every layer of these kinds ("linear", "moe") that a CPU tile kernel can run, and whose weight
    float32 matrices are at least min_bytes (default PACK_MIN_BYTES), its packed copy; returns how many.
    RuntimeError where the kernels cannot be built."""
    min_bytes = PACK_MIN_BYTES if min_bytes is None else min_bytes
    layers = [m for m in model.modules() if getattr(m, "cpu_kernel_kind", None) in kinds]
    return sum(layer.use_cpu_kernel(min_bytes) for layer in layers)
