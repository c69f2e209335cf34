"""services/worker/cpu_linear.py: the prepacked CPU linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import cpu_linear
from services.worker.cpu_linear import (
    PackedLinear,
    onednn_bf16_available,
    onednn_fp32_available,
    pack_linear,
)

K, N = 96, 80  # in / out features: not multiples of oneDNN's blocks (16 / 64), so padding counts


def _weights(bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * K**-0.5
    b = torch.randn(N, generator=gen) if bias else None
    return w, b


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _inputs(m: int, layout: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + m)
    if layout == "2d":
        return torch.randn(m, K, generator=gen)
    if layout == "3d":
        return torch.randn(2, m, K, generator=gen)
    if layout == "strided":  # every other column of a wider tensor
        return torch.randn(m, 2 * K, generator=gen)[:, ::2]
    assert layout == "transposed"
    return torch.randn(K, m, generator=gen).t()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["2d", "3d", "strided", "transposed"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_fp32_matches_f_linear(m: int, layout: str, bias: bool) -> None:
    w, b = _weights(bias)
    lin = PackedLinear(w, b)
    x = _inputs(m, layout)
    y = lin(x)
    ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert _rel(y, ref) < 1e-5
    # ... and it is float32 accurate: as close to the float64 answer as F.linear is.
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert _rel(y, exact) < 1e-5


def test_fp32_uses_onednn_here() -> None:
    if not onednn_fp32_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    w, b = _weights(True)
    lin = PackedLinear(w, b)
    # Single rows: the C kernel (kernels/cpu/gemm.py) where it builds, else F.linear.
    assert lin.path == "onednn" and lin.min_rows == (0 if lin.kernel_rows else 2)
    assert lin.to_dense() is w  # the plain weight is referenced, not copied
    packed_only = PackedLinear(w, b, keep_plain=False)
    assert packed_only.min_rows == 0
    dense = packed_only.to_dense()  # rebuilt from the packed copy
    assert dense is not w and torch.equal(dense, w)


def test_single_row_runs_f_linear_exactly() -> None:
    """A single row (decode of one request) takes F.linear on the plain weight: bit-equal
    (without the C kernel, which takes them where it builds: tests/unit/test_cpu_gemm.py)."""
    w, b = _weights(True)
    lin = PackedLinear(w, b, kernel_rows=0)
    for x in (torch.randn(1, K), torch.randn(K), torch.randn(1, 1, K)):
        assert torch.equal(lin(x), F.linear(x, w, b))
    if lin.path == "onednn":
        # Two rows and more take the packed path: close, not necessarily bit-equal.
        x = torch.randn(2, K)
        assert _rel(lin(x), F.linear(x, w, b)) < 1e-5


@pytest.mark.parametrize("m", [1, 2, 64])
def test_packed_only_and_thresholds(m: int) -> None:
    w, b = _weights(True)
    x = torch.randn(m, K)
    ref = F.linear(x, w, b)
    for lin in (
        PackedLinear(w, b, keep_plain=False),
        PackedLinear(w, b, min_rows=0),
        PackedLinear(w, b, min_rows=1000),
    ):
        assert _rel(lin(x), ref) < 1e-5
    assert torch.equal(PackedLinear(w, b, min_rows=1000)(x), ref)  # all rows on F.linear


def test_empty_input_and_inference_mode() -> None:
    w, b = _weights(True)
    lin = pack_linear(w, b)
    assert lin(torch.randn(0, K)).shape == (0, N)
    with torch.inference_mode():
        x = torch.randn(5, K)
        assert _rel(lin(x), F.linear(x, w, b)) < 1e-5
        inner = pack_linear(w, b)  # packed inside inference mode, used outside
    x = torch.randn(3, 4, K)
    assert _rel(inner(x), F.linear(x, w, b)) < 1e-5


def test_from_linear_and_parameters_with_grad() -> None:
    layer = torch.nn.Linear(K, N)
    lin = PackedLinear.from_linear(layer)
    x = torch.randn(9, K)
    with torch.no_grad():
        assert _rel(lin(x), layer(x)) < 1e-5


def test_packed_copy_is_taken_at_pack_time() -> None:
    """Changing the original after packing does not reach the packed copy (pack after load)."""
    w, b = _weights(False)
    x = torch.randn(4, K)
    before = F.linear(x, w, b)
    w2 = w.clone()
    lin = PackedLinear(w2, b, keep_plain=False)
    w2.zero_()
    expected = before if lin.path == "onednn" else torch.zeros_like(before)
    assert _rel(lin(x), expected) < 1e-5 or torch.equal(lin(x), expected)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_bf16_option(m: int, bias: bool) -> None:
    w, b = _weights(bias)
    lin = PackedLinear(w, b, bf16=True)
    assert lin.dtype == torch.bfloat16
    assert lin.path == ("onednn-bf16" if onednn_bf16_available() else "linear-bf16")
    x = torch.randn(m, K)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, N)
    assert _rel(y, F.linear(x, w, b)) < 3e-2  # bf16: 8 bits of mantissa
    # bf16 inputs stay bf16
    yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert _rel(yb, F.linear(x, w, b)) < 3e-2


def test_bf16_model_weights() -> None:
    """A model loaded in bfloat16: the weight is already bf16, inputs are bf16."""
    w, b = _weights(True)
    lin = PackedLinear(w.bfloat16(), b.bfloat16())
    assert lin.dtype == torch.bfloat16
    assert lin.path in ("onednn-bf16", "linear")
    x = torch.randn(3, 5, K).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16
    assert _rel(y, F.linear(x, w.bfloat16(), b.bfloat16())) < 2e-2


def test_fallback_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """No oneDNN (or mkldnn disabled): plain F.linear over the original tensors."""
    monkeypatch.setattr(cpu_linear, "onednn_fp32_available", lambda: False)
    monkeypatch.setattr(cpu_linear, "onednn_bf16_available", lambda: False)
    w, b = _weights(True)
    lin = PackedLinear(w, b)
    assert lin.path == "linear" and lin.min_rows == 0
    assert lin.to_dense() is w
    x = torch.randn(2, 3, K)
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert PackedLinear(w, b, bf16=True).path == "linear-bf16"


def test_fallback_when_mkldnn_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = _weights(True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    lin = PackedLinear(w, b)
    monkeypatch.undo()
    assert lin.path == "linear"
    x = torch.randn(7, K)
    assert torch.equal(lin(x), F.linear(x, w, b))


def test_fallback_for_other_dtypes() -> None:
    w, b = _weights(False)
    lin = PackedLinear(w.double(), None)
    assert lin.path == "linear"
    x = torch.randn(4, K, dtype=torch.float64)
    assert torch.equal(lin(x), F.linear(x, w.double()))
    half = PackedLinear(w.half(), None)
    assert half.path == "linear"


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        PackedLinear(torch.randn(N))
    with pytest.raises(ValueError):
        PackedLinear(torch.randn(N, K), torch.randn(N + 1))


def test_one_dimensional_and_empty_inputs_on_every_path() -> None:
    w, b = _weights(True)
    x = torch.randn(K)
    ref = F.linear(x, w, b)
    for lin in (
        PackedLinear(w, b),
        PackedLinear(w, b, keep_plain=False),
        PackedLinear(w, b, min_rows=0),
    ):
        y = lin(x)
        assert y.shape == (N,)
        assert _rel(y, ref) < 1e-5
        assert lin(torch.randn(2, 0, K)).shape == (2, 0, N)


@pytest.mark.parametrize(
    "lanes,vendor,rows",
    [
        (16, "GenuineIntel", cpu_linear.KERNEL_ROWS_AVX512),
        (16, "AuthenticAMD", cpu_linear.KERNEL_ROWS_AVX512_AMD),
        (16, "", cpu_linear.KERNEL_ROWS_AVX512),
        (8, "AuthenticAMD", cpu_linear.KERNEL_ROWS),
        (8, "GenuineIntel", cpu_linear.KERNEL_ROWS),
    ],
)
def test_the_kernel_crossing_follows_vector_width_and_vendor(monkeypatch, lanes, vendor, rows):
    monkeypatch.setattr(cpu_linear.cpu_gemm, "lanes", lambda: lanes)
    monkeypatch.setattr(cpu_linear._cc, "cpu_vendor", lambda: vendor)
    assert cpu_linear.default_kernel_rows() == rows


def test_cpu_vendor_reads_proc_cpuinfo():
    vendor = cpu_linear._cc.cpu_vendor()
    assert isinstance(vendor, str) and " " not in vendor.strip()
