"""Fused element-wise ops of a CPU forward: rotary, SiLU-gated product, RMSNorm.

Each replaces a chain of torch passes over the same rows with one pass (``rms_norm``
optionally adding the residual first); ``load()`` is None where it cannot be built, and
services/worker/layers.py keeps torch. Numerics per op and dtype: docs/cpu-kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import _cc

log = logging.getLogger(__name__)

# Element count from which a pass is split over the threads (torch's own grain size).
PARALLEL_MIN = 32768

_SOURCE = _cc.read_source("elementwise.c", PARALLEL_MIN=PARALLEL_MIN)

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Elementwise(NamedTuple):
    """The fused passes (float32, bfloat16 and float16 CPU tensors; see ``supports``)."""

    rotary: Callable[..., torch.Tensor]  # (x [T, H, D], cos, sin [T, D/2]) -> [T, H, D]
    # (gate_up [..., 2I], I) -> [..., I]; None where the CPU lacks AVX2/FMA (slower there)
    silu_mul: Callable[..., torch.Tensor] | None
    # (x [..., N], weight [N], eps, residual=None) -> (x + residual or x, its RMSNorm)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> Elementwise | None:
    """The kernels, or None where they cannot be built; ``extra_flags`` follow -march=native."""
    # -ffp-contract=off: the rotary's x1*c - x2*s must round twice as torch's does.
    flags = [*_cc.FLAGS, "-ffp-contract=off", *extra_flags]
    lib = _cc.load_library("elementwise", _SOURCE, "CPU fused element-wise", log, flags)
    if lib is None:
        return None
    rot, rot16 = lib.rs_rotary_f32, lib.rs_rotary16
    rot.restype = rot16.restype = None
    rot.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32]
    rot16.argtypes = [_I32, *rot.argtypes]
    silu_mul = None
    if hasattr(lib, "rs_silu_mul_f32"):  # built with AVX2/FMA only
        sm, sm16 = lib.rs_silu_mul_f32, lib.rs_silu_mul16
        sm.restype = sm16.restype = None
        sm.argtypes = [_PTR, _PTR, _I64, _I64, _I32]
        sm16.argtypes = [_I32, *sm.argtypes]
        silu_mul = functools.partial(_silu_mul, sm, fn16=sm16)
    norm, norm16 = lib.rs_rms_norm_f32, lib.rs_rms_norm16
    norm.restype = norm16.restype = None
    norm.argtypes = [_PTR, _PTR, _PTR, ctypes.c_float, _PTR, _PTR, _I64, _I64, _I32]
    norm16.argtypes = [_I32, *norm.argtypes]
    return Elementwise(
        functools.partial(_rotary, rot, fn16=rot16),
        silu_mul,
        functools.partial(_rms, norm, fn16=norm16),
    )


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _cc.DTYPE_CODES


def _bound(fn32, fn16, dtype: torch.dtype):
    """The float32 function, or the 16-bit one with the dtype's code bound first."""
    if dtype == torch.float32:
        return fn32
    if fn16 is None:
        raise ValueError(f"no 16-bit function bound for {dtype}")
    return functools.partial(fn16, _cc.DTYPE_CODES[dtype])


def _rotary(
    fn32,
    x: torch.Tensor,  # [T, H, D] float32/bfloat16/float16, D even; rows / heads may be strided
    cos: torch.Tensor,  # [T, D/2], cast to x's dtype (the torch expression's operands)
    sin: torch.Tensor,  # [T, D/2]
    fn16=None,  # rs_rotary16, for 16-bit x
) -> torch.Tensor:  # [T, H, D] contiguous, x's dtype
    t, h, d = x.shape
    if not supports(x) or d % 2 or cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary: x {x.dtype} {tuple(x.shape)}, cos/sin {tuple(cos.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype)
    if out.numel():
        _bound(fn32, fn16, x.dtype)(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
            out.data_ptr(), t, h, d, torch.get_num_threads(),
        )  # fmt: skip
    return out


def _silu_mul(
    fn32,
    gate_up: torch.Tensor,  # [..., 2I]: gate then up, as the fused projection writes
    inter: int,
    fn16=None,  # rs_silu_mul16, for 16-bit gate_up
) -> torch.Tensor:  # [..., I], gate_up's dtype
    if not supports(gate_up) or gate_up.dim() == 0 or gate_up.shape[-1] != 2 * inter:
        raise ValueError(f"silu_mul: gate_up must be float32/bfloat16/float16 [..., "
                         f"{2 * inter}], got {gate_up.dtype} {tuple(gate_up.shape)}")  # fmt: skip
    gu = gate_up.contiguous()
    out = torch.empty((*gu.shape[:-1], inter), dtype=gu.dtype)
    if out.numel():
        fn = _bound(fn32, fn16, gu.dtype)
        fn(gu.data_ptr(), out.data_ptr(), out.numel() // inter, inter, torch.get_num_threads())
    return out


def _rms(
    fn32,
    x: torch.Tensor,  # [..., N] float32/bfloat16/float16
    weight: torch.Tensor,  # [N], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape: added first (the residual stream)
    fn16=None,  # rs_rms_norm16, for 16-bit x
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + residual, or x itself; RMSNorm of it)
    n = x.shape[-1]
    if not supports(x) or weight.dtype != x.dtype or weight.shape != (n,):
        raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
    xc, w = x.contiguous(), weight.contiguous()
    rc = None if residual is None else residual.contiguous()
    total = xc if rc is None else torch.empty_like(xc)
    out = torch.empty_like(xc)
    if out.numel():
        rows = out.numel() // n
        _bound(fn32, fn16, x.dtype)(
            xc.data_ptr(), None if rc is None else rc.data_ptr(), w.data_ptr(), eps,
            total.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads(),
        )  # fmt: skip
    return total, out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops the kernel replaces (services/worker/layers.py's RMSNorm): in a 16-bit
    dtype, float32 statistics and the weight applied in that dtype (as transformers)."""
    total = x if residual is None else x + residual
    if x.dtype == torch.float32:
        return total, F.rms_norm(total, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(total.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return total, weight * normed


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch expression the kernel replaces (services/worker/layers.py's)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_mul_ref(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up
