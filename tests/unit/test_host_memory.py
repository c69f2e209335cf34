"""services/worker/host_memory.py: a freed activation-sized block is reused, not refaulted.

Each case runs in a fresh interpreter: malloc's settings are process-wide and torch reads
THP_MEM_ALLOC_ENABLE once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Page faults of each round of a layer-like pattern: COUNT blocks of SIZE MiB (a prefill
# group's activations) allocated, touched, then all freed; after host_memory.tune() or not.
PROBE = r"""
import ctypes, ctypes.util, json, os, resource, sys
from services.worker import host_memory
tuned = host_memory.tune() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, count, faults = int(sys.argv[2]) << 20, int(sys.argv[3]), []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                  "faults": faults}))
"""

glibc = pytest.mark.skipif(
    not os.path.exists("/proc/self") or sys.platform != "linux", reason="glibc on Linux"
)


def probe(mode: str, size_mib: int = 12, count: int = 3, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    base.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(size_mib), str(count)],
        cwd=ROOT,
        env={**base, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


@glibc
def test_tuned_malloc_reuses_freed_blocks_instead_of_faulting_them_in_again():
    tuned = probe("tune")
    assert tuned["tuned"] is True and tuned["thp"] == "1"
    pages = 3 * (12 << 20) // os.sysconf("SC_PAGE_SIZE")
    # The first rounds fault the blocks in; later rounds find them in the heap.
    assert max(tuned["faults"][2:]) < pages // 16, tuned["faults"]


@glibc
def test_tuned_malloc_reuses_a_block_above_glibcs_largest_mmap_threshold():
    """A 78 MB gate/up output (Qwen2-0.5B's at 2,000 rows) is above the 32 MiB that
    M_MMAP_THRESHOLD may be: without M_MMAP_MAX 0 it would be mapped and faulted in anew
    in every layer."""
    tuned = probe("tune", size_mib=80, count=1)
    pages = (80 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert max(tuned["faults"][2:]) < pages // 16, tuned["faults"]
    plain = probe("plain", size_mib=80, count=1)
    assert min(plain["faults"][2:]) > pages // 2, plain["faults"]


@glibc
def test_untuned_glibc_faults_the_blocks_in_every_round():
    """What the tuning is for: with the default thresholds glibc gives the freed blocks
    back (trims its heap) and faults them in again every round (if this glibc ever stops
    doing that, the tuning may go)."""
    plain = probe("plain")
    pages = 3 * (12 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert plain["tuned"] is None and plain["thp"] is None
    assert min(plain["faults"][2:]) > pages // 2, plain["faults"]


@glibc
def test_an_operator_setting_wins():
    env = probe("tune", MALLOC_TRIM_THRESHOLD_="0", THP_MEM_ALLOC_ENABLE="0")
    assert env["tuned"] is False and env["thp"] == "0"
