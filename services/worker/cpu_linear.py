"""Prepacked CPU linears: ``y = x @ W^T + b`` through oneDNN instead of MKL (issue 18).

Why: ``F.linear`` on a float32 CPU tensor runs MKL's sgemm, which copies the weight into
its internal panel layout on every call (issue 18 also blames MKL's path on AMD). oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the op inductor's CPU freezing emits for dynamic
shapes) runs its brgemm kernels (avx2 / avx512 / amx, picked at runtime) over a weight
reordered *once*, at load, into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``;
``AB16b64a`` on AVX2). bench/bench_linear.py, Qwen2-0.5B's four decoder-layer linears
together (qkv 1152x896 + bias, o 896x896, gate_up 9728x896, down 896x4864), ratio of
``F.linear``'s time to the packed path's, medians of interleaved rounds, on the project's
2-core AMD EPYC (AVX2, no AVX-512; torch 2.13.0+cpu, oneDNN 3.12, MKL 2024.2):

    M (rows)                  1      2      4      8     16     64    256   1024   2048   8192
    1 thread, CPU time     0.73x  1.48x  1.89x  1.67x  1.77x  1.62x  1.15x  1.05x  0.99x  0.95x
    1 thread, wall         0.74x      -      -  1.59x  1.73x  1.59x  1.21x  1.07x  1.02x  1.07x
    2 threads, wall        0.43x      -      -  2.89x  2.62x  2.56x  1.73x  1.26x  1.02x  0.85x

(The machine was shared with other jobs throughout, load 4-13 on 2 cores: absolute GFLOP/s
were low, 50-60 per CPU-second at large M; the ratios are what to read. The 2-thread
column suffers most from the sharing.) So two rows and more take the packed path; a
single row (decode of one request, a matrix-vector product) stays on ``F.linear``: the
blocked layout is a poor fit there (for M=1 oneDNN itself would choose the plain layout)
and MKL's gemv is at least as fast as oneDNN's there. From M ~ 2048 (long prefills,
compute-bound) the two are level.

Small M with the weights cold (decode): the C kernel kernels/cpu_gemm.py. The table above
times each linear alone, its weight hot in the caches. In a decode step the whole model's
weights (94 MB for the peers' small model) stream from memory every step, and there
oneDNN's packed path reads them well below the memory bandwidth (M=1: 5.5 GB/s where a
2-thread ``x.sum()`` read 19 GB/s on a calm machine). kernels/cpu_gemm.py streams each row
of the plain [N, K] weight once, reusing it from L1 for all M rows (M=1: 8 GB/s in a run
where ``x.sum()`` read ~10 GB/s, the machine busy; 5.8 GB/s in the busier run below).
``OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_linear.py --sections gemm --threads 2
--models small qwen2 --rounds 7``: the four decoder linears of 8 layers called in turn, ms
per whole step, medians of 7 interleaved rounds, 2 threads, ratio = oneDNN packed's
(F.linear's) time over the kernel's, round by round (the machine shared, load ~2):

    M (rows)                        1      4     16     32     64    128
    peers' small, 94 MB: kernel  16.3   18.3   32.0   50.5   65.3   91.3 ms
      oneDNN packed / kernel    1.41x  1.34x  1.14x  0.95x  0.92x  0.70x
      F.linear / kernel         1.13x  1.91x  2.20x  1.75x  0.92x  0.93x
    Qwen2-0.5B, 477 MB: kernel   36.2   54.7  134.1  167.5  261.3  461.2 ms
      oneDNN packed / kernel    1.41x  1.33x  1.06x  0.97x  0.82x  0.64x
      F.linear / kernel         1.45x  3.38x  2.71x  2.21x  1.50x  1.16x

and between 16 and 32 (small model, 9 rounds): 1.20x at 16, 1.15x at 20, 1.07x at 24,
1.00x at 28, 0.95x at 32. From M ~ 28 the work is compute-bound enough that oneDNN's
brgemm (N in the vector lanes, no horizontal sums, a prepacked layout) wins; below it
streaming the weight once is what counts. So ``KERNEL_ROWS = 28``: fewer rows (single rows
too: 1.13-1.45x faster than ``F.linear``) run the kernel, more run oneDNN. A whole decode
step of the small model, both sides keeping the plain weights, kernel vs oneDNN (F.linear
for one row), interleaved steps, medians (``OMP_WAIT_POLICY=PASSIVE .venv/bin/python
bench/bench_decode_step.py --ab cpu-gemm --model-path $M --batches 1 4 16 64 --steps 32``,
two runs): batch 1 1.11x / 1.04x, 4 1.24x, 16 1.17x / 1.17x, 64 0.95x / 1.02x (linears on
oneDNN in both: noise). Against the worker's default packed-only (oneDNN for every M,
the same A/B with B unpatched): 1 1.23x, 4 1.15x, 16 1.17x, 64 1.04x.

On the 2-core Xeon (Sapphire Rapids: AVX-512, where oneDNN's brgemm runs AVX-512 too and
the kernel builds its 16-lane variant), the same command, 3 rounds, ``--gemm-ms 1 4 8 16 24
32 48 64``, oneDNN packed / kernel: small 1.61x at M=1, 1.55x at 4, 1.40x at 8, 1.14x at 16,
0.95x at 24, 0.97x at 32, 0.76x at 64; Qwen2-0.5B 1.06x, 1.22x, 1.23x, 0.98x, 1.03x, 0.97x,
0.79x at 64 (the AVX2 kernel there: 1.29x at 1, 0.83x at 16, 0.61x at 64). So
``KERNEL_ROWS_AVX512 = 20``.

On the 2-core AMD EPYC Zen 4 (AVX-512 executed in two halves, a 32 KiB L1d), with the
kernel's prefetches into L2 and ``GOMP_SPINCOUNT=100000`` (the worker's spin), Qwen2-0.5B's
linears of 8 layers cycling, ms per pass, kernel / oneDNN packed: M=1 20.7 / 49.0, 8 25.9 /
28.6, 10 30.5 / 30.2, 12 38.1 / 33.5, 16 48.7 / 37.6 (docs/benchmarks.md, item 17). So
``KERNEL_ROWS_AVX512_AMD = 10`` there, chosen by ``/proc/cpuinfo``'s vendor.

Exactness: the float32 oneDNN path computes in float32 with another summation order,
nothing else. Against float64, over both models' shapes at M = 1 / 64 / 2048: oneDNN
max|err| / max|ref| <= 1.4e-6 (MKL: 8.4e-7); it differs from ``F.linear`` by <= 1.4e-6
relative, inside the 1e-5 that greedy parity with transformers needs. The C kernel
(float32, FMA, a fixed order): <= 5.7e-7 against float64 over the same shapes at M = 1 /
16 / 27 (oneDNN 1.3e-6, MKL 9.0e-7 there); greedy parity holds with it
(tests/unit/test_model_parity.py with every PackedLinear keeping its plain weight).
(``torch.backends.mkldnn.matmul.fp32_precision = "bf16"/"tf32"`` would lower the precision
of both paths alike; radixserve never sets it.)

Use: pack once, after the weights are loaded, call in forward::

    qkv = PackedLinear(layer.qkv_proj.weight, layer.qkv_proj.bias)
    y = qkv(x)            # x: [..., in_features], any leading shape, any M (0 and 1 too)

The path is chosen once, at pack time: oneDNN when the weight is a float32 CPU tensor and
torch has a working oneDNN (``torch.backends.mkldnn.enabled``), otherwise plain
``F.linear`` over the original tensors (CUDA, float16/float64, builds without oneDNN), so
callers never branch. The only per-call choice is by size, and only while the original
(plain) weight is kept: fewer than ``min_rows`` rows go to ``F.linear`` on it, then fewer
than ``kernel_rows`` (default ``default_kernel_rows()``, by the kernel's vector width and
the CPU's vendor; float32 and oneDNN, where the C kernel builds) to kernels/cpu_gemm.py on
it, the rest to oneDNN. ``min_rows`` defaults to 0 when
the kernel serves (it beats ``F.linear`` at one row too), else to 2.

``bf16=True`` stores the weight in bfloat16 and runs in bfloat16 (activations cast in,
the result cast back to the input's dtype): oneDNN's bf16 kernels where the CPU has them
(avx512_bf16 / amx / avx_ne_convert: ``onednn_bf16_available()``), else ``F.linear`` in
bf16, which on an AVX2-only CPU runs at ~8 GFLOP/s whatever M, 3-7x *slower* than
float32 from M = 16 up: leave it off there.

Memory: the packed weight is a second copy (the same bytes as the float32 weight; the
blocked layout pads N to 64 and K to 16). By default (``keep_plain=True``) the original
tensor stays referenced (not copied) for the small-M paths, so float32 linear weights take
twice their size. ``keep_plain=False`` keeps only the packed copy (the caller may then drop
the original; ``to_dense()`` rebuilds it) at the price of every M on oneDNN (single rows
0.4-0.8x of ``F.linear``; M < 28 0.7-0.95x of the C kernel, table above). The worker's
``--cpu-linear packed`` is that; ``hybrid`` keeps both and so gets the kernel; the
default ``auto`` is ``hybrid`` while the linears' weights take at most 2 GiB.
Pack after ``load_weights``: the packed copy does not follow later in-place changes of the
original.

Inference only: the oneDNN op has no backward.
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
# kept): faster than oneDNN below it, slower from it on (module docstring's tables). Where
# they cross depends on the vector width both use: 28 rows with AVX2 (a 2-core Zen 3 EPYC),
# 20 with AVX-512 on the 2-core Xeon (Sapphire Rapids, where oneDNN's kernels are AVX-512
# too), 10 with AVX-512 on the 2-core Zen 4 EPYC (a 32 KiB L1d, AVX-512 in two halves: the
# kernel's reuse of each weight chunk over the rows pays less there).
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
