"""Decode attention over a paged KV pool: one query token per request (flash-decoding).

Shapes: decode_attention's signature, Hq = g * Hkv. Request b's context is the KV slots
req_to_token[req_slots[b], :seq_lens[b]], its new token's K/V already stored.
Stage 1: a program per (request, KV head, split of the context) serves the g query heads of
that KV head (each K/V row read once) and writes the split's output and log2-sum-exp to
float32 scratch [B, Hq, num_kv_splits, R] (LSE in column D; R = D + 1 rounded up to 16 floats,
aligned rows). Stage 2 merges the splits. Grids and arguments depend only on shapes and
``num_kv_splits`` (rows and lengths are read on the device), so CUDA graphs replay them.
"""

from __future__ import annotations

import math

import torch

from kernels.triton._triton import check_head_dim_contiguous, dot_precision, sm_major, tl, triton
from kernels.triton.extend_attention import _attend_block


@triton.jit(do_not_specialize=["group", "num_splits"])  # one compiled kernel for all of them
def _decode_split_kernel(
    Q,
    K,
    V,
    Scratch,
    ReqToToken,
    ReqSlots,
    SeqLens,
    qk_scale,
    stride_rt,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_sh,
    stride_ss,
    group,
    num_splits,  # Hq // Hkv; splits per context
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_slots = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_rt
    seq_len = tl.load(SeqLens + b)
    split_len = (seq_len + num_splits - 1) // num_splits
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)  # lo >= hi: an empty split (short context)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < group
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * group + offs_h
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_ok, other=0.0
    )

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < hi
        slots = tl.load(ctx_slots + cols, mask=col_ok, other=0)
        acc, l_i, m_i = _attend_block(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            slots,
            col_ok,
            col_ok[None, :],
            kv_head,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            offs_d,
            d_ok,
            qk_scale,
            DOT_PRECISION,
        )

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    base = Scratch + b * stride_sb + heads * stride_sh + split * stride_ss  # [BLOCK_H]
    tl.store(base[:, None] + offs_d[None, :], out, mask=hd_ok)
    tl.store(base + HEAD_DIM, lse, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    Scratch,
    Out,
    stride_sb,
    stride_sh,
    stride_ss,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = Scratch + b * stride_sb + head * stride_sh + offs_s * stride_ss  # [BLOCK_S]
    lse = tl.load(base + HEAD_DIM, mask=offs_s < num_splits, other=float("-inf"))
    used = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # no split used (empty context): output zeros
    w = tl.where(used, tl.exp2(lse - m), 0.0)
    parts = tl.load(
        base[:, None] + offs_d[None, :],
        mask=used[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + b * stride_ob + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _launch_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of stage 1 for this device (tile_config on CUDA)."""
    if device.type != "cuda":
        return 32, 4, 1
    major = sm_major(device.index if device.index is not None else torch.cuda.current_device())
    return tile_config(head_dim, dtype, major)


def tile_config(head_dim: int, dtype: torch.dtype, major: int) -> tuple[int, int, int]:
    """Memory bound, so several K/V tiles in flight; halved for float32 wide heads (spills)."""
    if major < 8:
        return 32, 4, 1
    if dtype.itemsize >= 4:
        return (16, 4, 2) if head_dim > 64 else (32, 4, 2)
    return 64, 4, 3


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, C] int32
    req_slots: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32
    sm_scale: float,
    num_kv_splits: int,
    block_n: int | None = None,  # tile override (tests, tuning)
) -> torch.Tensor:  # [B, Hq, D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_head_dim_contiguous(q, k_pool, v_pool)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even if q is a view
    if batch == 0:
        return o
    group = num_heads // num_kv_heads
    bn, warps, stages = _launch_config(head_dim, q.dtype, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    # scratch[b, h, s, :D] = split s's output, scratch[b, h, s, D] = its log2-sum-exp
    row = -(-(head_dim + 1) // 16) * 16  # aligned rows (see the module docstring)
    scratch = torch.empty(
        batch, num_heads, num_kv_splits, row, dtype=torch.float32, device=q.device
    )
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_pool,
        v_pool,
        scratch,
        req_to_token,
        req_slots,
        seq_lens,
        sm_scale * math.log2(math.e),
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        scratch.stride(0),
        scratch.stride(1),
        scratch.stride(2),
        group,
        num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows on GPUs
        BLOCK_D=block_d,
        BLOCK_N=block_n or bn,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        scratch,
        o,
        scratch.stride(0),
        scratch.stride(1),
        scratch.stride(2),
        o.stride(0),
        o.stride(1),
        num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        BLOCK_D=block_d,
    )
    return o


def decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 1,
) -> torch.Tensor:
    """Plain-PyTorch reference of decode_attention (float32 math, one request at a time)."""
    o = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_slots[b]), : int(seq_lens[b])].long()
        kb = k_pool[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        vb = v_pool[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        scores = torch.einsum("hd,lhd->hl", q[b].float(), kb) * sm_scale
        o[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vb).to(q.dtype)
    return o
