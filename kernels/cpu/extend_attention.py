"""Causal extend (prefill) attention on CPU straight from the paged KV pool: a C kernel.

Every extend request of a batch in one call, flash style, K/V read where they lie in the
pool so a cached prefix costs no gather; float32 and bfloat16. ``load()`` is None where it
cannot be built (no AVX2/FMA, no compiler). Tiling and numerics: docs/cpu-kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import _cc
from kernels.cpu import decode_attention as cpu_decode_attention

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256  # the longest head dim the kernel takes (supports())
# Work (query rows x keys x heads x head dim) from which a call is split over the threads.
PARALLEL_MIN = 1 << 20

_SOURCE = _cc.read_source("extend_attention.c", PARALLEL_MIN=PARALLEL_MIN)

_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

ExtendAttention = Callable[..., torch.Tensor]


# Query rows, and lanes (rows x the heads sharing a K/V head), of one work item at most. An
# item streams its request's whole context of one K/V head once, block by block, so the
# more lanes share that read, the less copying per FLOP: 256 rows x 2 heads ran a
# 2,048-row chunk over a 14k prefix 1.2x faster than 64 x 2 (docs/benchmarks.md, "Host
# costs that grow"); the lane cap keeps a large group's buffers in L2.
MAX_ROWS, MAX_LANES = 256, 1024
MIN_ITEMS_PER_THREAD = 4  # smaller items while there would be fewer (causal imbalance)


def block_rows(group: int, rows: int = 1 << 30, kv_heads: int = 1, threads: int = 1) -> int:
    """Query rows per work item for a batch of ``rows`` query rows."""
    block = max(16, min(MAX_ROWS, MAX_LANES // group // 16 * 16))
    while block > 16 and kv_heads * -(-rows // block) < MIN_ITEMS_PER_THREAD * threads:
        block //= 2
    return block


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ExtendAttention | None:
    """``fn(q, k_pool, v_pool, req_to_token, req_slots, qo_indptr, prefix_lens, scale,
    out=None)``, or None where it cannot be built; ``extra_flags`` follow ``-march=native``."""
    flags = [*_cc.FLAGS, *extra_flags]
    lib = _cc.load_library("extend_attention", _SOURCE, "CPU extend attention", log, flags)
    if lib is None or not hasattr(lib, "rs_extend_attention"):
        return None
    fn = lib.rs_extend_attention
    fn.restype = _I32
    fn.argtypes = [_I32, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    fn.argtypes += [_I32, _I32, _I32, _I32, _F32, _I32, _I32]
    return functools.partial(_call, fn)


def supports(q: torch.Tensor, k_pool: torch.Tensor, req_to_token: torch.Tensor) -> bool:
    """What the decode kernel supports, with the head dim at most MAX_HEAD_DIM."""
    return q.shape[-1] <= MAX_HEAD_DIM and cpu_decode_attention.supports(q, k_pool, req_to_token)


def _call(
    fn,
    q: torch.Tensor,  # [T, H, D] float32 / bfloat16 (the pool's), D contiguous
    k_pool: torch.Tensor,  # [S, KVH, D]
    v_pool: torch.Tensor,  # [S, KVH, D], same strides as k_pool
    req_to_token: torch.Tensor,  # [R, C] int32
    req_slots: torch.Tensor,  # [B] int32 contiguous
    qo_indptr: torch.Tensor,  # [B + 1] int32 contiguous: rows of q (need not start at 0)
    prefix_lens: torch.Tensor,  # [B] int32 contiguous
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D] contiguous; only the requests' rows written
    block_q: int = 0,  # query rows per work item (0: block_rows(group))
) -> torch.Tensor:
    t, h, d = q.shape
    kvh = k_pool.shape[1]
    out = cpu_decode_attention.extend_output(q, k_pool, v_pool, out)
    block_q = block_q or block_rows(h // kvh, t, kvh, torch.get_num_threads())
    if block_q < 1 or h % kvh:
        raise ValueError(f"extend attention: block_q {block_q}, heads {h} / kv heads {kvh}")
    failed = fn(
        _cc.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        req_to_token.data_ptr(), req_to_token.stride(0),
        req_slots.data_ptr(), qo_indptr.data_ptr(), prefix_lens.data_ptr(), out.data_ptr(),
        len(req_slots), h, kvh, d, scale, block_q, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("extend attention: out of memory for the work buffers")
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same in plain PyTorch, one request at a time (the tests' reference): SDPA of
    the request's rows over its gathered context, query i seeing keys 0 .. prefix + i."""
    h = q.shape[1]
    group = h // k_pool.shape[1]
    out = torch.zeros_like(q)
    for b in range(len(req_slots)):
        s, e, p = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(prefix_lens[b])
        slots = req_to_token[int(req_slots[b]), : p + e - s].long()
        k = k_pool[slots].transpose(0, 1).repeat_interleave(group, 0)  # [H, S, D]
        v = v_pool[slots].transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.arange(p + e - s)[None, :] <= torch.arange(e - s)[:, None] + p
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
