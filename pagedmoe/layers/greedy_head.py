"""Greedy next tokens of a float32 model without its float32 logits, the same tokens: the LM head runs on
bf16 copies of the hidden states and its weight (native bf16 dot products: 2-2.5x the float32 tile's rate, half
its bytes), then a bound on that product's error leaves a few candidate tokens a row, whose float32 logits the
float32 tile kernel computes as it would have in the full head; the first of their largest is the argmax of the
float32 logits (csrc/linear.cpp, bounded_argmax_row).

The bound: with x~ and w~ the bf16 roundings (relative error at most u = 2^-8 each), every product is off by at
most (2u + u^2)|x_i w_i|, and float32 accumulation over K terms adds at most K 2^-24 sum |x_i w_i| in either
kernel, so |approx - logit| <= (2^-7 + 2 K 2^-24 + ...) sum |x_i w_i| <= eps |x| |w| (Cauchy-Schwarz), eps with a
quarter more for the roundings of the bound itself. A token whose approx plus its bound is below another's approx
minus its bound cannot be the argmax."""
import ctypes

import torch
from torch import Tensor

from pagedmoe.cpu_info import has_native_bf16
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.cpu_linear import CpuLinear, Shape

# below these the bound could miss bf16 underflow (denormals are flushed): the full logits are taken instead
MIN_HIDDEN_NORM, MIN_WEIGHT_NORM = 2.0 ** -60, 2.0 ** -40


def error_factor(in_features: int) -> float:
    return 1.25 * (2.0 ** -7 + 2.0 ** -16 + 2 * in_features * 2.0 ** -24)


class GreedyHead:
    """head: the LM head's float32 tile kernel (CpuLinear); its weight [V, K] float32."""

    def __init__(self, head: CpuLinear, weight: Tensor, library: ctypes.CDLL | None = None):
        self.library = library if library is not None else cpu_linear.load_library()
        if weight.dtype != torch.float32 or head.weight.dtype != torch.float32 or head.gated:
            raise ValueError(f"the greedy head takes a float32 LM head, got {weight.dtype}")
        self.weight, self.max_rows = weight.detach().contiguous(), head.max_rows  # where the full head runs the tile
        self.approx = CpuLinear(weight.detach().bfloat16(), self.library, max_rows=head.max_rows)
        name = "linear_amx_bf16_to_f32" if self.approx.on_amx else "linear_bf16_to_f32"
        self.approx_fn = getattr(self.library, name)
        self.approx_fn.restype = None
        self.library.bounded_argmax_f32.restype = None
        self.eps = error_factor(weight.shape[1])
        # float64 norms rounded to float32 (2^-24 relative) stay inside eps's quarter of margin
        self.w_norms = weight.detach().double().norm(dim=1).clamp(min=MIN_WEIGHT_NORM).float()

    def __call__(self, hidden: Tensor) -> Tensor | None:
        """The argmax of hidden's float32 logits, a row each; None where it does not apply (too many rows, a
        row too small or not finite): take the logits."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.dtype != torch.float32 or rows.shape[0] > self.max_rows or rows.shape[0] == 0:
            return None
        rows = rows.contiguous()
        norms = rows.double().norm(dim=1)
        if not bool((norms >= MIN_HIDDEN_NORM).all()):  # NaN too; an infinite norm's bound makes the kernel say -1
            return None
        approx, rounded = torch.empty(rows.shape[0], self.approx.out_features), rows.bfloat16()
        shape = Shape(rows.shape[0], self.approx.out_features, self.approx.in_features)
        self.approx_fn(ptr(rounded), ptr(self.approx.weight), ptr(approx), shape, num_threads())
        bounds, out = (norms * self.eps).float(), torch.empty(rows.shape[0], dtype=torch.int64)
        self.library.bounded_argmax_f32(ptr(rows), ptr(self.weight), ptr(approx), ptr(self.w_norms),
                                        ptr(bounds), ptr(out), shape, num_threads())
        return None if bool((out < 0).any()) else out


def attach_greedy_head(model) -> bool:
    """model.greedy_head, where the LM head runs float32 on the tile kernel without a bias, on a CPU whose
    kernel has bf16 dot products (pairs or AMX tiles); False elsewhere."""
    head = getattr(model, "lm_head", None)
    kernel = getattr(head, "cpu_kernel", None)
    if kernel is None or head.bias is not None or head.weight.dtype != torch.float32 or not has_native_bf16():
        return False
    library = cpu_linear.load_library()
    if not (library.linear_bf16_pairs() or cpu_linear.uses_amx(library, head.weight[:1].bfloat16())):
        return False
    model.greedy_head = GreedyHead(kernel, head.weight, library)
    return True
