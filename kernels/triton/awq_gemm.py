"""``x @ dequant(W)`` straight from AWQ's packed int4 weights (the GEMM layout).

Shapes: awq_gemm's signature; x float16/bfloat16 (float32: interpreter, tests), qweight and
qzeros 8 nibbles per int32 in AWQ's order, W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
Each W tile's int32 words are loaded once, unpacked in registers, dequantized in float32
and rounded once to x's dtype before a float32 ``tl.dot``; BLOCK_K divides the group size (one
row of zeros and scales per tile). Small M splits K over programs (float32 partials summed in
a fixed order: deterministic). Launches depend on shapes only: CUDA graphs replay them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.awq_pack import PACK, dequantize
from kernels.triton._triton import dot_precision, tl, triton


@triton.jit
def _awq_gemm_kernel(
    X,
    QW,
    QZ,
    S,
    Bias,
    Out,
    M,
    N,
    K,
    k_per_split,  # K rows per program along the split axis (a multiple of BLOCK_K)
    stride_xm,
    stride_xk,
    stride_qk,
    stride_zg,
    stride_sg,
    stride_os,
    stride_om,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    word = offs_n // 8  # the int32 holding column n
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    w_ok = offs_w < N // 8
    # Column j (of its 8) sits in nibble AWQ_ORDER.index(j) = (j % 2) * 4 + j // 2.
    shift = (((offs_n % 8) % 2) * 4 + (offs_n % 8) // 2) * 4  # [BLOCK_N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k  # K is a multiple of BLOCK_K: no mask along K
        x = tl.load(
            X + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=m_ok[:, None],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        words = tl.load(
            QW + ks[:, None] * stride_qk + offs_w[None, :], mask=w_ok[None, :], other=0
        )  # [BLOCK_K, BLOCK_N / 8]: coalesced, each word once
        # Each word repeated 8 times in registers: [BLOCK_K, BLOCK_N], column n holds word n // 8.
        q = tl.interleave(words, words)
        q = tl.interleave(q, q)
        q = tl.interleave(q, q)
        q = (q >> shift[None, :]) & 0xF  # [BLOCK_K, BLOCK_N]
        g = k0 // GROUP  # one group per K tile (BLOCK_K divides GROUP)
        z = (tl.load(QZ + g * stride_zg + word, mask=n_ok, other=0) >> shift) & 0xF  # [BLOCK_N]
        s = tl.load(S + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(X.dtype.element_ty)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Out + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch settings of one call (chosen from shapes alone)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_k_for(group: int, preferred: int = 128) -> int:
    """The largest power of two <= preferred that divides the group size (>= 16 for tl.dot)."""
    bk = preferred
    while bk >= 16:
        if group % bk == 0:
            return bk
        bk //= 2
    raise ValueError(f"AWQ group size {group} has no power-of-two divisor >= 16 for the K tile")


def choose_config(
    m: int, n: int, k: int, group: int, device: torch.device, dtype: torch.dtype = torch.float16
) -> GemmConfig:
    """Decode (small M) is bound by reading the weights: narrow M, long K tiles, K split so
    every SM streams; prefill by the dots: square tiles. float32 x needs small tiles (spills)."""
    if device.type != "cuda":  # the interpreter: few, large programs
        return GemmConfig(16, 32, block_k_for(group, 64), 1, 4, 1)
    if dtype.itemsize >= 4:
        return GemmConfig(16, 64, block_k_for(group, 32), 1, 4, 2)
    if m <= 64:
        # Wider M tiles fit in registers only with BLOCK_K 64 on 8 warps.
        bm, bk, warps = (16, 128, 4) if m <= 16 else ((32 if m <= 32 else 64), 64, 8)
        bk = block_k_for(group, bk)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, 128)
        k_blocks = k // bk
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        split = 1
        while tiles * split < 2 * sms and split * 2 <= k_blocks and split < 16:
            split *= 2
        return GemmConfig(bm, 128, bk, split, warps, 4)
    return GemmConfig(128, 128, block_k_for(group, 64), 1, 8, 3)


def check_shapes(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> int:
    """The group size; ValueError naming the mismatch otherwise."""
    k, n = qweight.shape[0], scales.shape[1]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32")
    groups = scales.shape[0]
    if groups == 0 or k % groups or qweight.shape[1] * PACK != n:
        raise ValueError(
            f"qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} disagree"
        )
    if tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"qzeros must be [{groups}, {n // PACK}], got {tuple(qzeros.shape)}")
    return k // groups


def awq_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K, N/8] int32
    qzeros: torch.Tensor,  # [K/G, N/8] int32
    scales: torch.Tensor,  # [K/G, N] float16
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,  # override (benchmarks, tests)
) -> torch.Tensor:  # [M, N] in x's dtype
    group = check_shapes(x, qweight, qzeros, scales)
    m, k = x.shape
    n = scales.shape[1]
    cfg = config or choose_config(m, n, k, group, x.device, x.dtype)
    if group % cfg.block_k:
        raise ValueError(f"BLOCK_K {cfg.block_k} does not divide the group size {group}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_blocks = k // cfg.block_k
    k_per_split = triton.cdiv(k_blocks, cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # every split gets some K
    # Split: float32 partials [split, M, N], reduced below; else the tile lands in out.
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    fused_bias = bias is not None and split == 1
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _awq_gemm_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        bias if fused_bias else scales,  # a placeholder pointer when unused
        target,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        target.stride(0) if split > 1 else 0,
        target.stride(-2),
        GROUP=group,
        HAS_BIAS=fused_bias,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split == 1:
        return out
    total = target.sum(0)  # [M, N] float32
    if bias is not None:
        total += bias.float()
    return out.copy_(total)


def awq_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference: dequantize exactly (float32), round W once to x's dtype (as
    the kernel does), multiply in float32 (float64 for a float64 x)."""
    group = check_shapes(x, qweight, qzeros, scales)
    acc = torch.promote_types(x.dtype, torch.float32)
    w = dequantize(qweight, qzeros, scales, group).to(x.dtype).to(acc)  # [K, N]
    y = x.to(acc) @ w
    if bias is not None:
        y += bias.to(acc)
    return y.to(x.dtype)
