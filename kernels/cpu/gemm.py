"""Small-M GEMM on CPU: ``y = x @ W^T (+ b)`` over the plain [N, K] weight, a C kernel.

For a decode step's M = 1..64 rows over cold weights, where oneDNN reads far below memory
bandwidth: each weight row streams once for all rows, in a fixed order (rows are
batch-invariant). ``load16``: bfloat16/float16 weights. Design: docs/cpu-kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import _cc

log = logging.getLogger(__name__)

_SOURCE = _cc.read_source("gemm.c")
_SOURCE16 = _cc.read_source("gemm16.c")

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

Gemm = Callable[..., torch.Tensor]


def _library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    flags = [*_cc.FLAGS, *extra_flags]
    return _cc.load_library("gemm", _SOURCE, "CPU small-M GEMM", log, flags)


@functools.cache
def lanes(extra_flags: tuple[str, ...] = ()) -> int:
    """Float lanes of the built kernel: 16 (AVX-512), 8 (AVX2/FMA), 0 (portable C or none)."""
    lib = _library(extra_flags)
    if lib is None:
        return 0
    lib.rs_gemm_lanes.restype = _I32
    return int(lib.rs_gemm_lanes())


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """``fn(x, weight, bias=None) -> y``, or None where it cannot be built; ``extra_flags``
    follow ``-march=native`` (tests build the AVX2 variant with ``-mno-avx512f``)."""
    lib = _library(extra_flags)
    if lib is None:
        return None
    fn = lib.rs_gemm_f32
    fn.restype = _I32
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I32]
    return functools.partial(_call, fn)


def _library16(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    flags = [*_cc.FLAGS, *extra_flags]
    return _cc.load_library("gemm16", _SOURCE16, "CPU small-M 16-bit GEMM", log, flags)


# What isa16() returns: the vocabulary that serves bfloat16 weights.
ISA16_NAMES = {3: "avx512_bf16", 2: "avx512", 1: "avx2", 0: "c", -1: "none"}


@functools.cache
def isa16(extra_flags: tuple[str, ...] = ()) -> int:
    """How the 16-bit kernel runs bfloat16 weights: a key of ISA16_NAMES (-1: no kernel)."""
    lib = _library16(extra_flags)
    if lib is None:
        return -1
    lib.rs_gemm16_isa.restype = _I32
    return int(lib.rs_gemm16_isa())


@functools.cache
def load16(extra_flags: tuple[str, ...] = ()) -> Gemm | None:
    """``fn(x, weight, bias=None) -> y`` for bfloat16/float16 [N, K] weights, float32 bias, y
    in x's dtype; None where it cannot be built. ``extra_flags`` as for ``load``."""
    lib = _library16(extra_flags)
    if lib is None or not vector16(torch.bfloat16, extra_flags):
        return None  # portable C only: slower than torch's own bf16 paths
    return bind16(lib)


def bind16(lib: ctypes.CDLL) -> Gemm:
    """``fn(x, weight, bias=None)`` over a built gemm16 library (also the portable build)."""
    fn = lib.rs_gemm16
    fn.restype = _I32
    fn.argtypes = [_PTR, _I32, _I64, _PTR, _I32, _I64, _PTR, _PTR, _I32, _I64, _I64, _I64, _I32]
    return functools.partial(_call16, fn)


@functools.cache
def vector16(dtype: torch.dtype, extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether the 16-bit kernel has a vector path for ``dtype`` weights (float16 needs F16C)."""
    lib = _library16(extra_flags) if dtype in (torch.bfloat16, torch.float16) else None
    if lib is None:
        return False
    lib.rs_gemm16_vector.restype, lib.rs_gemm16_vector.argtypes = _I32, [_I32]
    return bool(lib.rs_gemm16_vector(_cc.DTYPE_CODES[dtype]))


def supports16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """A bf16/fp16 CPU weight [N, K], K contiguous, with a vector path; float32 bias or none."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.dim() == 2
        and weight.stride(1) == 1
        and vector16(weight.dtype)
        and (
            bias is None
            or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.is_contiguous())
        )
    )


def _call16(
    fn,
    x: torch.Tensor,  # [..., K] float32, bfloat16 or float16
    weight: torch.Tensor,  # [N, K] bfloat16 / float16, K contiguous (supports16())
    bias: torch.Tensor | None = None,  # [N] float32 contiguous
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = weight.shape
    code = _cc.DTYPE_CODES.get(x.dtype)
    if code is None or x.shape[-1] != k:
        raise ValueError(f"x must be float32/bfloat16/float16 [..., {k}], got {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    x2 = x.reshape(x.numel() // k if k else x.shape[:-1].numel(), k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if m == 0:
        return y
    failed = fn(
        x2.data_ptr(), code, x2.stride(0), weight.data_ptr(), _cc.DTYPE_CODES[weight.dtype],
        weight.stride(0), None if bias is None else bias.data_ptr(), y.data_ptr(), code,
        m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"cpu gemm16: failed ({failed}: 1 out of memory, 2 weight dtype)")
    return y


def gemm16_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What load16's kernel computes, exactly (float64): x rounded to the weight's dtype."""
    b = None if bias is None else bias.double()
    return F.linear(x.to(weight.dtype).double(), weight.double(), b)


def supports(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """A float32 CPU weight [N, K] with K contiguous (and a float32 contiguous bias)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.stride(1) == 1
        and (
            bias is None
            or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.is_contiguous())
        )
    )


def _call(
    fn,
    x: torch.Tensor,  # [..., K] float32
    weight: torch.Tensor,  # [N, K] float32, K contiguous (supports())
    bias: torch.Tensor | None = None,  # [N] float32 contiguous
) -> torch.Tensor:  # [..., N] float32
    n, k = weight.shape
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"x must be float32 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    # A view where it can be (any row stride is fine, K must be dense); -1 fails for K = 0.
    x2 = x.reshape(x.numel() // k if k else x.shape[:-1].numel(), k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    if m == 0:
        return y
    failed = fn(
        x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu gemm: out of memory for the partial sums")
    return y


def gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact answer, in float64: the tests' reference."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b)
