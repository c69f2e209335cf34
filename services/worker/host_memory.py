"""How a CPU worker's host allocations behave: freed activations are reused, not refaulted.

Why: a CPU forward allocates its activations afresh at every layer (tens of MB for a
2,048-row prefill group). glibc's malloc serves blocks above its mmap threshold with a
fresh ``mmap`` and gives them back with ``munmap`` on free, and trims the top of its heap
back to the kernel, so every layer faulted its pages in again and had the kernel zero them
(vLLM's CPU worker preloads tcmalloc for the same reason). Here three library-free
settings avoid that:

- ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (glibc's largest allowed value) and
  ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``: blocks up to 32 MiB come from the heap, and freed
  ones stay there for the next layer. The price is that the worker's heap keeps its peak
  of activations (a few hundred MB for a 2,048-row group) instead of returning it.
- ``mallopt(M_MMAP_MAX, 0)``: no block comes from its own ``mmap`` at all, however large,
  so the blocks above 32 MiB (a 9,728-wide gate/up output at 2,000 rows is 78 MB) are
  reused too; otherwise their fresh pages are faulted in inside the GEMM that writes them.
  glibc still maps memory when its heap cannot grow, and for other threads' arenas.
- ``THP_MEM_ALLOC_ENABLE=1`` (read by torch's CPU allocator, c10): blocks of 2 MiB and more
  are ``madvise``d as transparent huge pages, so they fault in 2 MiB at a time instead of
  4 KiB, and the GEMMs over them miss the TLB less.

Figures: docs/benchmarks.md ("Worker") and docs/benchmarks-history.md.

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
