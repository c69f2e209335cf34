"""The C small-M GEMM (kernels/cpu/gemm.py) against float64, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import _cc
from kernels.cpu import gemm as cpu_gemm
from services.worker.cpu_linear import PackedLinear

kernel = cpu_gemm.load()
# Only a machine without a C compiler (or RADIXSERVE_CPU_KERNELS=0) may skip: where one
# exists, a kernel that fails to build fails test_kernel_builds_where_a_compiler_exists.
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="no C compiler on PATH or RADIXSERVE_CPU_KERNELS=0"
)


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, fn=None) -> torch.Tensor:
    fn = fn or kernel
    assert fn is not None  # the tests that call it are @needs_kernel
    return fn(x, w, b)


FLAGS = _cc.cpu_flags().split()
# On an AVX-512 CPU the native build is the 16-lane variant; the 8-lane (AVX2) one is built
# beside it with -mno-avx512f so that both stay tested wherever this runs.
NO_AVX512 = ("-mno-avx512f",)
avx2_kernel = cpu_gemm.load(NO_AVX512) if kernel is not None and "avx512f" in FLAGS else None
VARIANTS = [pytest.param(None, id="native")] + (
    [pytest.param(avx2_kernel, id="avx2")] if avx2_kernel is not None else []
)


@needs_kernel
def test_the_widest_vectors_this_cpu_has_are_built():
    want = 16 if "avx512f" in FLAGS else 8 if {"avx2", "fma"} <= set(FLAGS) else 0
    assert cpu_gemm.lanes() == want
    if want == 16:
        assert cpu_gemm.lanes(NO_AVX512) == 8 and avx2_kernel is not None


SHAPES = [  # (N, K)
    (1024, 512), (512, 512), (2816, 512), (512, 1408),  # the peers' small model
    (1152, 896), (896, 896), (896, 4864),  # Qwen2-0.5B (gate_up 9728x896 below)
    (7, 13), (5, 3), (13, 1100), (1, 1), (4, 8), (6, 520),  # N, K off the blocks (4, 8, 512)
]  # fmt: skip


def test_kernel_builds_where_a_compiler_exists():
    if _cc.compiler() is not None and not _cc.disabled():
        assert kernel is not None, "a C compiler is here but the kernel did not build (see log)"
    else:
        assert kernel is None


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    if y.numel() == 0:
        return 0.0
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + m * 31 + n + k)
    w = (torch.rand(n, k, generator=g) * 2 - 1) * k**-0.5  # nn.Linear's init
    b = torch.randn(n, generator=g) if bias else None
    return torch.randn(m, k, generator=g), w, b


@needs_kernel
@pytest.mark.parametrize("fn", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_float64(n: int, k: int, bias: bool, threads: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (0, 1, 2, 3, 5, 16, 31, 64):
            x, w, b = _case(m, n, k, bias)
            y = gemm(x, w, b, fn)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert _rel(y, cpu_gemm.gemm_ref(x, w, b)) < 1e-5, (m, n, k)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_qwen_gate_up_and_error_no_worse_than_f_linear():
    x, w, b = _case(5, 9728, 896, False)
    ref = cpu_gemm.gemm_ref(x, w, b)
    err, err_mkl = _rel(gemm(x, w, b), ref), _rel(F.linear(x, w, b), ref)
    assert err < 1e-5
    assert err < 4 * err_mkl + 1e-7  # float32 accurate: same order as MKL's sgemm


@needs_kernel
@pytest.mark.parametrize("fn", VARIANTS)
def test_rows_are_batch_invariant_and_thread_invariant(fn):
    """A fixed summation order that depends on neither M, the tile nor the threads."""
    x, w, b = _case(31, 300, 1100, True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = gemm(x, w, b, fn)
        torch.set_num_threads(1)
        assert torch.equal(gemm(x, w, b, fn), full)
    finally:
        torch.set_num_threads(old)
    for rows in (slice(0, 1), slice(4, 6), slice(29, 31)):
        assert torch.equal(gemm(x[rows], w, b, fn), full[rows])


@needs_kernel
def test_any_leading_shape_strided_x_and_empty_k():
    x, w, b = _case(24, 40, 100, True)
    x3 = x.view(2, 3, 4, 100)
    assert torch.equal(gemm(x3, w, b), gemm(x, w, b).view(2, 3, 4, 40))
    wide = torch.randn(6, 250)[:, ::2]  # K not contiguous: copied
    w2 = torch.randn(9, 125)
    assert _rel(gemm(wide, w2), cpu_gemm.gemm_ref(wide, w2)) < 1e-5
    rows = torch.randn(6, 130)[:, :125]  # rows strided, K dense: read in place
    assert _rel(gemm(rows, w2), cpu_gemm.gemm_ref(rows, w2)) < 1e-5
    assert gemm(torch.randn(2, 0, 100), w, b).shape == (2, 0, 40)
    empty_k = gemm(torch.randn(3, 0), torch.randn(5, 0), b[:5].contiguous())
    assert torch.equal(empty_k, b[:5].expand(3, 5))
    with pytest.raises(ValueError):
        gemm(x.double(), w)


def test_supports_only_float32_cpu_with_k_contiguous():
    w = torch.randn(8, 16)
    assert cpu_gemm.supports(w) and cpu_gemm.supports(w, torch.randn(8))
    assert not cpu_gemm.supports(w.double())
    assert not cpu_gemm.supports(w.t())
    assert not cpu_gemm.supports(w, torch.randn(8).double())


def test_kernel_off_by_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
    cpu_gemm.load.cache_clear()
    try:
        assert cpu_gemm.load() is None
    finally:
        cpu_gemm.load.cache_clear()
        monkeypatch.delenv("RADIXSERVE_CPU_KERNELS")
        assert (cpu_gemm.load() is None) == (kernel is None)


def test_library_is_cached_by_key(tmp_path, monkeypatch):
    """A second build of the same source reuses the file; another source gets its own."""
    cc = _cc.compiler()
    if cc is None or _cc.disabled():
        pytest.skip("no C compiler on PATH or RADIXSERVE_CPU_KERNELS=0")
    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path))
    src = "int rs_one(void) { return 1; }\n"
    lib = _cc.build("probe", src, _cc.FLAGS, cc)
    mtime = lib.stat().st_mtime_ns
    assert _cc.build("probe", src, _cc.FLAGS, cc) == lib
    assert lib.stat().st_mtime_ns == mtime
    assert _cc.build("probe", src + "\n", _cc.FLAGS, cc) != lib
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".so")] == []


# ---- PackedLinear (services/worker/cpu_linear.py) -------------------------------------


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_routes_small_rows_to_the_kernel(bias: bool):
    """Rows below kernel_rows run the kernel on the plain weight (bit-equal to it), more
    rows oneDNN; every leading shape, M = 0 and non-contiguous x included."""
    x, w, b = _case(80, 96, 200, bias)
    lin = PackedLinear(w, b)
    if lin.path != "onednn":
        pytest.skip("this torch build has no oneDNN packed linear")
    assert lin.kernel_rows > 1 and lin.min_rows == 0
    for m in (1, 2, 5, lin.kernel_rows - 1):
        assert torch.equal(lin(x[:m]), gemm(x[:m], w, b)), m
        assert _rel(lin(x[:m]), cpu_gemm.gemm_ref(x[:m], w, b)) < 1e-5
    big = x[: lin.kernel_rows]  # from kernel_rows up: oneDNN, close to the same answer
    assert _rel(lin(big), cpu_gemm.gemm_ref(big, w, b)) < 1e-5
    assert lin(x[:0]).shape == (0, 96)
    assert lin(torch.randn(2, 0, 200)).shape == (2, 0, 96)
    x3 = torch.randn(2, 3, 400)[..., ::2]  # 6 rows, K strided
    assert _rel(lin(x3), cpu_gemm.gemm_ref(x3, w, b)) < 1e-5
    assert lin(torch.randn(200)).shape == (96,)


@needs_kernel
def test_packed_linear_without_the_kernel():
    """kernel_rows=0, packed-only (no plain weight) and min_rows above it: no kernel."""
    x, w, b = _case(8, 40, 64, True)
    ref = F.linear(x, w, b)
    off = PackedLinear(w, b, kernel_rows=0)
    assert off.kernel_rows == 0
    assert torch.equal(off(x[:1]), F.linear(x[:1], w, b))  # single rows: F.linear again
    assert PackedLinear(w, b, keep_plain=False).kernel_rows == 0
    assert torch.equal(PackedLinear(w, b, min_rows=1000)(x), ref)  # all rows on F.linear
    assert PackedLinear(w.double(), None).kernel_rows == 0
