"""How a CPU worker's host allocations behave: freed activations are reused, not refaulted.

A CPU forward allocates activations afresh at every layer; glibc serves large blocks by
``mmap`` and trims its heap, so every layer refaulted zeroed pages. mallopt keeps blocks
on the heap (thresholds, M_MMAP_MAX 0) and THP_MEM_ALLOC_ENABLE gives torch huge pages.
Explicit operator settings win; a libc without ``mallopt`` is left alone. Details and
figures: docs/benchmarks-history.md.
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
    """Call before torch is imported; returns whether malloc's thresholds were set."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_MMAP_MAX, 0),
        )
    )
