"""The fused C element-wise kernels (kernels/cpu/elementwise.py) against torch's expressions,
and services/worker/layers.py's use of them."""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import _cc
from kernels.cpu import elementwise as cpu_elementwise
from services.worker import layers

kernel = cpu_elementwise.load()
# Only a machine without a C compiler (or RADIXSERVE_CPU_KERNELS=0) may skip: where one
# exists, a kernel that fails to build fails test_kernel_builds_where_a_compiler_exists.
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="no C compiler on PATH or RADIXSERVE_CPU_KERNELS=0"
)


# silu_mul is built with AVX2/FMA only (its scalar form was slower than torch).
needs_silu_mul = pytest.mark.skipif(
    kernel is None or kernel.silu_mul is None, reason="no C compiler, or a CPU without AVX2/FMA"
)


def fused() -> cpu_elementwise.Elementwise:
    assert kernel is not None  # the tests that call it are @needs_kernel
    return kernel


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    assert kernel is not None and kernel.silu_mul is not None  # @needs_silu_mul
    return kernel.silu_mul(gate_up, inter)


def test_kernel_builds_where_a_compiler_exists():
    if _cc.compiler() is not None and not _cc.disabled():
        assert kernel is not None, "a C compiler is here but the kernel did not build (see log)"
    else:
        assert kernel is None


def test_silu_mul_builds_where_the_cpu_has_avx2_and_fma():
    """needs_silu_mul may skip only on a CPU without AVX2/FMA, never hide a failed build."""
    flags = f"{_cc.cpu_flags()} "
    if kernel is not None and " avx2 " in flags and " fma " in flags:
        assert kernel.silu_mul is not None, "AVX2/FMA here but silu_mul was not built"


def _cos_sin(t: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """As RotaryEmbedding.cos_sin: angles of positions up to 40k."""
    freqs = torch.rand(t, d // 2, generator=g) * 40000
    return freqs.cos(), freqs.sin()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d", [64, 128, 36, 2])
@pytest.mark.parametrize("heads", [1, 12, 16])
def test_rotary_is_bit_identical_on_a_qkv_view(heads: int, d: int, threads: int):
    """x as Attention hands it over: q and k heads of the fused qkv output (rows strided by
    the v columns); also a contiguous x. Same rounded operations as torch: equal bits."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (0, 1, 5, 300):
            g = torch.Generator().manual_seed(t * 131 + heads * 7 + d)
            qkv = torch.randn(t, (heads + 3) * d, generator=g) * 5
            x = qkv[:, : heads * d].view(t, heads, d)
            assert x.stride(0) == (heads + 3) * d and not x.is_contiguous() or t <= 1
            cos, sin = _cos_sin(t, d, g)
            ref = cpu_elementwise.rotary_ref(x, cos, sin)
            for xi in (x, x.contiguous()):
                y = fused().rotary(xi, cos, sin)
                assert y.shape == (t, heads, d) and y.is_contiguous()
                assert torch.equal(y, ref), (t, heads, d)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_rotary_rejects_odd_or_mismatched_shapes():
    cos, sin = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(ValueError):
        fused().rotary(torch.randn(4, 2, 7), cos, sin)
    with pytest.raises(ValueError):
        fused().rotary(torch.randn(4, 2, 8), cos, sin)
    with pytest.raises(ValueError):
        fused().rotary(torch.randn(4, 2, 6).double(), cos, sin)


@needs_silu_mul
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter", [1408, 4864, 1, 7, 13, 100])
def test_silu_mul_matches_torch(inter: int, threads: int):
    """I off the 8 lanes exercises the masked tail; values up to |x| ~ 100 the exp's
    overflow (silu -> -0) and underflow (silu -> x)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (0, 1, 5, 300):
            g = torch.Generator().manual_seed(t * 17 + inter)
            gu = torch.randn(t, 2 * inter, generator=g) * 4
            gu[:, : inter // 2] *= 25  # a quarter of the gate past exp's range
            y = silu_mul(gu, inter)
            ref = F.silu(gu[:, :inter]) * gu[:, inter:]
            assert y.shape == (t, inter) and y.dtype == torch.float32
            torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(old)


@needs_silu_mul
def test_silu_mul_edge_values():
    gate = torch.tensor(
        [-1e4, -200.0, -88.8, -88.0, -87.0, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 87.5, 88.8,
         200.0, 1e4, float("inf"), float("-inf"), float("nan"), 3.0]  # 19: not a multiple of 8
    )  # fmt: skip
    up = torch.linspace(-3, 3, gate.numel())
    y = silu_mul(torch.cat([gate, up])[None], gate.numel())[0]
    ref = F.silu(gate) * up
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.isnan(y[-2]) and y[-1] != 0


@needs_silu_mul
def test_silu_mul_leading_dims_and_errors():
    gu = torch.randn(2, 3, 2 * 40)
    flat = silu_mul(gu.view(6, 80), 40)
    assert torch.equal(silu_mul(gu, 40), flat.view(2, 3, 40))
    strided = torch.randn(6, 100)[:, :80]  # not contiguous: copied first
    torch.testing.assert_close(
        silu_mul(strided, 40), cpu_elementwise.silu_mul_ref(strided, 40), rtol=1e-6,
        atol=1e-6,
    )  # fmt: skip
    with pytest.raises(ValueError):
        silu_mul(torch.randn(3, 81), 40)
    with pytest.raises(ValueError):
        silu_mul(gu.double(), 40)


@needs_silu_mul
def test_layers_use_the_kernels_for_float32_cpu_only(monkeypatch):
    calls: list[str] = []
    real = fused()

    def rotary(*a) -> torch.Tensor:
        calls.append("rotary")
        return real.rotary(*a)

    def silu_mul_spy(*a) -> torch.Tensor:
        calls.append("silu_mul")
        return silu_mul(*a)

    def rms_norm_spy(*a) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("rms_norm")
        return real.rms_norm(*a)

    spy = cpu_elementwise.Elementwise(rotary, silu_mul_spy, rms_norm_spy)
    monkeypatch.setattr(cpu_elementwise, "load", lambda: spy)
    x, (cos, sin) = torch.randn(5, 4, 64), _cos_sin(5, 64, torch.Generator().manual_seed(0))
    assert torch.equal(layers.apply_rotary(x, cos, sin), cpu_elementwise.rotary_ref(x, cos, sin))
    layers.apply_rotary(x.double(), cos.double(), sin.double())  # float64: torch's path
    assert calls == ["rotary"]

    mlp = layers.GatedMLP(16, 24, "silu")
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    h = torch.randn(3, 16)
    with torch.no_grad():
        out = mlp(h)
        monkeypatch.setattr(layers, "FUSED_ELEMENTWISE", False)
        torch.testing.assert_close(out, mlp(h), rtol=1e-5, atol=1e-5)
    assert calls == ["rotary", "silu_mul"]  # the second call took torch's path

    monkeypatch.setattr(layers, "FUSED_ELEMENTWISE", True)
    calls.clear()
    norm = layers.RMSNorm(16, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x, res = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        ref_total, ref = cpu_elementwise.rms_norm_ref(x, norm.weight, 1e-6, res)
        total, normed = norm.add_forward(x, res)
        assert torch.equal(total, ref_total)  # the same float sum: bit-identical stream
        torch.testing.assert_close(normed, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm(x), cpu_elementwise.rms_norm_ref(x, norm.weight, 1e-6)[1])
        norm(torch.randn(3, 32)[:, :16])  # a strided view: torch's path
        norm(x.double().float().half().float().t().contiguous().t())  # not contiguous: torch
    assert calls == ["rms_norm", "rms_norm"]


def test_portable_build_has_the_rotary_but_no_silu_mul(tmp_path, monkeypatch):
    """Without AVX2 (-mno-avx2 here): the plain-C rotary, still bit-identical; no silu_mul."""
    cc = _cc.compiler()
    if cc is None or _cc.disabled() or " avx2 " not in f"{_cc.cpu_flags()} ":
        pytest.skip("needs a C compiler on an x86 CPU with AVX2 (to switch it off)")
    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path))
    flags = [*_cc.FLAGS, "-ffp-contract=off", "-mno-avx2", "-mno-fma"]
    lib = _cc.load_library("elementwise_portable", cpu_elementwise._SOURCE, "probe", flags=flags)
    assert lib is not None and not hasattr(lib, "rs_silu_mul_f32")
    fn = lib.rs_rotary_f32
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 3]
    fn.argtypes += [*[ctypes.c_int64] * 3, ctypes.c_int]
    x, (cos, sin) = torch.randn(7, 5, 36), _cos_sin(7, 36, torch.Generator().manual_seed(1))
    rotary = functools.partial(cpu_elementwise._rotary, fn)
    assert torch.equal(rotary(x, cos, sin), cpu_elementwise.rotary_ref(x, cos, sin))


def test_kernel_off_by_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
    cpu_elementwise.load.cache_clear()
    try:
        assert cpu_elementwise.load() is None
        x, cos = torch.randn(2, 3, 8), torch.randn(2, 4)
        # layers falls back to torch's expression
        ref = cpu_elementwise.rotary_ref(x, cos, cos)
        assert torch.equal(layers.apply_rotary(x, cos, cos), ref)
    finally:
        cpu_elementwise.load.cache_clear()
        monkeypatch.delenv("RADIXSERVE_CPU_KERNELS")
        assert (cpu_elementwise.load() is None) == (kernel is None)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 512), (16, 512), (70, 896), (5, 3, 24), (2049, 64), (0, 512), (3, 17)]
)
def test_rms_norm_matches_torch(shape, residual, threads):
    """RMSNorm (after the residual add) against torch's ops: the sum bit-identical, the norm
    within float32 rounding of F.rms_norm, for any leading shape and N off the 16 lanes."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    res = torch.randn(shape, generator=g) if residual else None
    w = torch.randn(shape[-1], generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        total, out = fused().rms_norm(x, w, 1e-6, res)
    finally:
        torch.set_num_threads(old)
    ref_total, ref = cpu_elementwise.rms_norm_ref(x, w, 1e-6, res)
    assert total.shape == out.shape == x.shape
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    if x.numel():  # no further from the float64 answer than torch's own
        exact = F.rms_norm(ref_total.double(), (shape[-1],), w.double(), 1e-6)
        err, err_torch = (out.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err.item() <= 4 * err_torch.item() + 1e-6


@needs_kernel
def test_rms_norm_refuses_mismatched_inputs():
    k = fused()
    with pytest.raises(ValueError):
        k.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-6)
    with pytest.raises(ValueError):
        k.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError):
        k.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(3, 8))
