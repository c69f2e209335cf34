"""The C decode-attention kernel (kernels/cpu/decode_attention.py) against its PyTorch
reference, and the torch backend with and without it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels.cpu import _cc
from kernels.cpu import decode_attention as cpu_decode_attention
from kernels.cpu.extend_attention import extend_attention_ref
from services.worker.attention.base import AttentionMeta
from services.worker.attention.torch_backend import TorchBackend

kernel = cpu_decode_attention.load()
# Only a machine without a C compiler (or RADIXSERVE_CPU_KERNELS=0) may skip: where one
# exists, a kernel that fails to build fails test_kernel_builds_where_a_compiler_exists.
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
DISABLED = os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0"
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="no C compiler on PATH or RADIXSERVE_CPU_KERNELS=0"
)


# The native build has the widest vectors this CPU has; the narrower variants (AVX2, plain
# C) are built beside it where the CPU has more, so that every one stays tested.
FLAGS = set(_cc.cpu_flags().split())
NARROWER = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx2",)}
VARIANTS = [pytest.param(None, id="native")] + [
    pytest.param(cpu_decode_attention.load(extra), id=name)
    for name, extra in NARROWER.items()
    if kernel is not None and ("avx512f" in FLAGS or (name == "portable" and "avx2" in FLAGS))
]


def test_kernel_builds_where_a_compiler_exists():
    if COMPILER is not None and not DISABLED:
        assert kernel is not None, f"{COMPILER} is here but the kernel did not build (see log)"
    else:
        assert kernel is None


def _case(b: int, heads: int, kv_heads: int, d: int, lens: list[int], seed: int = 0):
    """Pools with scattered slots (slot 0 the zero padding slot), a table with spare rows."""
    g = torch.Generator().manual_seed(seed)
    slots_total = sum(lens) + 50
    k_pool = torch.randn(slots_total + 1, kv_heads, d, generator=g)
    v_pool = torch.randn(slots_total + 1, kv_heads, d, generator=g)
    k_pool[0] = v_pool[0] = 0
    perm = torch.randperm(slots_total, generator=g) + 1
    table = torch.zeros(b + 3, max(lens) + 7, dtype=torch.int32)
    req_slots = torch.randperm(b + 3, generator=g)[:b].to(torch.int32)
    start = 0
    for i, n in enumerate(lens):
        table[int(req_slots[i]), :n] = perm[start : start + n].to(torch.int32)
        start += n
    # q as the model hands it: a view of a fused [B, H + 2 KVH, D] tensor (rows not contiguous).
    q = torch.randn(b, heads + 2 * kv_heads, d, generator=g)[:, :heads]
    return q, k_pool, v_pool, table, req_slots, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,d,lens",
    [
        (8, 4, 64, [1, 7, 300, 64]),  # the peers' small model, a one-token context
        (14, 2, 64, [129, 33]),  # Qwen2-0.5B's group of 7; fewer requests than threads
        (4, 4, 36, [5, 40, 17, 2, 90]),  # no grouping; head dim not a multiple of 8
        (16, 2, 128, [513]),
        (8, 4, 64, [2000, 15, 16, 17]),  # a long context; tails around the 16-lane vector
        (16, 1, 64, [40, 3]),  # one kv head of 16: the P.V tiles cut 5 + 5 + 6
        (14, 2, 128, [31, 200, 1]),  # a group of 7 at head dim 128: tiles of 2 + 2 + 3
        (4, 2, 256, [50, 17]),  # head dim 256: the per-slot path (no register tiles)
        (4, 2, 48, [350, 1, 17]),  # the default model's head dim: tiles of 3 vectors
        (10, 1, 32, [70, 16]),  # head dim 32: 10 heads of one kv head cut 5 + 5
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fn", VARIANTS)
def test_kernel_matches_reference(heads, kv_heads, d, lens, threads, fn):
    fn = fn or kernel
    assert fn is not None, "a narrower variant failed to build"
    case = _case(len(lens), heads, kv_heads, d, lens)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fn(*case, 0.125)
    finally:
        torch.set_num_threads(old)
    ref = cpu_decode_attention.decode_attention_ref(*case, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("fn", VARIANTS)
def test_large_scores_stay_finite_and_exact(fn):
    """Scores of several hundred: exp(s - max) underflows to exactly 0 for most keys and
    the result still matches a float64 reference."""
    fn = fn or kernel
    q, k_pool, v_pool, *rest = _case(3, 8, 4, 64, [90, 33, 301], seed=3)
    q, k_pool = q * 12, k_pool * 12
    out = fn(q, k_pool, v_pool, *rest, 0.125)
    ref = cpu_decode_attention.decode_attention_ref(
        q.double(), k_pool.double(), v_pool.double(), *rest, 0.125
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


ROWS_VARIANTS = [pytest.param(None, id="native")] + [
    pytest.param(cpu_decode_attention.load_rows(extra), id=name)
    for name, extra in NARROWER.items()
    if kernel is not None and ("avx512f" in FLAGS or (name == "portable" and "avx2" in FLAGS))
]


def _rows_case(heads: int, kv_heads: int, d: int, new: list[int], prefix: list[int]):
    """Request b's last new[b] positions as query rows over prefix[b] cached ones; q's rows
    start at 3 (other requests' rows before them) and are a strided view, as the model's."""
    lens = [n + p for n, p in zip(new, prefix, strict=True)]
    _, k_pool, v_pool, table, req_slots, _ = _case(len(lens), heads, kv_heads, d, lens, seed=7)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3 + sum(new), heads + 2 * kv_heads, d, generator=g)[:, :heads]
    qo = torch.tensor([3, *(3 + torch.tensor(new).cumsum(0)).tolist()], dtype=torch.int32)
    return q, k_pool, v_pool, table, req_slots, qo, torch.tensor(prefix, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,d,new,prefix",
    [
        (4, 2, 48, [5, 5, 1, 3], [350, 10, 0, 77]),  # verify steps of the default model
        (8, 4, 64, [2, 5], [100, 3]),
        (14, 2, 64, [3, 1], [50, 0]),  # 21 lanes per kv head: P.V tiles 6 + 5 + 5 + 5
        (4, 4, 36, [4, 2], [9, 31]),  # head dim off the vectors: the per-slot path
        (16, 2, 128, [4], [300]),
        (4, 2, 32, [9], [20]),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fn", ROWS_VARIANTS)
def test_rows_kernel_matches_the_extend_reference(heads, kv_heads, d, new, prefix, threads, fn):
    """Several causal rows per request (a verify step): row r sees the prefix and rows up
    to r. The rows before qo_indptr[0] are left as they were in `out`."""
    fn = fn or cpu_decode_attention.load_rows()
    assert fn is not None, "a narrower variant failed to build"
    q, k_pool, v_pool, table, req_slots, qo, prefix_t = _rows_case(heads, kv_heads, d, new, prefix)
    out = torch.full(q.shape, 7.0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn(q, k_pool, v_pool, table, req_slots, qo, prefix_t, 0.125, out=out)
    finally:
        torch.set_num_threads(old)
    ref = extend_attention_ref(q, k_pool, v_pool, table, req_slots, qo, prefix_t, 0.125)
    torch.testing.assert_close(out[3:], ref[3:], rtol=1e-5, atol=1e-5)
    assert (out[:3] == 7.0).all()


def test_supports_only_float32_cpu_with_an_int32_table():
    q, k_pool, _, table, _, _ = _case(2, 8, 4, 64, [3, 4])
    assert cpu_decode_attention.supports(q, k_pool, table)
    assert not cpu_decode_attention.supports(q.half(), k_pool.half(), table)
    assert not cpu_decode_attention.supports(q, k_pool, table.long())
    assert not cpu_decode_attention.supports(q, k_pool.transpose(1, 2), table)


def test_kernel_off_by_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
    cpu_decode_attention._library.cache_clear()  # the one library both entries come from
    try:
        assert cpu_decode_attention.load() is None
        assert cpu_decode_attention.load_rows() is None
    finally:
        cpu_decode_attention._library.cache_clear()


def _decode_meta(table, req_slots, lens) -> AttentionMeta:
    b = len(lens)
    ones = torch.ones(b, dtype=torch.int32)
    return AttentionMeta(
        is_decode=True,
        out_slots=torch.stack(
            [table[int(r), int(n) - 1] for r, n in zip(req_slots, lens, strict=True)]
        ).long(),
        qo_indptr=torch.arange(b + 1, dtype=torch.int32),
        req_to_token=table,
        req_slots=req_slots,
        prefix_lens=lens - ones,
        extend_lens=ones,
        seq_lens=lens,
        max_seq_len=int(lens.max()),
        max_extend_len=1,
    )


@needs_kernel
def test_backend_kernel_and_gather_paths_agree(monkeypatch):
    """The same decode batch through the backend with the kernel and with the torch gather
    path (which other dtypes and machines without a compiler take)."""
    q, k_pool, v_pool, table, req_slots, lens = _case(5, 8, 4, 64, [9, 1, 120, 33, 64])
    meta = _decode_meta(table, req_slots, lens)
    k_new = k_pool[meta.out_slots].clone()  # store what is already there: the pools stay equal
    v_new = v_pool[meta.out_slots].clone()
    outs = []
    for use in (True, False):
        monkeypatch.setattr(TorchBackend, "use_cpu_kernel", use)
        backend = TorchBackend(8, 4, 64, 0.125)
        assert (backend._kernel is not None) == use
        backend.prepare(meta)
        outs.append(backend.forward(q, k_new, v_new, k_pool, v_pool, meta))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    ref = cpu_decode_attention.decode_attention_ref(
        q, k_pool, v_pool, table, req_slots, lens, 0.125
    )
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


def _mixed_meta(table, req_slots, lens, new_rows) -> AttentionMeta:
    """An extend batch: request b computes its last new_rows[b] positions (a mixed batch:
    prefill chunks first, then one-row decodes)."""
    new = torch.tensor(new_rows, dtype=torch.int32)
    qo = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(new, 0)
    rows = zip(req_slots.tolist(), lens.tolist(), new.tolist(), strict=True)
    out = [table[r, n - e : n] for r, n, e in rows]
    return AttentionMeta(
        is_decode=False,
        out_slots=torch.cat(out).long(),
        qo_indptr=qo,
        req_to_token=table,
        req_slots=req_slots,
        prefix_lens=lens - new,
        extend_lens=new,
        seq_lens=lens,
        max_seq_len=int(lens.max()),
        max_extend_len=int(new.max()),
    )


@needs_kernel
@pytest.mark.parametrize("new_rows", [[40, 1, 1, 1], [5, 3, 1, 1], [1, 1, 1, 1], [7, 2, 3, 4]])
def test_mixed_batch_decodes_through_the_kernel(monkeypatch, new_rows):
    """A mixed batch's one-row requests go to the kernel together; the result equals the
    per-request SDPA path (no kernel) and the fallback when the kernel cannot read q."""
    lens = [60, 33, 1, 120]
    _, k_pool, v_pool, table, req_slots, lens_t = _case(4, 8, 4, 64, lens, seed=3)
    meta = _mixed_meta(table, req_slots, lens_t, new_rows)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(int(meta.qo_indptr[-1]), 8, 64, generator=g)
    k_new, v_new = k_pool[meta.out_slots].clone(), v_pool[meta.out_slots].clone()
    outs = {}
    for name, use, readable in [("kernel", True, True), ("torch", False, True),
                                ("fallback", True, False)]:  # fmt: skip
        monkeypatch.setattr(TorchBackend, "use_cpu_kernel", use)
        if not readable:
            monkeypatch.setattr(cpu_decode_attention, "supports", lambda *a: False)
        backend = TorchBackend(8, 4, 64, 0.125)
        backend.prepare(meta)
        if use:  # the kernel takes the trailing run of one-row requests
            trailing = len(new_rows) - next(
                (i + 1 for i in reversed(range(len(new_rows))) if new_rows[i] != 1), 0
            )
            assert (backend._singles[1] if backend._singles else 0) == trailing
        outs[name] = backend.forward(q, k_new, v_new, k_pool, v_pool, meta)
    torch.testing.assert_close(outs["kernel"], outs["torch"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["fallback"], outs["torch"], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("new_rows,kernel_name", [([5, 3, 5], "_rows_kernel"),
                                                   ([5, 30, 1], "_extend_kernel")])  # fmt: skip
def test_verify_shaped_extends_take_the_rows_kernel(monkeypatch, new_rows, kernel_name):
    """Requests of a few rows each (MAX_LANES rows x group) go to the rows kernel, a longer
    one sends the batch to the extend kernel; both equal the per-request SDPA path."""
    lens = [60, 40, 120]
    _, k_pool, v_pool, table, req_slots, lens_t = _case(3, 8, 4, 64, lens, seed=4)
    meta = _mixed_meta(table, req_slots, lens_t, new_rows)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(int(meta.qo_indptr[-1]), 8, 64, generator=g)
    k_new, v_new = k_pool[meta.out_slots].clone(), v_pool[meta.out_slots].clone()
    outs, called = {}, []
    for use in (True, False):
        monkeypatch.setattr(TorchBackend, "use_cpu_kernel", use)
        backend = TorchBackend(8, 4, 64, 0.125)
        backend.prepare(meta)
        if use:
            fn = getattr(backend, kernel_name)
            setattr(backend, kernel_name, lambda *a, fn=fn, **k: called.append(1) or fn(*a, **k))
        outs[use] = backend.forward(q, k_new, v_new, k_pool, v_pool, meta)
    assert called, f"{kernel_name} was not called"
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
