"""Prepacked CPU linears: ``y = x @ W^T + b`` through oneDNN instead of MKL.

Why: MKL's sgemm repacks the weight on every call; oneDNN runs over a weight reordered once,
at load, and wins from two rows up. Small M (decode, cold weights) goes to the C kernel of
kernels/cpu/gemm.py below ``default_kernel_rows()``. The path is chosen at pack time
(oneDNN for float32/bfloat16 CPU weights where torch has it, ``F.linear`` otherwise), so
callers never branch::

    qkv = PackedLinear(layer.qkv_proj.weight, layer.qkv_proj.bias)
    y = qkv(x)            # x: [..., in_features], any leading shape, any M (0 and 1 too)

Exactness, 16-bit weights and the memory price of keeping both copies
(``--cpu-linear``): docs/cpu-kernels.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.cpu import _cc
from kernels.cpu import gemm as cpu_gemm

__all__ = [
    "PackedLinear",
    "pack_linear",
    "onednn_available",
    "onednn_fp32_available",
    "onednn_bf16_available",
]

# Fewer rows than this run kernels/cpu/gemm.py on the plain weight (float32, plain weight
# kept); from it on oneDNN is faster. Where the two cross depends on the vector width both
# use and on the core: with AVX-512 on AMD (two halves per op, a 32 KiB L1d) the kernel's
# reuse of each weight chunk over the rows pays less. Measured: docs/benchmarks.md, "Worker".
KERNEL_ROWS = 28
KERNEL_ROWS_AVX512 = 20
KERNEL_ROWS_AVX512_AMD = 10


def default_kernel_rows() -> int:
    """The crossing for the width of the kernel this CPU builds and its vendor (PackedLinear
    uses no kernel at all where none builds)."""
    if cpu_gemm.lanes() != 16:
        return KERNEL_ROWS
    return KERNEL_ROWS_AVX512_AMD if _cc.cpu_vendor() == "AuthenticAMD" else KERNEL_ROWS_AVX512


# 16-bit weights: fewer rows than this run the 16-bit kernel (plain weight kept). oneDNN on
# AMX (Sapphire Rapids and later) reads the weights at memory speed from a few rows up, so
# its crossing is low; without AMX (avx512_bf16 on Zen 4 / Cooper Lake, or bf16 emulated on
# plain AVX-512) oneDNN's bf16 rate is its float32 one's, and the float32 crossings serve
# until measured there. Measure: bench/bench_bf16_cpu.py --crossing.
KERNEL_ROWS_16_AMX = 6
# No oneDNN 16-bit path: the kernel up to here (x rows still fit L2), F.linear beyond.
KERNEL_ROWS_16_ALONE = 64


def default_kernel_rows16(dtype: torch.dtype = torch.bfloat16) -> int:
    """The crossing of the 16-bit kernel for weights of ``dtype`` on this CPU."""
    if not onednn_available(dtype):
        return KERNEL_ROWS_16_ALONE
    if dtype == torch.bfloat16 and "amx_bf16" in _cc.cpu_flags().split():
        return KERNEL_ROWS_16_AMX
    if _cc.cpu_vendor() == "AuthenticAMD":
        return KERNEL_ROWS_AVX512_AMD
    return KERNEL_ROWS_AVX512


def _probe(dtype: torch.dtype) -> bool:
    """One tiny packed linear in `dtype`, checked against the exact answer."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        y = torch.ops.mkldnn._linear_pointwise.default(
            torch.ones(2, 8, dtype=dtype), packed, torch.ones(4, dtype=dtype), "none", [], ""
        )
        return bool(torch.equal(y.float(), torch.full((2, 4), 9.0)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def onednn_fp32_available() -> bool:
    """This torch build has oneDNN's packed float32 linear (and it runs here)."""
    return _probe(torch.float32)


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN can pack bfloat16 weights here (the CPU has avx512bw/vl/dq or avx_ne_convert)."""
    return _probe(torch.bfloat16)


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear serves ``dtype`` here: float32 and bfloat16. float16 is left
    to ``F.linear`` (torch picks oneDNN itself where the CPU has float16 arithmetic)."""
    if dtype == torch.float32:
        return onednn_fp32_available()
    return dtype == torch.bfloat16 and onednn_bf16_available()


_ONEDNN_PATHS = {torch.float32: "onednn", torch.bfloat16: "onednn-bf16"}


class PackedLinear:
    """``x @ weight^T + bias`` with the weight prepacked once for the fastest CPU path.

    Not an ``nn.Module`` on purpose: the packed weight is an opaque mkldnn tensor that
    ``.to()``, ``state_dict()`` and ``deepcopy`` cannot handle; the module that owns the
    parameters keeps a PackedLinear as a plain attribute.

    Attributes: ``path`` ("onednn", "onednn-bf16", "linear" or "linear-bf16"),
    ``in_features``, ``out_features``, ``dtype`` (the dtype the product runs in),
    ``min_rows`` (rows below it run ``F.linear`` on the plain weight; 0 when there is none),
    ``kernel_rows`` (rows below it, and from ``min_rows`` up, run the C kernel
    kernels/cpu/gemm.py on the plain weight; 0 when it is not used).
    """

    path: str
    in_features: int
    out_features: int
    dtype: torch.dtype
    min_rows: int
    kernel_rows: int

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        bf16: bool = False,
        keep_plain: bool = True,
        min_rows: int | None = None,
        kernel_rows: int | None = None,
    ):
        if weight.dim() != 2:
            raise ValueError(
                f"weight must be [out_features, in_features], got {tuple(weight.shape)}"
            )
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        self.out_features, self.in_features = weight.shape
        dtype = torch.bfloat16 if bf16 else weight.dtype
        self.dtype = dtype
        with torch.no_grad():
            # The original object itself when no cast is needed (to_dense() returns it).
            w = weight if weight.dtype == dtype else weight.detach().to(dtype)
            b = None if bias is None else bias.detach().to(dtype).contiguous()
            cpu = w.device.type == "cpu" and torch.backends.mkldnn.enabled
            if cpu and onednn_available(dtype):
                self.path = _ONEDNN_PATHS[dtype]
            else:
                self.path = "linear-bf16" if (bf16 and weight.dtype != torch.bfloat16) else "linear"
            self._packed: Tensor | None = None
            self._plain: Tensor | None = w  # the original itself unless a dtype cast made a copy
            if self.path.startswith("onednn"):
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
                if not keep_plain:
                    self._plain = None
            self._bias = b
        kernel, kernel_rows = self._small_kernel(w, b, kernel_rows)
        self._kernel = kernel
        # The 16-bit kernel adds a float32 bias (exact: it is b widened).
        self._bias32 = None if b is None or kernel is None or dtype == torch.float32 else b.float()
        hybrid = self._packed is not None and self._plain is not None
        # Single rows (float32): the C kernel where it runs (faster than F.linear), else F.linear.
        default_min = 0 if kernel is not None else 2
        use_min = hybrid and dtype == torch.float32
        self.min_rows = (default_min if min_rows is None else min_rows) if use_min else 0
        self.kernel_rows = kernel_rows
        self._run: Callable[[Tensor], Tensor] = self._build()

    def _small_kernel(
        self, w: Tensor, b: Tensor | None, rows: int | None
    ) -> tuple[cpu_gemm.Gemm | None, int]:
        """The C kernel for few rows and its crossing, (None, 0) where it does not serve:
        float32 beside oneDNN (both weights kept), 16-bit wherever the plain weight is kept."""
        if self._plain is None or w.device.type != "cpu":
            return None, 0
        if self.dtype == torch.float32:
            kernel = cpu_gemm.load() if self.path == "onednn" and cpu_gemm.supports(w, b) else None
            default = default_kernel_rows()
        else:
            kernel = cpu_gemm.load16() if cpu_gemm.supports16(w) else None
            default = default_kernel_rows16(self.dtype)
        rows = default if rows is None else rows
        return (kernel, rows) if kernel is not None and rows > 0 else (None, 0)

    def _build(self) -> Callable[[Tensor], Tensor]:
        """The call, bound once: the only per-call test is the row count (hybrid path)."""
        if self.dtype in (torch.bfloat16, torch.float16):
            return self._build16()
        plain, packed, b = self._plain, self._packed, self._bias
        if packed is None:
            assert plain is not None  # the fallback paths always keep the plain weight
            return lambda x: F.linear(x, plain, b)
        op = torch.ops.mkldnn._linear_pointwise.default
        if (self.min_rows <= 0 and self.kernel_rows <= 0) or plain is None:
            return lambda x: op(x, packed, b, "none", [], "")
        small = self.min_rows * self.in_features  # fewer rows <=> fewer elements
        kernel = self._kernel or F.linear  # F.linear is never reached: kernel_rows is 0 then
        few = self.kernel_rows * self.in_features

        def run(x: Tensor) -> Tensor:
            n = x.numel()
            if n < small:
                return F.linear(x, plain, b)
            if n < few:
                return kernel(x, plain, b)
            return op(x, packed, b, "none", [], "")

        return run

    def _build16(self) -> Callable[[Tensor], Tensor]:
        """16-bit weights: the kernel below kernel_rows, oneDNN (or F.linear) from there,
        the result in x's dtype."""
        plain, packed, b, dtype = self._plain, self._packed, self._bias, self.dtype
        if packed is not None:
            op = torch.ops.mkldnn._linear_pointwise.default
            large: Callable[[Tensor], Tensor] = lambda x: op(  # noqa: E731
                x.to(dtype), packed, b, "none", [], ""
            ).to(x.dtype)
        else:
            assert plain is not None  # the fallback paths always keep the plain weight
            large = lambda x: F.linear(x.to(dtype), plain, b).to(x.dtype)  # noqa: E731
        kernel, b32 = self._kernel, self._bias32
        if kernel is None:
            return large
        few = self.kernel_rows * self.in_features

        def run(x: Tensor) -> Tensor:
            return kernel(x, plain, b32) if x.numel() < few else large(x)

        return run

    def __call__(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype. Any leading shape;
        a non-contiguous x is copied to contiguous (as F.linear does)."""
        return self._run(x)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> PackedLinear:
        """Packs an ``nn.Linear`` (or FusedLinear):
        ``PackedLinear(linear.weight, linear.bias, ...)``."""
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def bias(self) -> Tensor | None:
        return self._bias

    def to_dense(self) -> Tensor:
        """The weight as a plain [out_features, in_features] tensor (a new copy when only
        the packed one is kept)."""
        if self._plain is not None:
            return self._plain
        assert self._packed is not None
        return self._packed.to_dense()

    def __repr__(self) -> str:
        return (
            f"PackedLinear(in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self._bias is not None}, path={self.path!r}, dtype={self.dtype}, "
            f"min_rows={self.min_rows}, kernel_rows={self.kernel_rows})"
        )


def pack_linear(weight: Tensor, bias: Tensor | None = None, **kwargs) -> PackedLinear:
    """``PackedLinear(weight, bias, **kwargs)``: a callable x -> x @ weight^T + bias."""
    return PackedLinear(weight, bias, **kwargs)
