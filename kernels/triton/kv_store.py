"""Writes the K and V of new tokens into the paged KV pool (page size 1: one slot per token).

    k_pool, v_pool: [S, Hkv, D]   the pool of one layer; slot 0 is the padding slot
    slots:          [T] int64     destination slot of each new token
    k, v:           [T, Hkv, D]   (cast to the pool's dtype on the way)

One program per token, its slot read on the device: the launch depends only on T (graphable).
"""

from __future__ import annotations

import torch

from kernels.triton._triton import check_head_dim_contiguous, tl, triton


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KPool,
    VPool,
    Slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kps,
    stride_kph,
    stride_vps,
    stride_vph,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = KPool + slot * stride_kps + offs_h[:, None] * stride_kph + offs_d[None, :]
    v_dst = VPool + slot * stride_vps + offs_h[:, None] * stride_vph + offs_d[None, :]
    tl.store(k_dst, k.to(KPool.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VPool.dtype.element_ty), mask=mask)


def store_kv(
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [T] int
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """k_pool[slots] = k and v_pool[slots] = v, in place."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_head_dim_contiguous(k_pool, v_pool, k, v)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_pool,
        v_pool,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_ref(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Plain-PyTorch reference of store_kv."""
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)
