"""Prepacked CPU linears: ``y = x @ W^T + b`` through oneDNN instead of MKL.

MKL's sgemm repacks the weight on every call; oneDNN runs over a weight reordered once, at
load. Few rows go to the C kernel of kernels/cpu/gemm.py. The path is chosen at pack time,
so callers never branch. Exactness, 16-bit weights, memory: docs/cpu-kernels.md.
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

# float32: fewer rows than this run the C kernel on the plain weight, more run oneDNN. The
# crossing depends on vector width and core (AVX-512 on AMD splits each op in two halves).
KERNEL_ROWS = 28
KERNEL_ROWS_AVX512 = 20
KERNEL_ROWS_AVX512_AMD = 10


def default_kernel_rows() -> int:
    if cpu_gemm.lanes() != 16:
        return KERNEL_ROWS
    return KERNEL_ROWS_AVX512_AMD if _cc.cpu_vendor() == "AuthenticAMD" else KERNEL_ROWS_AVX512


# 16-bit weights: the kernel below this many rows. oneDNN on AMX reaches memory speed from
# a few rows up; without AMX its bf16 rate is its float32 one's, so the float32 crossings serve.
KERNEL_ROWS_16_AMX = 6
# No oneDNN 16-bit path: the kernel up to here (x still fits L2), F.linear beyond.
KERNEL_ROWS_16_ALONE = 64


def default_kernel_rows16(dtype: torch.dtype = torch.bfloat16) -> int:
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
    return _probe(torch.float32)


@functools.cache
def onednn_bf16_available() -> bool:
    return _probe(torch.bfloat16)


def onednn_available(dtype: torch.dtype) -> bool:
    """float32 and bfloat16; float16 is left to ``F.linear`` (torch picks oneDNN itself)."""
    if dtype == torch.float32:
        return onednn_fp32_available()
    return dtype == torch.bfloat16 and onednn_bf16_available()


_ONEDNN_PATHS = {torch.float32: "onednn", torch.bfloat16: "onednn-bf16"}


class PackedLinear:
    """``x @ weight^T + bias`` with the weight prepacked once for the fastest CPU path.

    Not an ``nn.Module``: the opaque mkldnn weight defeats ``.to()``, ``state_dict()`` and
    ``deepcopy``. Rows below ``min_rows`` run ``F.linear``, below ``kernel_rows`` the C
    kernel, on the plain weight (0: unused); ``path`` names the large-M route.
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
        self._bias32 = None if b is None or kernel is None or dtype == torch.float32 else b.float()
        hybrid = self._packed is not None and self._plain is not None
        default_min = 0 if kernel is not None else 2
        use_min = hybrid and dtype == torch.float32
        self.min_rows = (default_min if min_rows is None else min_rows) if use_min else 0
        self.kernel_rows = kernel_rows
        self._run: Callable[[Tensor], Tensor] = self._build()

    def _small_kernel(
        self, w: Tensor, b: Tensor | None, rows: int | None
    ) -> tuple[cpu_gemm.Gemm | None, int]:
        """The few-rows C kernel and its crossing, or (None, 0): needs the plain weight."""
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
        """The call, bound once: the only per-call test is the row count."""
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
        """x: [..., in_features] -> [..., out_features] in x's dtype."""
        return self._run(x)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> PackedLinear:
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def bias(self) -> Tensor | None:
        return self._bias

    def to_dense(self) -> Tensor:
        """[out_features, in_features] plain weight (a new copy if only the packed one kept)."""
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
    return PackedLinear(weight, bias, **kwargs)
