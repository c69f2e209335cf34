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

The C source is kernels/cpu/elementwise.c, built by kernels/_cc.py (system ``cc`` on first
use, cached by source + flags + CPU flags); OpenMP over rows with
``torch.get_num_threads()`` threads, one thread below ``PARALLEL_MIN`` elements (a parallel
region costs more than such a pass). ``RADIXSERVE_CPU_KERNELS=0``, no compiler or a failed
build: ``load()`` returns None and the callers (services/worker/layers.py) keep the torch
expressions.
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

_SOURCE = _cc.read_source("elementwise.c", PARALLEL_MIN=PARALLEL_MIN)

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
