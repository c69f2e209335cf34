"""The 16-bit paths of the CPU C kernels (issue 42) against their PyTorch references, on
every vector variant this CPU can build (the native one, and the narrower ones forced with
``-mno-*`` flags, as kernels/cpu/_cc.py's RADIXSERVE_CPU_ISA does for a whole process).

Tolerances (bfloat16 has 8 significant bits: one ulp is 2^-7 relative at most, float16
2^-10): each kernel sums in float32 and rounds once where torch rounds, so
- the 16-bit GEMM is within one ulp of the output dtype of the exact (float64) product of
  the rounded inputs, plus float32 summation error (1e-5 of the largest output);
- the rotary is bit-identical to torch's expression in that dtype, RMSNorm's residual sum
  bit-identical and its output within one ulp (float32 statistics summed in another
  order), silu * up within one ulp;
- decode and extend attention over bfloat16 pools are within one bfloat16 ulp of the
  float64 attention of the same (bfloat16) inputs, plus 1e-5 of the largest output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import _cc
from kernels.cpu import decode_attention as cpu_decode_attention
from kernels.cpu import elementwise as cpu_elementwise
from kernels.cpu import extend_attention as cpu_extend_attention
from kernels.cpu import gemm as cpu_gemm
from services.worker import cpu_linear, layers
from services.worker.cpu_linear import PackedLinear

FLAGS = set(_cc.cpu_flags().split())
HAVE_CC = _cc.compiler() is not None and not _cc.disabled()
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler or RADIXSERVE_CPU_KERNELS=0")
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}

# The narrower builds to test beside the native one, where this CPU has more.
NO_BF16, NO_AVX512, NO_AVX2 = ("-mno-avx512bf16",), ("-mno-avx512f",), ("-mno-avx2", "-mno-fma")
GEMM_VARIANTS = [pytest.param((), id="native")]
if "avx512_bf16" in FLAGS:
    GEMM_VARIANTS.append(pytest.param(NO_BF16, id="avx512"))
if "avx512f" in FLAGS:
    GEMM_VARIANTS.append(pytest.param(NO_AVX512, id="avx2"))
if "avx2" in FLAGS:
    GEMM_VARIANTS.append(pytest.param(NO_AVX2, id="portable"))


def within_ulp(
    y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: float = 1e-5, ulps: int = 1
) -> None:
    """|y - ref| <= ulps ulps of dtype at ref, plus atol of the largest |ref|."""
    if ref.numel() == 0:
        assert y.shape == ref.shape
        return
    diff = (y.double() - ref.double()).abs()
    bound = ref.double().abs() * ulps * ULP[dtype] + atol * ref.double().abs().max()
    worst = (diff - bound).max().item()
    assert worst <= 0, f"{(diff > bound).sum().item()} values beyond {ulps} ulp(s)"


# ---- the 16-bit small-M GEMM -----------------------------------------------------------


def gemm16(extra: tuple[str, ...]):
    """The kernel of one build; the portable one is bound directly (load16 serves none)."""
    if extra == NO_AVX2:
        lib = cpu_gemm._library16(extra)
        return None if lib is None else cpu_gemm.bind16(lib)
    return cpu_gemm.load16(extra)


@needs_cc
def test_the_widest_isa_is_built():
    want = (
        3 if "avx512_bf16" in FLAGS else 2 if "avx512bw" in FLAGS else 1 if "avx2" in FLAGS else 0
    )
    assert cpu_gemm.isa16() == want
    if "avx512_bf16" in FLAGS:
        assert cpu_gemm.isa16(NO_BF16) == 2 and cpu_gemm.isa16(NO_AVX512) == 1
    if "avx2" in FLAGS:
        assert cpu_gemm.isa16(NO_AVX2) == 0 and cpu_gemm.load16(NO_AVX2) is None


def _gemm_case(m: int, n: int, k: int, wdt: torch.dtype, xdt: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + m * 31 + n + k)
    w = ((torch.rand(n, k, generator=g) * 2 - 1) * k**-0.5).to(wdt)
    b = torch.randn(n, generator=g)
    return torch.randn(m, k, generator=g).to(xdt), w, b


@needs_cc
@pytest.mark.parametrize("extra", GEMM_VARIANTS)
@pytest.mark.parametrize(
    "wdt,xdt",
    [
        (torch.bfloat16, torch.bfloat16),  # a bfloat16 model
        (torch.bfloat16, torch.float32),  # bf16=True weights under float32 rows
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize(
    "n,k", [(36, 896), (9, 4864), (7, 13), (5, 3), (33, 1100), (1, 1), (6, 2100), (64, 64)]
)
def test_gemm16_is_within_an_ulp_of_the_exact_product(extra, wdt, xdt, n, k):
    """K off the 32-element vectors and past one 1024 chunk, odd N, M 1..8 and beyond:
    every tile and tail."""
    fn = gemm16(extra)
    assert fn is not None
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 17):
        for bias in (False, True):
            x, w, b = _gemm_case(m, n, k, wdt, xdt)
            b = b if bias else None
            y = fn(x, w, b)
            assert y.dtype == xdt and y.shape == (m, n)
            within_ulp(y, cpu_gemm.gemm16_ref(x, w, b), xdt)


@needs_cc
@pytest.mark.parametrize("extra", GEMM_VARIANTS)
def test_gemm16_rows_are_batch_and_thread_invariant(extra):
    fn = gemm16(extra)
    x, w, b = _gemm_case(31, 300, 1100, torch.bfloat16, torch.bfloat16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = fn(x, w, b)
        torch.set_num_threads(1)
        assert torch.equal(fn(x, w, b), full)
    finally:
        torch.set_num_threads(old)
    for rows in (slice(0, 1), slice(4, 6), slice(29, 31)):
        assert torch.equal(fn(x[rows], w, b), full[rows])


@needs_cc
def test_gemm16_shapes_strides_and_errors():
    fn = cpu_gemm.load16()
    x, w, b = _gemm_case(24, 40, 96, torch.bfloat16, torch.bfloat16)
    assert torch.equal(fn(x.view(2, 3, 4, 96), w, b), fn(x, w, b).view(2, 3, 4, 40))
    rows = torch.randn(6, 130).bfloat16()[:, :96]  # rows strided, K dense: read in place
    assert torch.equal(fn(rows, w), fn(rows.contiguous(), w))
    cols = torch.randn(6, 192).bfloat16()[:, ::2]  # K strided: copied
    assert torch.equal(fn(cols, w), fn(cols.contiguous(), w))
    assert fn(torch.randn(2, 0, 96).bfloat16(), w).shape == (2, 0, 40)
    empty = fn(torch.randn(3, 0).bfloat16(), torch.randn(5, 0).bfloat16(), b[:5].contiguous())
    assert torch.equal(empty.float(), b[:5].bfloat16().float().expand(3, 5))
    with pytest.raises(ValueError):
        fn(x.double(), w)
    assert cpu_gemm.supports16(w, b) and not cpu_gemm.supports16(w, b.bfloat16())
    assert not cpu_gemm.supports16(w.float()) and not cpu_gemm.supports16(w.t())


# ---- PackedLinear over 16-bit weights ---------------------------------------------------


@needs_cc
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_runs_few_bf16_rows_on_the_kernel(bias):
    """A bfloat16 model's linear: rows below kernel_rows bit-equal to the kernel, more rows
    oneDNN (or F.linear) within an ulp; the output stays bfloat16."""
    x, w, b = _gemm_case(80, 96, 200, torch.bfloat16, torch.bfloat16)
    b16 = b.bfloat16() if bias else None
    lin = PackedLinear(w, b16)
    assert lin.kernel_rows == cpu_linear.default_kernel_rows16() > 0
    assert lin.path == ("onednn-bf16" if cpu_linear.onednn_bf16_available() else "linear")
    b32 = None if b16 is None else b16.float()
    for m in (1, 2, lin.kernel_rows - 1):
        assert torch.equal(lin(x[:m]), cpu_gemm.load16()(x[:m], w, b32)), m
    for m in (lin.kernel_rows, 80):
        y = lin(x[:m])
        assert y.dtype == torch.bfloat16
        within_ulp(y, cpu_gemm.gemm16_ref(x[:m], w, b32), torch.bfloat16, atol=1e-3)
    # Packed only (--cpu-linear packed): oneDNN for every row count, no kernel.
    if cpu_linear.onednn_bf16_available():
        assert PackedLinear(w, b16, keep_plain=False).kernel_rows == 0


@needs_cc
def test_packed_linear_float16_and_bf16_option():
    """float16 weights: the kernel for few rows, F.linear beyond; bf16=True over a float32
    weight takes float32 rows and gives float32 back."""
    x, w, b = _gemm_case(70, 48, 64, torch.float16, torch.float16)
    lin = PackedLinear(w, b.half())
    assert lin.path == "linear" and lin.kernel_rows == cpu_linear.KERNEL_ROWS_16_ALONE
    within_ulp(lin(x[:3]), cpu_gemm.gemm16_ref(x[:3], w, b.half().float()), torch.float16)
    assert torch.equal(lin(x), F.linear(x, w, b.half()))  # 70 rows: F.linear
    w32 = torch.randn(40, 64)
    opt = PackedLinear(w32, bf16=True)
    x32 = torch.randn(3, 64)
    y = opt(x32)
    assert y.dtype == torch.float32
    exact = F.linear(x32.bfloat16().double(), w32.bfloat16().double())
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@needs_cc
def test_the_bf16_crossing_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda dtype: True)
    monkeypatch.setattr(cpu_linear._cc, "cpu_flags", lambda: "flags : avx512f amx_bf16")
    assert cpu_linear.default_kernel_rows16() == cpu_linear.KERNEL_ROWS_16_AMX
    monkeypatch.setattr(cpu_linear._cc, "cpu_flags", lambda: "flags : avx512f avx512_bf16")
    monkeypatch.setattr(cpu_linear._cc, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_linear.default_kernel_rows16() == cpu_linear.KERNEL_ROWS_AVX512_AMD
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda dtype: False)
    assert cpu_linear.default_kernel_rows16() == cpu_linear.KERNEL_ROWS_16_ALONE


# ---- element-wise passes -----------------------------------------------------------------

ELEMENTWISE_VARIANTS = [pytest.param((), id="native")]
if "avx2" in FLAGS:
    ELEMENTWISE_VARIANTS.append(pytest.param(NO_AVX2, id="portable"))
HALF = [torch.bfloat16, torch.float16]


def _cos_sin(t: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(t).float()[:, None] * inv[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@needs_cc
@pytest.mark.parametrize("extra", ELEMENTWISE_VARIANTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("heads,d", [(6, 64), (3, 48), (2, 18), (1, 2), (14, 128)])
def test_rotary16_is_bit_identical_on_a_qkv_view(extra, dtype, heads, d):
    k = cpu_elementwise.load(extra)
    for t in (1, 5, 40):
        qkv = torch.randn(t, heads * d + 3 * d).to(dtype)
        x = qkv[:, : heads * d].view(t, heads, d)  # rows strided, as the model hands it
        cos, sin = _cos_sin(t, d, dtype)
        y = k.rotary(x, cos, sin)
        assert y.dtype == dtype and torch.equal(y, cpu_elementwise.rotary_ref(x, cos, sin))


@needs_cc
@pytest.mark.parametrize("extra", ELEMENTWISE_VARIANTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 896), (16, 512), (3, 37), (2, 15), (5, 3, 24), (0, 64)])
def test_rms_norm16_within_two_ulps(extra, dtype, shape):
    """Two: the output is rounded twice (the normed value, then times the weight, as
    transformers does), and a float32 sum in another order may round the first one the
    other way: one ulp of the normed value, up to ~2 of the product below its binade."""
    k = cpu_elementwise.load(extra)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    for r in (None, res):
        total, out = k.rms_norm(x, w, 1e-6, r)
        ref_total, ref = cpu_elementwise.rms_norm_ref(x, w, 1e-6, r)
        assert out.dtype == dtype and torch.equal(total, ref_total)
        within_ulp(out, ref, dtype, atol=0, ulps=2)


@needs_cc
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("inter", [4864, 1408, 1, 7, 13, 100])
def test_silu_mul16_within_an_ulp(dtype, inter):
    k = cpu_elementwise.load()
    if k.silu_mul is None:
        pytest.skip("no AVX2/FMA: no silu_mul kernel")
    gu = (4 * torch.randn(3, 2 * inter)).to(dtype)
    y = k.silu_mul(gu, inter)
    assert y.dtype == dtype
    within_ulp(y, cpu_elementwise.silu_mul_ref(gu, inter), dtype, atol=0)


@needs_cc
def test_layers_take_the_kernels_in_bfloat16(monkeypatch):
    """RMSNorm, the rotary and the gated MLP of a bfloat16 model run the C passes."""
    calls: list[str] = []
    real = cpu_elementwise.load()

    def spy(name: str, fn):
        def call(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        return call

    fake = cpu_elementwise.Elementwise(
        spy("rotary", real.rotary), real.silu_mul and spy("silu_mul", real.silu_mul),
        spy("rms_norm", real.rms_norm),
    )  # fmt: skip
    monkeypatch.setattr(cpu_elementwise, "load", lambda: fake)
    bf = torch.bfloat16
    x = torch.randn(5, 4, 64).to(bf)
    cos, sin = _cos_sin(5, 64, bf)
    assert torch.equal(layers.apply_rotary(x, cos, sin), cpu_elementwise.rotary_ref(x, cos, sin))
    norm = layers.RMSNorm(16, 1e-6).to(bf)
    with torch.no_grad():
        norm(torch.randn(3, 16).to(bf))
        mlp = layers.GatedMLP(16, 24, "silu").to(bf)
        mlp(torch.randn(3, 16).to(bf))
    want = ["rotary", "rms_norm"] + (["silu_mul"] if real.silu_mul else [])
    assert calls == want


# ---- attention over bfloat16 pools -------------------------------------------------------

ATTN_VARIANTS = [pytest.param((), id="native")]
if "avx512f" in FLAGS:
    ATTN_VARIANTS.append(pytest.param(NO_AVX512, id="avx2"))


def _pools(lens: list[int], kv_heads: int, d: int, rows: int, heads: int, seed: int = 0):
    """bfloat16 pools with scattered slots (slot 0 zeros), a table, q a strided view."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens) + 50
    k_pool = torch.randn(total + 1, kv_heads, d, generator=g).bfloat16()
    v_pool = torch.randn(total + 1, kv_heads, d, generator=g).bfloat16()
    k_pool[0] = v_pool[0] = 0
    perm = torch.randperm(total, generator=g) + 1
    table = torch.zeros(len(lens) + 3, max(lens) + 7, dtype=torch.int32)
    req_slots = torch.randperm(len(lens) + 3, generator=g)[: len(lens)].to(torch.int32)
    start = 0
    for i, n in enumerate(lens):
        table[int(req_slots[i]), :n] = perm[start : start + n].to(torch.int32)
        start += n
    q = torch.randn(rows, heads + 2 * kv_heads, d, generator=g)[:, :heads].bfloat16()
    return q, k_pool, v_pool, table, req_slots


DECODE_CASES = [
    (8, 4, 64, [1, 7, 300, 64]),
    (14, 2, 64, [129, 33]),  # Qwen2-0.5B's group of 7
    (4, 4, 36, [5, 40, 17, 2, 90]),  # head dim off the vectors: the per-slot path
    (14, 2, 128, [31, 200, 1]),
    (4, 2, 48, [3, 77]),  # the default model's head dim
]


@needs_cc
@pytest.mark.parametrize("extra", [*ATTN_VARIANTS, pytest.param(NO_AVX2, id="portable")])
@pytest.mark.parametrize("heads,kv_heads,d,lens", DECODE_CASES)
def test_decode_attention_bf16_within_an_ulp(extra, heads, kv_heads, d, lens):
    fn = cpu_decode_attention.load(extra)
    q, k_pool, v_pool, table, req_slots = _pools(lens, kv_heads, d, len(lens), heads)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert cpu_decode_attention.supports(q, k_pool, table)
    out = fn(q, k_pool, v_pool, table, req_slots, seq_lens, d**-0.5)
    ref = cpu_decode_attention.decode_attention_ref(
        q.double(), k_pool.double(), v_pool.double(), table, req_slots, seq_lens, d**-0.5
    )
    assert out.dtype == torch.bfloat16
    within_ulp(out, ref, torch.bfloat16)


EXTEND_CASES = [
    (8, 4, 64, [100], [0]),
    (14, 2, 64, [70], [0]),
    (8, 4, 64, [45], [130]),  # on a cached prefix
    (14, 2, 64, [1], [77]),
    (8, 4, 64, [5, 1, 131, 17, 66], [0, 9, 3, 40, 0]),
    (4, 2, 36, [23, 50], [11, 0]),
    (6, 3, 100, [40], [7]),
]


@needs_cc
@pytest.mark.parametrize("extra", ATTN_VARIANTS)
@pytest.mark.parametrize("heads,kv_heads,d,new,prefix", EXTEND_CASES)
def test_extend_attention_bf16_within_an_ulp(extra, heads, kv_heads, d, new, prefix):
    check_extend_bf16(cpu_extend_attention.load(extra), heads, kv_heads, d, new, prefix, seed=1)


def check_extend_bf16(fn, heads: int, kv_heads: int, d: int, new, prefix, seed: int) -> None:
    """An extend kernel's bfloat16 output within an ulp of the float64 reference."""
    lens = [n + p for n, p in zip(new, prefix, strict=True)]
    q, k_pool, v_pool, table, req_slots = _pools(lens, kv_heads, d, sum(new), heads, seed=seed)
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    pre = torch.tensor(prefix, dtype=torch.int32)
    out = fn(q, k_pool, v_pool, table, req_slots, qo, pre, d**-0.5)
    ref = cpu_extend_attention.extend_attention_ref(
        q.double(), k_pool.double(), v_pool.double(), table, req_slots, qo, pre, d**-0.5
    )
    assert out.dtype == torch.bfloat16
    within_ulp(out, ref, torch.bfloat16)


ROWS_CASES = [
    (4, 2, 48, [5, 5, 1], [350, 10, 0]),  # verify steps of the default model
    (14, 2, 64, [3, 1], [50, 0]),
    (4, 4, 36, [4, 2], [9, 31]),
    (16, 2, 128, [4], [300]),
]


@needs_cc
@pytest.mark.parametrize("extra", [*ATTN_VARIANTS, pytest.param(NO_AVX2, id="portable")])
@pytest.mark.parametrize("heads,kv_heads,d,new,prefix", ROWS_CASES)
def test_rows_attention_bf16_within_an_ulp(extra, heads, kv_heads, d, new, prefix):
    fn = cpu_decode_attention.load_rows(extra)
    check_extend_bf16(fn, heads, kv_heads, d, new, prefix, seed=2)


def test_attention_kernels_take_float32_and_bfloat16_only():
    q, k_pool, _, table, _ = _pools([3, 4], 4, 64, 2, 8)
    for mod in (cpu_decode_attention, cpu_extend_attention):
        assert mod.supports(q, k_pool, table)
        assert mod.supports(q.float(), k_pool.float(), table)
        assert not mod.supports(q.float(), k_pool, table)  # q and the pool of one dtype
        assert not mod.supports(q.half(), k_pool.half(), table)  # float16: torch's path


# ---- RADIXSERVE_CPU_ISA --------------------------------------------------------------------


def test_cpu_isa_names_narrower_builds(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_CPU_ISA", raising=False)
    assert _cc.isa_flags() == ()
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "avx2")
    assert _cc.isa_flags() == ("-mno-avx512f",)
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_ISA"):
        _cc.isa_flags()
