"""Prepacked CPU linears: ``y = x @ W^T + b`` through oneDNN instead of MKL.

Why: ``F.linear`` on a float32 CPU tensor runs MKL's sgemm, which copies the weight into
its internal panel layout on every call. oneDNN (``torch.ops.mkldnn._linear_pointwise``,
the op inductor's CPU freezing emits for dynamic shapes) runs its brgemm kernels (avx2 /
avx512 / amx, picked at runtime) over a weight reordered *once*, at load, into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``). That wins from two rows up and is
level with MKL at large M (long prefills). A single row is a matrix-vector product, a poor
fit for the blocked layout: it stays on ``F.linear`` unless the small-M kernel serves.

Small M with the weights cold (a decode step streams the whole model's weights from memory
every step): kernels/cpu_gemm.py streams each row of the plain [N, K] weight once for all
rows and beats oneDNN below a crossing that depends on the CPU's vector width and vendor
(``default_kernel_rows()``). Figures and commands: docs/benchmarks.md ("Worker") and
docs/benchmarks-history.md.

Exactness: oneDNN computes in float32 with another summation order (<= 1.4e-6 relative to
``F.linear``), the C kernel in a fixed order (<= 5.7e-7 against float64): both well inside
the 1e-5 that greedy parity with transformers needs (tests/unit/test_model_parity.py).
radixserve never lowers ``torch.backends.mkldnn.matmul.fp32_precision``.

Use: pack once, after the weights are loaded, call in forward::

    qkv = PackedLinear(layer.qkv_proj.weight, layer.qkv_proj.bias)
    y = qkv(x)            # x: [..., in_features], any leading shape, any M (0 and 1 too)

The path is chosen once, at pack time: oneDNN when the weight is a float32 CPU tensor and
torch has a working oneDNN (``torch.backends.mkldnn.enabled``), otherwise plain
``F.linear`` over the original tensors (CUDA, float16/float64, builds without oneDNN), so
callers never branch. The only per-call choice is by size, and only while the original
(plain) weight is kept: fewer than ``min_rows`` rows go to ``F.linear`` on it, then fewer
than ``kernel_rows`` (default ``default_kernel_rows()``; float32 and oneDNN, where the C
kernel builds) to kernels/cpu_gemm.py on it, the rest to oneDNN. ``min_rows`` defaults to
0 when the kernel serves (it beats ``F.linear`` at one row too), else to 2.

``bf16=True`` stores the weight in bfloat16 and runs in bfloat16 (activations cast in, the
result cast back): oneDNN's bf16 kernels where the CPU has them (avx512_bf16 / amx /
avx_ne_convert: ``onednn_bf16_available()``), else ``F.linear`` in bf16, which on an
AVX2-only CPU is several times *slower* than float32: leave it off there.

Memory: the packed weight is a second copy (the blocked layout pads N to 64 and K to 16).
By default (``keep_plain=True``) the original tensor stays referenced (not copied) for the
small-M paths, so float32 linear weights take twice their size. ``keep_plain=False``
keeps only the packed copy (``to_dense()`` rebuilds the original) at the price of every M
on oneDNN. The worker's ``--cpu-linear packed`` is that; ``hybrid`` keeps both and so gets
the kernel; the default ``auto`` is ``hybrid`` while the linears' weights take at most
2 GiB. Pack after ``load_weights``: the packed copy does not follow later in-place changes
of the original. Inference only: the oneDNN op has no backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import _cc, cpu_gemm

__all__ = ["PackedLinear", "pack_linear", "onednn_fp32_available", "onednn_bf16_available"]

# Fewer rows than this run kernels/cpu_gemm.py on the plain weight (float32, plain weight
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


class PackedLinear:
    """``x @ weight^T + bias`` with the weight prepacked once for the fastest CPU path.

    Not an ``nn.Module`` on purpose: the packed weight is an opaque mkldnn tensor that
    ``.to()``, ``state_dict()`` and ``deepcopy`` cannot handle; the module that owns the
    parameters keeps a PackedLinear as a plain attribute.

    Attributes: ``path`` ("onednn", "onednn-bf16", "linear" or "linear-bf16"),
    ``in_features``, ``out_features``, ``dtype`` (the dtype the product runs in),
    ``min_rows`` (rows below it run ``F.linear`` on the plain weight; 0 when there is none),
    ``kernel_rows`` (rows below it, and from ``min_rows`` up, run the C kernel
    kernels/cpu_gemm.py on the plain weight; 0 when it is not used).
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
            if cpu and dtype == torch.float32 and onednn_fp32_available():
                self.path = "onednn"
            elif cpu and dtype == torch.bfloat16 and onednn_bf16_available():
                self.path = "onednn-bf16"
            else:
                self.path = "linear-bf16" if (bf16 and weight.dtype != torch.bfloat16) else "linear"
            self._packed: Tensor | None = None
            self._plain: Tensor | None = w  # the original itself unless a dtype cast made a copy
            if self.path.startswith("onednn"):
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
                # Single rows on the plain weight only where measured (float32); bf16 packs alone.
                if not keep_plain or self.path == "onednn-bf16":
                    self._plain = None
            self._bias = b
        hybrid = self._packed is not None and self._plain is not None
        kernel = cpu_gemm.load() if hybrid and self.path == "onednn" else None
        if kernel_rows is None:
            kernel_rows = default_kernel_rows()
        if kernel is None or kernel_rows <= 0 or not cpu_gemm.supports(w, b):
            kernel, kernel_rows = None, 0
        self._kernel = kernel
        # Single rows: the C kernel where it runs (faster than F.linear), else F.linear.
        default_min = 0 if kernel is not None else 2
        self.min_rows = (default_min if min_rows is None else min_rows) if hybrid else 0
        self.kernel_rows = kernel_rows
        self._run: Callable[[Tensor], Tensor] = self._build()

    def _build(self) -> Callable[[Tensor], Tensor]:
        """The call, bound once: the only per-call test is the row count (hybrid path)."""
        plain, packed, b, dtype = self._plain, self._packed, self._bias, self.dtype
        if packed is None:
            assert plain is not None  # the fallback paths always keep the plain weight
            if self.path == "linear-bf16":
                return lambda x: F.linear(x.to(dtype), plain, b).to(x.dtype)
            return lambda x: F.linear(x, plain, b)
        op = torch.ops.mkldnn._linear_pointwise.default
        if dtype != torch.float32:
            return lambda x: op(x.to(dtype), packed, b, "none", [], "").to(x.dtype)
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
