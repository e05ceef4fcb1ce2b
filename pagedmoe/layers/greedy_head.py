"""Greedy next tokens of a float32 or bf16 model without its logits, the same tokens: the LM head runs on int8
copies of the hidden states and its weight (int8 dot products from AVX2 up: on a Zen 4 with VNNI 2.5x the float32
tile's rate, a quarter of its bytes) or, on AMX, bf16 copies; a bound on that product's error leaves a few dozen
candidate tokens a row. Their float32 products in any order (within 2 K 2^-24 |x| |w| of the tile's) leave one
or a few, whose float32 logits the float32 tile kernel computes as it would have in the full head; the first of
their largest is the argmax of the float32 logits (csrc/linear.cpp, bounded_argmax_row).

The bf16 bound: with x~ and w~ the bf16 roundings (relative error at most u = 2^-8 each), every product is off by
at most (2u + u^2)|x_i w_i|, and float32 accumulation over K terms adds at most K 2^-24 sum |x_i w_i| in either
kernel, so |approx - logit| <= (2^-7 + 2 K 2^-24 + ...) sum |x_i w_i| <= eps |x| |w| (Cauchy-Schwarz), eps with a
quarter more for the roundings of the bound itself. The int8 bound: Int8Logits. A token whose approx plus its
bound is below another's approx minus its bound cannot be the argmax."""
import ctypes

import torch
from torch import Tensor

from pagedmoe.cpu_info import cpu_flags
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.cpu_linear import CpuLinear, Shape

# below these the bounds could miss underflow (bf16's flushed denormals, int8 scales' products): the full logits
MIN_HIDDEN_NORM, MIN_WEIGHT_NORM = 2.0 ** -30, 2.0 ** -40
# float32 roundings of the int8 head's approx (the int32 sum, two scales) and of the kernel's comparisons
ROUNDING = 2.0 ** -20
MARGIN = 1.0625  # for the roundings of the bounds themselves
ARGMAX_ENTRY_POINTS = {torch.float32: "bounded_argmax_f32", torch.bfloat16: "bounded_argmax_bf16"}


def error_factor(in_features: int) -> float:
    return 1.25 * (2.0 ** -7 + 2.0 ** -16 + 2 * in_features * 2.0 ** -24)


class Bf16Logits:
    """Approximate logits from bf16 copies of the hidden states and the weight (AMX tiles or avx512_bf16
    pairs); each within eps |x| |w_n| of the float32 head's."""

    def __init__(self, weight: Tensor, library: ctypes.CDLL, max_rows: int, w_norms: Tensor):
        self.head = CpuLinear(weight.bfloat16(), library, max_rows=max_rows)
        self.fn = getattr(library, "linear_amx_bf16_to_f32" if self.head.on_amx else "linear_bf16_to_f32")
        self.fn.restype = None
        self.eps, self.w_errors = error_factor(weight.shape[1]), w_norms  # error_scales are 0

    def __call__(self, rows: Tensor, norms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(approx [rows, N], scales, error_scales [rows]): no logit is further than scales[r] |w_n| +
        error_scales[r] w_errors[n] from its approx."""
        approx, rounded = torch.empty(rows.shape[0], self.head.out_features), rows.bfloat16()
        shape = Shape(rows.shape[0], self.head.out_features, self.head.in_features)
        self.fn(ptr(rounded), ptr(self.head.weight), ptr(approx), shape, num_threads())
        scales = (norms * self.eps).float()
        return approx, scales, torch.zeros_like(scales)


class Int8Logits:
    """Approximate logits from int8 copies: the weight a scale per row, the hidden states a scale per row
    (csrc/int8_tile.h). With x^ and w^ the scaled int8 values, x.w - x^.w^ = (x - x^).w + x^.(w - w^), so
    |error| <= |x - x^| |w| + |x^| |w - w^|, from exact norms (float64) rather than a worst case: w_errors[n]
    is |w_n - w^_n| (with the roundings of the approx itself), error_scales[r] |x^_r|."""

    def __init__(self, weight: Tensor, library: ctypes.CDLL, w_norms: Tensor):
        self.fn, self.offset = library.linear_i8_to_f32, library.linear_i8_offset()
        self.fn.restype = None
        values, self.scales, self.w_errors = quantized_rows(weight.detach().double(), w_norms.double())
        self.sums, self.shape = values.sum(dim=1, dtype=torch.int32), values.shape  # [V, K padded to quads]
        self.packed = pack_i8(values, library.linear_i8_panel())
        self.f32_error = 2 * weight.shape[1] * 2.0 ** -24 + ROUNDING  # the float32 head's own sums

    def __call__(self, rows: Tensor, norms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = rows.float()
        scales = rows.abs().amax(dim=1) / 127
        values = (rows / scales[:, None]).round_().clamp_(-127, 127)
        rounded = values.double() * scales.double()[:, None]
        off, rounded_norms = (rows.double() - rounded).norm(dim=1), rounded.norm(dim=1)
        approx, shape = torch.empty(rows.shape[0], self.shape[0]), Shape(rows.shape[0], *self.shape)
        x = padded_to_quads(values.add_(self.offset).to(torch.int16).to(torch.uint8), self.offset)
        self.fn(ptr(x), ptr(self.packed), ptr(self.sums), ptr(scales), ptr(self.scales), ptr(approx), shape,
                num_threads())
        return approx, (MARGIN * (off + norms * self.f32_error)).float(), (MARGIN * rounded_norms).float()


def quantized_rows(weight: Tensor, norms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(int8 values [N, K4], float32 scales [N], w_errors [N]) of a float64 weight, K padded to a multiple of 4;
    rows below MIN_WEIGHT_NORM become zeros (their whole norm is their error)."""
    scales = (weight.abs().amax(dim=1) / 127).float()
    scales[norms < MIN_WEIGHT_NORM] = 0
    values = (weight / scales.double().clamp(min=1e-300)[:, None]).round().clamp(-127, 127)
    values[scales == 0] = 0
    residuals = (weight - values * scales.double()[:, None]).norm(dim=1)
    w_errors = (residuals + ROUNDING * norms.clamp(min=MIN_WEIGHT_NORM)) * (1 + ROUNDING)
    return padded_to_quads(values.to(torch.int8), 0), scales, w_errors.float()


def padded_to_quads(values: Tensor, fill: int) -> Tensor:
    """values [R, K] with K padded by fill up to a multiple of 4 (int8_tile.h's quads of k-steps)."""
    pad = -values.shape[1] % 4
    return values.contiguous() if not pad else torch.nn.functional.pad(values, (0, pad), value=fill)


def pack_i8(values: Tensor, panel: int) -> Tensor:
    """[N, K4] -> [N4 / panel, K4 / 4, panel, 4], N padded with zero rows to whole panels."""
    rows = torch.nn.functional.pad(values, (0, 0, 0, -values.shape[0] % panel))
    num_panels, k = rows.shape[0] // panel, rows.shape[1]
    return rows.reshape(num_panels, panel, k // 4, 4).transpose(1, 2).contiguous()


class GreedyHead:
    """head: the LM head's tile kernel (CpuLinear, not on AMX where bf16); its weight [V, K], float32 or bf16
    (then the logits are the tile's float32 sums rounded to bf16, and ties among them go to the first index, as
    torch.argmax). kind: "int8" or (float32 only) "bf16" approximate logits (None: approximation_kind's)."""

    def __init__(self, head: CpuLinear, weight: Tensor, library: ctypes.CDLL | None = None,
                 kind: str | None = None):
        self.library = library if library is not None else cpu_linear.load_library()
        if reason := unsupported_reason(head, weight):
            raise ValueError(reason)
        self.weight, self.max_rows = weight.detach().contiguous(), head.max_rows  # where the full head runs the tile
        self.argmax_fn = getattr(self.library, ARGMAX_ENTRY_POINTS[weight.dtype])
        self.argmax_fn.restype = None
        # float64 norms rounded to float32 (2^-24 relative) stay inside the bounds' margins
        self.w_norms = weight.detach().double().norm(dim=1).clamp(min=MIN_WEIGHT_NORM).float()
        self.kind = kind or approximation_kind(self.library, weight)
        if self.kind not in ("int8", "bf16") or (self.kind == "bf16" and weight.dtype != torch.float32):
            raise ValueError(f"kind must be 'int8' (or 'bf16' for a float32 head), got {kind!r}")
        self.approx = (Int8Logits(self.weight, self.library, self.w_norms) if self.kind == "int8" else
                       Bf16Logits(self.weight, self.library, head.max_rows, self.w_norms))

    def __call__(self, hidden: Tensor) -> Tensor | None:
        """The argmax of hidden's logits, a row each; None where it does not apply (too many rows, a row too
        small or not finite): take the logits."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.dtype != self.weight.dtype or rows.shape[0] > self.max_rows or rows.shape[0] == 0:
            return None
        rows = rows.contiguous()
        norms = rows.double().norm(dim=1)
        if not bool((norms >= MIN_HIDDEN_NORM).all()):  # NaN too; an infinite norm's bound makes the kernel say -1
            return None
        approx, scales, error_scales = self.approx(rows, norms)
        out, shape = torch.empty(rows.shape[0], dtype=torch.int64), Shape(rows.shape[0], *self.weight.shape)
        self.argmax_fn(ptr(rows), ptr(self.weight), ptr(approx), ptr(self.w_norms), ptr(self.approx.w_errors),
                       ptr(scales), ptr(error_scales), ptr(out), shape, num_threads())
        return None if bool((out < 0).any()) else out


def unsupported_reason(head: CpuLinear, weight: Tensor) -> str | None:
    if weight.dtype not in ARGMAX_ENTRY_POINTS or head.weight.dtype != weight.dtype or head.gated:
        return f"the greedy head takes a float32 or bf16 LM head, got {weight.dtype}"
    if head.on_amx:
        return "the greedy head checks its candidates on the vector tiles, and this bf16 head runs on AMX"
    return None


def approximation_kind(library: ctypes.CDLL, weight: Tensor) -> str | None:
    """bf16 on AMX tiles for a float32 head; else int8 where the kernel has int8 dot products (AVX2 and up);
    None elsewhere."""
    if weight.dtype == torch.float32 and cpu_linear.uses_amx(library, weight[:1].bfloat16()):
        return "bf16"
    return "int8" if library.linear_i8_panel() and "avx2" in cpu_flags() else None


def attach_greedy_head(model) -> bool:
    """model.greedy_head, where the LM head runs float32 or bf16 on the tile kernel without a bias, on a CPU whose
    kernel has int8 dot products or (float32) bf16 AMX tiles; False elsewhere, and for bf16 heads on AMX."""
    head = getattr(model, "lm_head", None)
    kernel = getattr(head, "cpu_kernel", None)
    if kernel is None or head.bias is not None or unsupported_reason(kernel, head.weight):
        return False
    library = cpu_linear.load_library()
    if (kind := approximation_kind(library, head.weight)) is None:
        return False
    model.greedy_head = GreedyHead(kernel, head.weight, library, kind)
    return True
