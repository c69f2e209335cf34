"""Fused element-wise ops of a CPU float32 forward: rotary, SiLU-gated product, RMSNorm.

Why: in a cold float32 prefill on CPU about an eighth of the time went to element-wise
torch ops around the linears, chains of passes over the same rows: the rotary embedding
(``cat(x1*c - x2*s, x2*c + x1*s)``: six passes, each writing a temporary), the gated MLP's
``silu(gate) * up`` (a strided read of ``gate`` out of the fused gate/up output, a
temporary, a second pass) and ``F.rms_norm`` (square, mean, add, rsqrt, two products, each
a pass and a parallel region). Each becomes one pass here that reads its inputs once and
writes the result once; ``rms_norm`` optionally adds the residual first (``x + h`` then its
norm, as a decoder layer's post-attention norm does). Figures: docs/benchmarks.md
("Worker") and docs/benchmarks-history.md.

Numerics:
- ``rotary``: the same float operations as the torch expression, each rounded (the library
  is built with ``-ffp-contract=off``: a fused multiply-add would round ``x1*c - x2*s``
  once instead of twice), so the result is bit-identical to torch's.
- ``silu_mul``: ``g / (1 + exp(-g)) * u`` as torch's CPU silu computes it, with an 8-lane
  AVX2 exp (Cephes' degree-6 polynomial after a two-constant ln 2 reduction, ~1 ulp, as
  torch's SLEEF exp): max relative error against float64 2.0e-7 over |g| < 80 (torch's
  1.7e-7).
  exp(-g) overflows to inf for g < -88.03 (the result is -0, as torch's from -88.72), and
  underflows to 2^-126 for g > 87.3 (the result is g * u). Without AVX2/FMA there is no
  ``silu_mul`` (libm's scalar ``expf`` would make it slower than torch's vectorized
  silu + mul); the rotary is plain C either way.
- ``rms_norm``: the residual sum is the same float add as torch's (a bit-identical residual
  stream); the sum of squares runs in 16 partial sums in a fixed order, so the norm differs
  from ``F.rms_norm`` by float32 rounding (<= 2e-6 in the tests).

Built by kernels/_cc.py (system ``cc`` on first use, cached by source + flags + CPU flags);
OpenMP over rows with ``torch.get_num_threads()`` threads, one thread below
``PARALLEL_MIN`` elements (a parallel region costs more than such a pass).
``RADIXSERVE_CPU_KERNELS=0``, no compiler or a failed build: ``load()`` returns None and
the callers (services/worker/layers.py) keep the torch expressions.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import _cc

log = logging.getLogger(__name__)

# Element count from which a pass is split over the threads (torch's own grain size).
PARALLEL_MIN = 32768

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN @PARALLEL_MIN@

/* out[t, h, :] = cat(x1*c - x2*s, x2*c + x1*s) with x1/x2 the halves of x[t, h, :] and
   c/s = cos[t, :], sin[t, :]. x rows and heads strided (a view of the fused qkv output),
   the head dim contiguous; out, cos, sin contiguous. Built with -ffp-contract=off: every
   product and sum rounds on its own, as in torch. */
void rs_rotary_f32(const float* x, int64_t sx_t, int64_t sx_h, const float* cs,
                   const float* sn, float* out, int64_t T, int64_t H, int64_t D, int nth) {
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * H * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const float* restrict c = cs + t * half;
        const float* restrict s = sn + t * half;
        for (int64_t h = 0; h < H; ++h) {
            const float* restrict x1 = x + t * sx_t + h * sx_h;
            const float* restrict x2 = x1 + half;
            float* restrict o1 = out + (t * H + h) * D;
            float* restrict o2 = o1 + half;
            for (int64_t i = 0; i < half; ++i) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}

/* RMSNorm of rows of N floats, optionally after the residual add: s = x (+ res), written
   to sum when res is given; out = s * (1 / sqrt(mean(s^2) + eps)) * w. The sum of squares
   in 16 partial sums (vectorizes without reassociating: a fixed order), then a fixed tree.
   x, res, sum, out contiguous [T, N]. */
void rs_rms_norm_f32(const float* x, const float* res, const float* w, float eps, float* sum,
                     float* out, int64_t T, int64_t N, int nth) {
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * N >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const float* restrict xr = x + t * N;
        const float* s = xr;
        if (res != 0) {
            const float* restrict rr = res + t * N;
            float* restrict sr = sum + t * N;
            for (int64_t i = 0; i < N; ++i) sr[i] = xr[i] + rr[i];
            s = sr;
        }
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= N; i += 16)
            for (int l = 0; l < 16; ++l) acc[l] += s[i + l] * s[i + l];
        for (int l = 0; i < N; ++i, ++l) acc[l] += s[i] * s[i];
        for (int h = 8; h > 0; h /= 2)
            for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
        const float inv = 1.0f / sqrtf(acc[0] / (float)N + eps);
        float* restrict o = out + t * N;
        for (int64_t j = 0; j < N; ++j) o[j] = s[j] * inv * w[j];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static const int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* exp of 8 lanes: n = round(x log2 e), r = x - n ln2 (ln2 in two parts), Cephes' expf
   polynomial, times 2^n built in the exponent bits. ~1 ulp. Inf from ~88.03 (expf: from
   88.72; in silu, g / (1 + e) is then -0 instead of ~-1e-37); below -87.34 it stays at
   2^-126 (1 + that is 1: silu needs no more). A NaN lane gives a finite value, but silu's
   g / (1 + e) is NaN then anyway. */
@EXP8_CORE@
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    const __m256 y = exp8_core(_mm256_max_ps(_mm256_min_ps(x, hi), lo));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static inline void silu_mul_row(const float* g, const float* u, float* o, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) { /* the same lanes, masked: the tail rounds exactly as the body */
        const __m256i m = _mm256_loadu_si256((const __m256i*)(tail_mask + 8 - (I - i)));
        _mm256_maskstore_ps(
            o + i, m, silu_mul8(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
    }
}

/* out[t, :] = silu(gu[t, :I]) * gu[t, I:2I]; gu and out contiguous. */
void rs_silu_mul_f32(const float* gu, float* out, int64_t T, int64_t I, int nth) {
    #pragma omp parallel for schedule(static) num_threads(nth) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; ++t)
        silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
}
#endif /* without AVX2/FMA no rs_silu_mul_f32: libm's scalar expf made it 2-3x slower than
          torch's vectorized silu + mul; the caller keeps those */
"""
_SOURCE = _SOURCE.replace("@EXP8_CORE@", _cc.AVX2_EXP8_CORE).replace(
    "@PARALLEL_MIN@", str(PARALLEL_MIN)
)

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Elementwise(NamedTuple):
    """The fused passes (float32 CPU tensors only; see ``supports``)."""

    rotary: Callable[..., torch.Tensor]  # (x [T, H, D], cos, sin [T, D/2]) -> [T, H, D]
    # (gate_up [..., 2I], I) -> [..., I]; None where the CPU lacks AVX2/FMA (slower there)
    silu_mul: Callable[..., torch.Tensor] | None
    # (x [..., N], weight [N], eps, residual=None) -> (x + residual or x, its RMSNorm)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def load() -> Elementwise | None:
    """The kernels, or None where they cannot be built here (callers keep torch's path)."""
    # -ffp-contract=off: the rotary's x1*c - x2*s must round twice as torch's does.
    flags = [*_cc.FLAGS, "-ffp-contract=off"]
    lib = _cc.load_library("elementwise", _SOURCE, "CPU fused element-wise", log, flags)
    if lib is None:
        return None
    rot = lib.rs_rotary_f32
    rot.restype = None
    rot.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32]
    silu_mul = None
    if hasattr(lib, "rs_silu_mul_f32"):  # built with AVX2/FMA only
        sm = lib.rs_silu_mul_f32
        sm.restype = None
        sm.argtypes = [_PTR, _PTR, _I64, _I64, _I32]
        silu_mul = functools.partial(_silu_mul, sm)
    norm = lib.rs_rms_norm_f32
    norm.restype = None
    norm.argtypes = [_PTR, _PTR, _PTR, ctypes.c_float, _PTR, _PTR, _I64, _I64, _I32]
    return Elementwise(functools.partial(_rotary, rot), silu_mul, functools.partial(_rms, norm))


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def _rotary(
    fn,
    x: torch.Tensor,  # [T, H, D] float32, D even; rows / heads may be strided
    cos: torch.Tensor,  # [T, D/2] float32
    sin: torch.Tensor,  # [T, D/2] float32
) -> torch.Tensor:  # [T, H, D] contiguous
    t, h, d = x.shape
    if x.dtype != torch.float32 or d % 2 or cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary: x {x.dtype} {tuple(x.shape)}, cos/sin {tuple(cos.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((t, h, d), dtype=torch.float32)
    if out.numel():
        fn(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
           out.data_ptr(), t, h, d, torch.get_num_threads())  # fmt: skip
    return out


def _silu_mul(
    fn,
    gate_up: torch.Tensor,  # [..., 2I] float32: gate then up, as the fused projection writes
    inter: int,
) -> torch.Tensor:  # [..., I]
    if gate_up.dtype != torch.float32 or gate_up.dim() == 0 or gate_up.shape[-1] != 2 * inter:
        raise ValueError(f"silu_mul: gate_up must be float32 [..., {2 * inter}], "
                         f"got {gate_up.dtype} {tuple(gate_up.shape)}")  # fmt: skip
    gu = gate_up.contiguous()
    out = torch.empty((*gu.shape[:-1], inter), dtype=torch.float32)
    if out.numel():
        fn(gu.data_ptr(), out.data_ptr(), out.numel() // inter, inter, torch.get_num_threads())
    return out


def _rms(
    fn,
    x: torch.Tensor,  # [..., N] float32
    weight: torch.Tensor,  # [N] float32
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape: added first (the residual stream)
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + residual, or x itself; RMSNorm of it)
    n = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (n,):
        raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
    xc, w = x.contiguous(), weight.contiguous()
    rc = None if residual is None else residual.contiguous()
    total = xc if rc is None else torch.empty_like(xc)
    out = torch.empty_like(xc)
    if out.numel():
        rows = out.numel() // n
        fn(xc.data_ptr(), None if rc is None else rc.data_ptr(), w.data_ptr(), eps,
           total.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())  # fmt: skip
    return total, out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops the kernel replaces (services/worker/layers.py's RMSNorm)."""
    total = x if residual is None else x + residual
    return total, F.rms_norm(total, (x.shape[-1],), weight, eps)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch expression the kernel replaces (services/worker/layers.py's)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_mul_ref(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up
