"""How a CPU worker's host allocations behave: freed activations are reused, not refaulted.

Why (issue 18): a CPU forward allocates its activations afresh at every layer (a 2,048-row
prefill group of the peers' small model: 8 MB of qkv, 23 MB of gate/up output, ...).
glibc's malloc serves blocks above its mmap threshold with a fresh ``mmap`` and gives them
back with ``munmap`` on free, and trims the top of its heap back to the kernel, so every
layer faulted its pages in again and had the kernel zero them: on the 2-core Xeon one
``torch.empty(8192, 2816).fill_(1)`` took 28 ms, ~5 ms of it the fill. vLLM's CPU worker
preloads tcmalloc for the same reason; here two library-free settings do it:

- ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (glibc's largest allowed value) and
  ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``: blocks up to 32 MiB come from the heap, and freed
  ones stay there for the next layer. The price is that the worker's heap keeps its peak
  of activations (a few hundred MB for a 2,048-row group) instead of returning it.
- ``mallopt(M_MMAP_MAX, 0)``: no block comes from its own ``mmap`` at all, however large,
  so the blocks above 32 MiB are reused too (Qwen2-0.5B's 9,728-wide gate/up output at
  2,000 rows is 78 MB, allocated and freed in every layer; glibc still maps memory when its
  heap cannot grow, and for other threads' arenas). oneDNN's verbose log of a served
  prefill showed that GEMM at a median 212 GFLOP/s (p25 177) against 230 for the layer's
  other three linears, and vLLM's same GEMM at 222 (p25 205): its fresh output pages were
  faulted in inside the GEMM.
- ``THP_MEM_ALLOC_ENABLE=1`` (read by torch's CPU allocator, c10): blocks of 2 MiB and more
  are ``madvise``d as transparent huge pages, so they fault in 2 MiB at a time instead of
  4 KiB, and the GEMMs over them miss the TLB less.

Cold prefill, in-process, separate processes alternating (``bench/bench_decode_step.py``'s
runner, 2 threads, tokens/s of the forwards after the first): small model 8 x 1,000 tokens
~2,750 plain vs ~3,050 with the thresholds and huge pages (1.1x); Qwen2-0.5B shape 4 x
1,000 ~205 vs ~235 (1.15x; the huge pages alone ~230). ``M_MMAP_MAX`` 0 on top, Qwen2-0.5B
shape, batches of 2 x 1,000 tokens, four alternating pairs of processes: 288 / 269, 296 /
261, 268 / 258, 253 / 240 tokens/s (1.04-1.13x).

An explicit ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_MAX_`` or
``GLIBC_TUNABLES`` leaves malloc as the operator set it, an explicit ``THP_MEM_ALLOC_ENABLE``
wins, and a C library without ``mallopt`` (musl) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
OPERATOR_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "GLIBC_TUNABLES",
)


def tune() -> bool:
    """Call before torch is imported (its allocator reads THP_MEM_ALLOC_ENABLE once).
    Whether malloc's thresholds were set here."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 for a refused value.
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_MMAP_MAX, 0),
        )
    )
