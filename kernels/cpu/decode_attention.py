"""Decode attention on CPU straight from the paged KV pool: a small C kernel.

Reads each K/V row where it lies (through the request-to-slot table) instead of gathering a
padded copy per layer; exact two-pass softmax, float32 and bfloat16 pools. ``load()`` is None
where it cannot be built. Design and numerics: docs/cpu-kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import _cc

log = logging.getLogger(__name__)

_SOURCE = _cc.read_source("decode_attention.c")

_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

DecodeAttention = Callable[..., torch.Tensor]


@functools.cache
def _library(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    flags = [*_cc.FLAGS, *extra_flags]
    lib = _cc.load_library("decode_attention", _SOURCE, "CPU decode attention", log, flags)
    if lib is None:
        return None
    for fn in (lib.rs_decode_attention, lib.rs_rows_attention):
        fn.restype = _I32
        fn.argtypes = [_I32, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
        fn.argtypes += [_PTR] * (fn is lib.rs_rows_attention) + [_PTR]
        fn.argtypes += [_I32, _I32, _I32, _I32, _F32, _I32]
    return lib


def load(extra_flags: tuple[str, ...] = ()) -> DecodeAttention | None:
    """``fn(q, k_pool, v_pool, req_to_token, req_slots, seq_lens, scale)``, or None where it
    cannot be built; ``extra_flags`` follow ``-march=native`` (tests build narrower variants)."""
    lib = _library(extra_flags)
    return None if lib is None else functools.partial(_call, lib.rs_decode_attention)


def load_rows(extra_flags: tuple[str, ...] = ()) -> DecodeAttention | None:
    """``fn(q, k_pool, v_pool, req_to_token, req_slots, qo_indptr, prefix_lens, scale,
    out=None)``: causal attention of a few query rows per request (a verify step's), the
    extend kernel's contract, or None where it cannot be built. Each request's rows share
    one pass over its context, as a decode step's query heads of one K/V head do."""
    lib = _library(extra_flags)
    return None if lib is None else functools.partial(_call_rows, lib.rs_rows_attention)


# Rows x query heads per K/V head of a request up to which load_rows' kernel beats the
# extend kernel (docs/benchmarks.md, "Verify-shaped attention"): its scores are one dot
# product per row and head, where the extend kernel's register tiles pay off on more.
MAX_LANES = 24


# The pool dtypes the kernel reads (q and the output share it).
DTYPES = (torch.float32, torch.bfloat16)


def supports(q: torch.Tensor, k_pool: torch.Tensor, req_to_token: torch.Tensor) -> bool:
    """float32/bfloat16 CPU tensors of one dtype, head dim contiguous, an int32 table."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_pool.dtype == q.dtype
        and q.stride(-1) == 1
        and k_pool.stride(-1) == 1
        and k_pool.stride(-2) == k_pool.shape[-1]
        and req_to_token.dtype == torch.int32
        and req_to_token.stride(-1) == 1
    )


def _call(
    fn,
    q: torch.Tensor,  # [B, H, D] float32 / bfloat16 (the pool's), D contiguous
    k_pool: torch.Tensor,  # [S, KVH, D]
    v_pool: torch.Tensor,  # [S, KVH, D], same strides as k_pool
    req_to_token: torch.Tensor,  # [R, C] int32
    req_slots: torch.Tensor,  # [B] int32 contiguous
    seq_lens: torch.Tensor,  # [B] int32 contiguous
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    if v_pool.stride() != k_pool.stride():
        raise ValueError("k_pool and v_pool must share one layout")
    out = torch.empty((b, h, d), dtype=q.dtype)
    failed = fn(
        _cc.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        req_to_token.data_ptr(), req_to_token.stride(0),
        req_slots.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        b, h, kvh, d, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("decode attention: out of memory for the score buffer")
    return out


def extend_output(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """The output an extend-shaped call writes (``out``, checked, or a new tensor), once
    the pools are found to share one layout (the kernels take one stride for both)."""
    if v_pool.stride() != k_pool.stride():
        raise ValueError("k_pool and v_pool must share one layout")
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    return out


def _call_rows(
    fn,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The arguments of extend_attention's call (shapes and layouts there), no block_q."""
    t, h, d = q.shape
    kvh = k_pool.shape[1]
    if h % kvh:
        raise ValueError(f"rows attention: heads {h} not a multiple of kv heads {kvh}")
    out = extend_output(q, k_pool, v_pool, out)
    failed = fn(
        _cc.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        req_to_token.data_ptr(), req_to_token.stride(0),
        req_slots.data_ptr(), qo_indptr.data_ptr(), prefix_lens.data_ptr(), out.data_ptr(),
        len(req_slots), h, kvh, d, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("rows attention: out of memory for the score buffer")
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same in plain PyTorch, one request at a time (the tests' reference)."""
    b, h, d = q.shape
    group = h // k_pool.shape[1]
    out = torch.empty((b, h, d), dtype=q.dtype)
    for i in range(b):
        slots = req_to_token[int(req_slots[i]), : int(seq_lens[i])].long()
        k = k_pool[slots].transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        v = v_pool[slots].transpose(0, 1).repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale)[:, 0]
    return out
