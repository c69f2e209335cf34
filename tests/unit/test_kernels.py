"""The Triton kernels of kernels/ against their PyTorch references, and the references against
a dense attention computed independently (torch SDPA with an explicit mask, float64).

Without CUDA the kernels run in Triton's interpreter on CPU (slow: small shapes only). On a
GPU machine the same tests run compiled (TRITON_INTERPRET, if set, is honoured), plus a
CUDA-graph replay of decode and bfloat16 cases.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.triton.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from kernels.triton.extend_attention import extend_attention, extend_attention_ref  # noqa: E402
from kernels.triton.kv_store import store_kv, store_kv_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# float32: kernel vs reference within 2e-3 absolute (both accumulate in float32; the
# difference is summation order). bfloat16 (GPU only): inputs rounded, P rounded before P@V.
TOL = {
    torch.float32: dict(atol=2e-3, rtol=2e-3),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]
HEAD_DIMS = [24, 64, 128] if ON_GPU else [16, 24]  # 24: padded to 32 inside the kernels


@dataclass
class Batch:
    """A ragged batch over a pool whose slots are shuffled and leave gaps."""

    k_pool: torch.Tensor  # [S, Hkv, D]
    v_pool: torch.Tensor
    qo_indptr: torch.Tensor  # [B+1] int32
    req_to_token: torch.Tensor  # [R, C] int32: more rows than requests, noise past each length
    req_slots: torch.Tensor  # [B] int32: each request's row (shuffled)
    seq_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # per request [L_b, Hkv, D], position order
    dense_v: list[torch.Tensor]


def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_slots = sum(seq_lens) + 1 + 13  # slot 0 is padding; 13 slots no request uses
    # Pool filled with noise: a kernel reading a wrong slot gets a wrong answer.
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = (torch.randperm(num_slots - 1, generator=g) + 1)[: sum(seq_lens)]
    dense_k = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    dense_v = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n)
    for b in range(len(seq_lens)):
        k_pool[slots[offsets[b] : offsets[b + 1]]] = dense_k[b]
        v_pool[slots[offsets[b] : offsets[b + 1]]] = dense_v[b]
    qo = [0]
    for e in extend_lens:
        qo.append(qo[-1] + e)
    # Table rows in shuffled order; every entry past a request's length names a real slot of
    # another request, so reading beyond the length gives a wrong answer, not a zero.
    num_rows = len(seq_lens) + 3
    rows = torch.randperm(num_rows, generator=g)[: len(seq_lens)]
    table = slots[torch.randint(len(slots), (num_rows, max(seq_lens) + 5), generator=g)]
    for b in range(len(seq_lens)):
        table[rows[b], : seq_lens[b]] = slots[offsets[b] : offsets[b + 1]]

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    return Batch(
        k_pool.to(DEVICE),
        v_pool.to(DEVICE),
        i32(qo),
        table.to(device=DEVICE, dtype=torch.int32),
        rows.to(device=DEVICE, dtype=torch.int32),
        i32(seq_lens),
        i32(prefix_lens),
        [t.to(DEVICE) for t in dense_k],
        [t.to(DEVICE) for t in dense_v],
    )


def dense_attention(
    q: torch.Tensor, batch: Batch, extend_lens: list[int], sm_scale: float
) -> torch.Tensor:
    """Independent check of the references: SDPA, float64, per request, explicit mask."""
    out, row = [], 0
    for b, e in enumerate(extend_lens):
        k, v = batch.dense_k[b].double(), batch.dense_v[b].double()  # [L, Hkv, D]
        qb = q[row : row + e].double()  # [E, Hq, D]
        row += e
        prefix = k.shape[0] - e
        mask = torch.ones(e, k.shape[0], dtype=torch.bool, device=q.device).tril(diagonal=prefix)
        ob = F.scaled_dot_product_attention(
            qb.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=sm_scale,
            enable_gqa=True,
        )
        out.append(ob.transpose(0, 1))  # [E, Hq, D]
    return torch.cat(out).to(q.dtype)


# (prefix_lens, extend_lens): prefixes of 0, 1 and many tokens; new parts that cross tiles.
RAGGED = [
    ([0, 1, 37], [5, 17, 9]),
    ([50, 0], [1, 40]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (7, 1)])  # (Hq, Hkv): GQA ratios 1, 2, 7
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_extend_matches_reference_and_dense(case, heads, head_dim, dtype):
    prefix_lens, extend_lens = RAGGED[case]
    hq, hkv = heads
    batch = make_batch(prefix_lens, extend_lens, hkv, head_dim, dtype, seed=case)
    q = (
        torch.randn(sum(extend_lens), hq, head_dim, generator=torch.Generator().manual_seed(9))
        .to(dtype)
        .to(DEVICE)
    )
    sm_scale = head_dim**-0.5
    args = (
        q,
        batch.k_pool,
        batch.v_pool,
        batch.qo_indptr,
        batch.req_to_token,
        batch.req_slots,
        batch.prefix_lens,
        sm_scale,
        max(extend_lens),
    )
    ref = extend_attention_ref(*args)
    torch.testing.assert_close(
        ref.double(), dense_attention(q, batch, extend_lens, sm_scale).double(), **TOL[dtype]
    )
    # 16x16 tiles: several row blocks per request, several key blocks per row block.
    tiles = [dict(block_m=16, block_n=16)] + ([dict()] if ON_GPU else [])
    for tile in tiles:
        out = extend_attention(*args, **tile)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_extend_tile_shapes_agree():
    """Default tiles, 32x16 tiles (two key blocks on the diagonal) and 16x16 give one answer."""
    prefix_lens, extend_lens = [3, 0], [45, 20]
    batch = make_batch(prefix_lens, extend_lens, 2, 32, torch.float32, seed=5)
    q = torch.randn(sum(extend_lens), 4, 32).to(DEVICE)
    args = (
        q,
        batch.k_pool,
        batch.v_pool,
        batch.qo_indptr,
        batch.req_to_token,
        batch.req_slots,
        batch.prefix_lens,
        32**-0.5,
        max(extend_lens),
    )
    ref = extend_attention_ref(*args)
    for tile in (dict(), dict(block_m=32, block_n=16), dict(block_m=16, block_n=16)):
        torch.testing.assert_close(extend_attention(*args, **tile), ref, **TOL[torch.float32])


def test_extend_reads_strided_query_view():
    """The model hands q as a view of the fused qkv output (row stride > Hq * D)."""
    batch = make_batch([4], [6], 1, 16, torch.float32, seed=6)
    qkv = torch.randn(6, 3 * 2 * 16).to(DEVICE)
    q = qkv[:, : 2 * 16].view(6, 2, 16)  # q: [T, Hq, D], not contiguous
    args = (
        q,
        batch.k_pool,
        batch.v_pool,
        batch.qo_indptr,
        batch.req_to_token,
        batch.req_slots,
        batch.prefix_lens,
        0.25,
        6,
    )
    torch.testing.assert_close(
        extend_attention(*args), extend_attention_ref(*args), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (7, 1)])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_matches_reference_and_dense(num_kv_splits, heads, head_dim, dtype):
    # Context of 1 token (3 of the 4 splits empty), a short one and one spanning several tiles.
    seq_lens = [1, 6, 70]
    hq, hkv = heads
    batch = make_batch(
        [n - 1 for n in seq_lens], [1] * len(seq_lens), hkv, head_dim, dtype, seed=num_kv_splits
    )
    q = (
        torch.randn(len(seq_lens), hq, head_dim, generator=torch.Generator().manual_seed(3))
        .to(dtype)
        .to(DEVICE)
    )
    sm_scale = head_dim**-0.5
    args = (
        q,
        batch.k_pool,
        batch.v_pool,
        batch.req_to_token,
        batch.req_slots,
        batch.seq_lens,
        sm_scale,
    )
    ref = decode_attention_ref(*args)
    torch.testing.assert_close(
        ref.double(),
        dense_attention(q, batch, [1] * len(seq_lens), sm_scale).double(),
        **TOL[dtype],
    )
    out = decode_attention(*args, num_kv_splits=num_kv_splits, block_n=16)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_decode_split_counts_agree():
    """More splits than tokens, and non-power-of-2 split counts, change nothing."""
    batch = make_batch([40, 2], [1, 1], 2, 16, torch.float32, seed=7)
    q = torch.randn(2, 4, 16).to(DEVICE)
    args = (
        q,
        batch.k_pool,
        batch.v_pool,
        batch.req_to_token,
        batch.req_slots,
        batch.seq_lens,
        0.25,
    )
    ref = decode_attention_ref(*args)
    for splits in (3, 7, 64):
        torch.testing.assert_close(
            decode_attention(*args, num_kv_splits=splits), ref, **TOL[torch.float32]
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_given_slots(dtype):
    g = torch.Generator().manual_seed(11)
    k_pool = torch.randn(40, 3, 24, generator=g).to(dtype).to(DEVICE)
    v_pool = torch.randn(40, 3, 24, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([17, 3, 39, 8, 22], device=DEVICE)
    kv = torch.randn(5, 2, 3, 24, generator=g).to(DEVICE)  # float32 source: stored cast to dtype
    k, v = kv[:, 0], kv[:, 1]  # strided views, like the model's
    want_k, want_v = k_pool.clone(), v_pool.clone()
    store_kv_ref(want_k, want_v, slots, k, v)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    # The reference itself: exactly the given slots changed, to the cast inputs.
    assert torch.equal(want_k[slots], k.to(dtype)) and torch.equal(want_v[slots], v.to(dtype))
    assert torch.equal(want_k[untouched], k_pool[untouched]) and torch.equal(
        want_v[untouched], v_pool[untouched]
    )
    store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_paths_match_the_references(dtype):
    """The GPU's serving dtypes through every attention kernel at small shapes: on CPU under
    the interpreter (whose bfloat16 dots kernels/triton/_triton.py makes right), on a GPU compiled.
    The references compute in float32 from the same rounded inputs."""
    batch = make_batch([0, 9], [7, 12], 2, 32, dtype, seed=12)
    q = torch.randn(19, 4, 32, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    common = (batch.k_pool, batch.v_pool)
    ext = (q, *common, batch.qo_indptr, batch.req_to_token, batch.req_slots, batch.prefix_lens)
    ext_args = (*ext, 32**-0.5, 12)
    got = extend_attention(*ext_args, block_m=16, block_n=16)
    torch.testing.assert_close(got.float(), extend_attention_ref(*ext_args).float(), **TOL[dtype])
    dec = make_batch([0, 40], [1, 1], 2, 32, dtype, seed=13)
    qd = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    dec_args = (qd, dec.k_pool, dec.v_pool, dec.req_to_token, dec.req_slots, dec.seq_lens, 0.2)
    got = decode_attention(*dec_args, num_kv_splits=2, block_n=16)
    torch.testing.assert_close(got.float(), decode_attention_ref(*dec_args).float(), **TOL[dtype])
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    want_k, want_v = k_pool.clone(), v_pool.clone()
    slots = torch.tensor([5, 1, 30], device=DEVICE)
    k, v = (torch.randn(3, 2, 32).to(DEVICE) for _ in range(2))  # float32: cast on the way
    store_kv_ref(want_k, want_v, slots, k, v)
    store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_with_new_contexts():
    """One capture, replayed with other table rows and lengths (longer contexts)."""
    hq, hkv, d, bs, cap = 8, 2, 64, 3, 300
    first = make_batch([4, 9, 1], [1, 1, 1], hkv, d, torch.float16, seed=1)
    second = make_batch([250, 3, 120], [1, 1, 1], hkv, d, torch.float16, seed=2)
    pool_k = torch.zeros(1000, hkv, d, dtype=torch.float16, device=DEVICE)
    pool_v = torch.zeros_like(pool_k)
    q = torch.randn(bs, hq, d, dtype=torch.float16, device=DEVICE)
    table = torch.zeros(bs + 3, cap, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(bs, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(bs, dtype=torch.int32, device=DEVICE)
    args = (q, pool_k, pool_v, table, rows, lens, 0.125)

    def load(batch):
        pool_k[: batch.k_pool.shape[0]] = batch.k_pool
        pool_v[: batch.v_pool.shape[0]] = batch.v_pool
        table[:, : batch.req_to_token.shape[1]] = batch.req_to_token
        rows.copy_(batch.req_slots)
        lens.copy_(batch.seq_lens)

    load(first)
    decode_attention(*args, 8)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*args, 8)
    for batch in (first, second):
        load(batch)
        graph.replay()
        ref = decode_attention_ref(*args)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
