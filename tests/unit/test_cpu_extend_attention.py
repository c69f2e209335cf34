"""The C extend-attention kernel (kernels/cpu/extend_attention.py) against its PyTorch
reference (SDPA per request), and the torch backend with and without it."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from kernels.cpu import _cc
from kernels.cpu import extend_attention as cpu_extend_attention
from services.worker.attention.base import AttentionMeta
from services.worker.attention.torch_backend import TorchBackend

kernel = cpu_extend_attention.load()
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
DISABLED = os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0"
AVX2 = " avx2 " in f"{_cc.cpu_flags()} " and " fma " in f"{_cc.cpu_flags()} "
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="no C compiler, no AVX2/FMA or RADIXSERVE_CPU_KERNELS=0"
)


def test_kernel_builds_where_a_compiler_exists():
    """Only a machine without a compiler or AVX2/FMA (or with the kernels off) may skip."""
    if COMPILER is not None and not DISABLED and AVX2:
        assert kernel is not None, f"{COMPILER} is here but the kernel did not build (see log)"
    else:  # no compiler, kernels off, or a CPU without AVX2/FMA: the library has no kernel
        assert kernel is None


def run(*args: Any, fn=None, **kwargs: Any) -> torch.Tensor:
    fn = fn or kernel
    assert fn is not None
    return fn(*args, **kwargs)


# On an AVX-512 CPU the native build has the 16-lane tiles; the AVX2 ones are built beside
# it with -mno-avx512f, so that both stay tested wherever this runs.
AVX512 = "avx512f" in _cc.cpu_flags().split()
avx2_kernel = cpu_extend_attention.load(("-mno-avx512f",)) if kernel and AVX512 else None
VARIANTS = [pytest.param(None, id="native")] + (
    [pytest.param(avx2_kernel, id="avx2")] if avx2_kernel is not None else []
)


def test_both_vector_widths_build_on_an_avx512_cpu():
    if kernel is not None and AVX512:
        assert avx2_kernel is not None


def reference(*args: Any) -> torch.Tensor:
    return cpu_extend_attention.extend_attention_ref(*args)


def _case(
    heads: int, kv_heads: int, d: int, new: list[int], prefix: list[int], seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """One batch: pools with scattered slots (slot 0 the zero padding slot), a table with
    spare rows, q a view of a fused qkv tensor (rows not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + p for n, p in zip(new, prefix, strict=True)]
    slots_total = sum(lens) + 50
    k_pool = torch.randn(slots_total + 1, kv_heads, d, generator=g)
    v_pool = torch.randn(slots_total + 1, kv_heads, d, generator=g)
    k_pool[0] = v_pool[0] = 0
    perm = torch.randperm(slots_total, generator=g) + 1
    b = len(new)
    table = torch.zeros(b + 3, max(lens) + 7, dtype=torch.int32)
    req_slots = torch.randperm(b + 3, generator=g)[:b].to(torch.int32)
    start = 0
    for i, n in enumerate(lens):
        table[int(req_slots[i]), :n] = perm[start : start + n].to(torch.int32)
        start += n
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), heads + 2 * kv_heads, d, generator=g)[:, :heads]
    return q, k_pool, v_pool, table, req_slots, qo, torch.tensor(prefix, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,d,new,prefix",
    [
        (8, 4, 64, [100], [0]),  # the peers' small model (group 2), no prefix
        (14, 2, 64, [70], [0]),  # Qwen2-0.5B's group of 7
        (4, 4, 64, [37], [0]),  # no grouping
        (8, 4, 64, [45], [130]),  # on a cached prefix
        (14, 2, 64, [1], [0]),  # a one-token prompt
        (14, 2, 64, [1], [77]),  # one new row on a prefix
        (8, 4, 64, [5, 1, 131, 17, 66], [0, 9, 3, 40, 0]),  # several requests, odd lengths
        (4, 2, 36, [23, 50], [11, 0]),  # head dim not a multiple of the 6-lane tile
        (2, 1, 128, [90], [33]),
        (6, 3, 100, [40], [7]),  # head dim 6 x 16 + 4: both P.V tile widths' remainders
        (2, 2, 24, [19], [0]),
        # verify steps (1 + k rows on a prefix): every head's rows in one tile, some tiles
        # straddling two heads (group 7 x 5 rows = 35 lanes)
        (4, 2, 48, [5, 5, 5, 2, 5, 1], [200, 3, 50, 1, 120, 7]),
        (14, 2, 64, [5, 3, 2], [40, 90, 0]),
        (8, 2, 64, [7], [33]),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fn", VARIANTS)
def test_kernel_matches_reference(heads, kv_heads, d, new, prefix, threads, fn):
    case = _case(heads, kv_heads, d, new, prefix)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run(*case, 0.125, fn=fn)
    finally:
        torch.set_num_threads(old)
    ref = reference(*case, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_q", [16, 32, 48, 144, 256])
def test_query_blocks_split_requests_exactly(block_q):
    """Rows split into blocks of block_q query rows (and the last, shorter one) give the
    same result as the reference, whatever the block size."""
    case = _case(8, 4, 64, [300, 16, 33], [20, 0, 65], seed=1)
    out = run(*case, 0.125, block_q=block_q)
    ref = reference(*case, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_work_items_grow_with_the_rows_but_stay_many_enough_for_the_threads():
    from kernels.cpu.extend_attention import MAX_LANES, MAX_ROWS, block_rows

    assert block_rows(2, 2048, 4, 2) == MAX_ROWS  # a long chunk: the largest items
    assert block_rows(7, 2048, 2, 2) * 7 <= MAX_LANES  # a large group: lanes capped
    for rows, threads in [(200, 2), (2048, 16), (5, 64), (1, 1)]:
        b = block_rows(2, rows, 4, threads)
        assert 16 <= b <= MAX_ROWS
        # Halved until each thread has 4 items, or the items reached 16 rows.
        assert b == 16 or 4 * -(-rows // b) >= 4 * threads


@needs_kernel
@pytest.mark.parametrize("fn", VARIANTS)
def test_large_scores_do_not_overflow(fn):
    """Scores of several hundred (large q and k): the online softmax stays finite and
    close to a float64 reference (a score's float32 rounding alone moves it ~1e-5)."""
    q, k_pool, v_pool, *rest = _case(8, 4, 64, [60], [50], seed=2)
    q, k_pool = q * 10, k_pool * 10
    out = run(q, k_pool, v_pool, *rest, 0.125, fn=fn)
    ref = reference(q.double(), k_pool.double(), v_pool.double(), *rest, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_writes_only_its_requests_rows_of_out():
    """With out given, the rows of requests outside the call stay as they were."""
    q, k_pool, v_pool, table, req_slots, qo, prefix = _case(8, 4, 64, [10, 7, 1], [0, 4, 9])
    out = torch.full(q.shape, 7.0)
    run(q, k_pool, v_pool, table, req_slots[:2], qo[:3], prefix[:2], 0.125, out=out)
    ref = reference(q, k_pool, v_pool, table, req_slots, qo, prefix, 0.125)
    torch.testing.assert_close(out[:17], ref[:17], rtol=1e-5, atol=1e-5)
    assert (out[17:] == 7.0).all()


def test_supports_only_float32_cpu_with_an_int32_table():
    q, k_pool, _, table, *_ = _case(8, 4, 64, [3], [0])
    assert cpu_extend_attention.supports(q, k_pool, table)
    assert not cpu_extend_attention.supports(q.half(), k_pool.half(), table)
    assert not cpu_extend_attention.supports(q, k_pool, table.long())
    assert not cpu_extend_attention.supports(q, k_pool.transpose(1, 2), table)
    big = torch.zeros(2, 1, cpu_extend_attention.MAX_HEAD_DIM + 8)
    assert not cpu_extend_attention.supports(big, big, table)


def test_kernel_off_by_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
    cpu_extend_attention.load.cache_clear()
    try:
        assert cpu_extend_attention.load() is None
    finally:
        cpu_extend_attention.load.cache_clear()


def _extend_meta(table, req_slots, qo, prefix) -> AttentionMeta:
    new = qo[1:] - qo[:-1]
    lens = prefix + new
    rows = zip(req_slots.tolist(), lens.tolist(), new.tolist(), strict=True)
    return AttentionMeta(
        is_decode=False,
        out_slots=torch.cat([table[r, n - e : n] for r, n, e in rows]).long(),
        qo_indptr=qo,
        req_to_token=table,
        req_slots=req_slots,
        prefix_lens=prefix,
        extend_lens=new,
        seq_lens=lens,
        max_seq_len=int(lens.max()),
        max_extend_len=int(new.max()),
    )


@needs_kernel
@pytest.mark.parametrize(
    "new,prefix",
    [
        ([30, 12, 9], [0, 0, 0]),  # a cold prefill batch
        ([30, 12, 1, 1], [0, 25, 60, 3]),  # a mixed batch: two chunks, then two decodes
        ([1, 1], [5, 0]),  # one-row requests only
    ],
)
def test_backend_paths_agree(monkeypatch, new, prefix):
    """The same extend batch through the backend with the extend kernel, with the SDPA
    path (no kernels) and with the SDPA fallback (the kernel cannot read the tensors)."""
    case = _case(14, 2, 64, new, prefix, seed=4)
    q, k_pool, v_pool, table, req_slots, qo, pre = case
    meta = _extend_meta(table, req_slots, qo, pre)
    k_new, v_new = k_pool[meta.out_slots].clone(), v_pool[meta.out_slots].clone()
    outs = {}
    for name, use, readable in [("kernel", True, True), ("torch", False, True),
                                ("fallback", True, False)]:  # fmt: skip
        monkeypatch.setattr(TorchBackend, "use_cpu_kernel", use)
        if not readable:
            monkeypatch.setattr(cpu_extend_attention, "supports", lambda *a: False)
        backend = TorchBackend(14, 2, 64, 0.125)
        assert (backend._extend_kernel is not None) == use
        backend.prepare(meta)
        outs[name] = backend.forward(q, k_new, v_new, k_pool, v_pool, meta)
    ref = reference(*case, 0.125)
    for out in outs.values():
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rows_that_see_no_key_give_zeros_as_sdpa():
    """An inconsistent batch (prefix -2: rows at positions -2, -1, 0) gives zeros for the
    rows before the context's first key, as SDPA does for fully masked rows."""
    q, k_pool, v_pool, table, req_slots, qo, _ = _case(8, 4, 64, [3], [0])
    prefix = torch.tensor([-2], dtype=torch.int32)
    out = run(q, k_pool, v_pool, table, req_slots, qo, prefix, 0.1)
    assert (out[:2] == 0).all()
    first = int(table[int(req_slots[0]), 0])  # the one key row 2 sees
    torch.testing.assert_close(out[2], v_pool[first].repeat_interleave(2, 0))
