"""Prefill ("extend") attention over a paged KV pool, for a ragged batch with cached prefixes.

Shapes: extend_attention's signature, Hq = g * Hkv. Request b's new tokens are q rows
qo_indptr[b]..[b+1]; its context (cached prefix, then new tokens, K/V all stored) is
req_to_token row req_slots[b] (position -> KV slot), and new row i sees positions
0 .. prefix_lens[b] + i. A program computes BLOCK_M new rows of one request and query head:
an online float32 softmax over BLOCK_N keys at a time, unmasked over the prefix and earlier
new blocks, causal on the diagonal block.
"""

from __future__ import annotations

import math

import torch

from kernels.triton._triton import check_head_dim_contiguous, dot_precision, sm_major, tl, triton


@triton.jit
def _attend_block(
    acc,
    l_i,
    m_i,
    q,  # running output [M, BD], sum [M], max [M]; q [M, BD]
    K,
    V,
    slots,
    col_ok,
    score_ok,  # slots [N] of the keys; col_ok [N]; score_ok [M or 1, N]
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    offs_d,
    d_ok,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the online softmax: folds BLOCK_N keys into (acc, l_i, m_i)."""
    slots = slots.to(tl.int64)  # slot * stride overflows int32 on large pools
    kv_ok = col_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    )
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    qk = tl.where(score_ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(
        V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["group"])  # one compiled kernel for every GQA ratio
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    QoIndptr,
    ReqToToken,
    ReqSlots,
    PrefixLens,
    qk_scale,
    stride_rt,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    group,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(QoIndptr + b)
    extend_len = tl.load(QoIndptr + b + 1) - q_start
    row_lo = block_m * BLOCK_M
    if row_lo >= extend_len:  # the grid covers the longest request; shorter ones stop here
        return
    prefix_len = tl.load(PrefixLens + b)
    ctx_slots = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_rt
    new_slots = ctx_slots + prefix_len

    offs_m = row_lo + tl.arange(0, BLOCK_M)  # row index among this request's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < extend_len
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # A finite start keeps fully masked rows at exp2(-inf - (-1e30)) = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Loop 1: the cached prefix, visible to every new row.
    for n0 in range(0, prefix_len, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < prefix_len
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
    # Loop 2: new tokens before this row block, visible to all its rows (BLOCK_M % BLOCK_N == 0).
    for n0 in range(0, row_lo, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < row_lo
        slots = tl.load(new_slots + cols, mask=col_ok, other=0)
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
    # Loop 3: the diagonal block, causal.
    row_hi = tl.minimum(row_lo + BLOCK_M, extend_len)
    for n0 in range(row_lo, row_hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < row_hi
        slots = tl.load(new_slots + cols, mask=col_ok, other=0)
        causal = col_ok[None, :] & (cols[None, :] <= offs_m[:, None])
        acc, l_i, m_i = _attend_block(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            slots,
            col_ok,
            causal,
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

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def _launch_config(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this device (tile_config on CUDA)."""
    if device.type != "cuda":
        return 32, 32, 4, 1  # interpreter: bigger tiles mean fewer slow Python steps
    major = sm_major(device.index if device.index is not None else torch.cuda.current_device())
    return tile_config(head_dim, dtype, major)


def tile_config(head_dim: int, dtype: torch.dtype, major: int) -> tuple[int, int, int, int]:
    """Tiles and pipeline depth that fit shared memory and registers; float32 ("ieee" dots on
    FMA units) needs far smaller tiles to avoid spills."""
    if major < 8:
        return 64, 32, 4, 1
    if dtype.itemsize >= 4:
        if head_dim > 64:
            return 16, 16, 4, 2
        return (64, 32, 4, 1) if head_dim <= 16 else (64, 32, 8, 1)
    if head_dim > 128:  # 16-bit D=256: half the tile
        return 64, 32, 4, 2
    return 128, 64, 8, (3 if major >= 9 else 2)


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1] int32
    req_to_token: torch.Tensor,  # [R, C] int32
    req_slots: torch.Tensor,  # [B] int32
    prefix_lens: torch.Tensor,  # [B] int32
    sm_scale: float,
    max_extend_len: int,
    block_m: int | None = None,  # tile overrides (tests, tuning); BLOCK_M % BLOCK_N == 0
    block_n: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_head_dim_contiguous(q, k_pool, v_pool)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even if q is a view
    batch = prefix_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_extend_len <= 0:
        return o
    bm, bn, warps, stages = _launch_config(head_dim, q.dtype, q.device)
    if block_m or block_n:
        bm, bn = block_m or bm, block_n or bn
        # 8 warps over a small tile only idle; 16-bit 16-row tiles spill on 4.
        if bm < 64:
            warps = 2 if bm <= 16 and q.dtype.itemsize < 4 else 4
    if bm % bn:
        raise ValueError(f"BLOCK_M={bm} must be a multiple of BLOCK_N={bn}")
    grid = (triton.cdiv(max_extend_len, bm), batch, num_heads)
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        o,
        qo_indptr,
        req_to_token,
        req_slots,
        prefix_lens,
        sm_scale * math.log2(math.e),
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        o.stride(0),
        o.stride(1),
        num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=bm,
        BLOCK_N=bn,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return o


def extend_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    qo_indptr: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
    max_extend_len: int = 0,
) -> torch.Tensor:
    """Plain-PyTorch reference of extend_attention (float32 math, one request at a time)."""
    o = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for b in range(prefix_lens.shape[0]):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        prefix = int(prefix_lens[b])
        slots = req_to_token[int(req_slots[b]), : prefix + q1 - q0].long()
        qb = q[q0:q1].float().transpose(0, 1)  # [Hq, E, D]
        kb = k_pool[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        vb = v_pool[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        rows = torch.arange(q1 - q0, device=q.device)[:, None] + prefix
        visible = torch.arange(slots.shape[0], device=q.device)[None, :] <= rows  # [E, L]
        scores = (qb @ kb.transpose(1, 2)) * sm_scale
        scores = scores.masked_fill(~visible, float("-inf"))
        o[q0:q1] = (scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
    return o
