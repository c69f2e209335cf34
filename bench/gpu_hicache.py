"""The hierarchical cache's copy engine on the GPU, as a section of bench/gpu_bench.py:
host -> device and device -> host GB/s of HostPool.apply (pinned host buffer, a copy
stream of its own) over a 7B-shaped KV (28 layers, 4 KV heads, head_dim 128, bf16), and
the KV that comes back equal to the KV that left. ``--smoke`` runs it on CPU at tiny sizes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.host_pool import D2H, H2D, HostPool
from services.worker.kv_pool import KVPool, KVShape

COPY_TARGET_GBPS = 10.0  # pinned PCIe DMA of gathered rows; an H200 link carries ~50


@dataclass
class _Copy:
    direction: int
    src_slots: bytes
    dst_slots: bytes
    keys: bytes = b""
    load_id: int = 0


def _slots(a: np.ndarray) -> bytes:
    return a.astype("<i4").tobytes()


def bench_copies(table, device: str, verdict) -> None:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    shape = KVShape(28, 4, 128, torch.bfloat16) if cuda else KVShape(2, 2, 16, torch.float32)
    tokens = 32768 if cuda else 256
    pool = KVPool(shape, tokens, dev)
    host = HostPool(shape, tokens, pin=cuda)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    rng = np.random.default_rng(0)
    src = rng.permutation(np.arange(1, tokens + 1))  # scattered slots, as a tree leaves them
    dst = rng.permutation(np.arange(1, tokens + 1))
    want_k = pool.k_buffer[:, torch.from_numpy(src).to(dev)].clone()
    nbytes = tokens * shape.bytes_per_token()

    def timed(copies) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        host.apply(copies, pool)
        host.apply([], pool)  # lands the staged demotions
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    d2h = [_Copy(D2H, _slots(src), _slots(dst))]
    h2d = [_Copy(H2D, _slots(dst), _slots(src))]
    runs: dict[str, list[float]] = {"device -> host": [], "host -> device": []}
    for _ in range(3):
        runs["device -> host"].append(timed(d2h))
        pool.k_buffer.zero_()
        pool.v_buffer.zero_()
        runs["host -> device"].append(timed(h2d))
    back = pool.k_buffer[:, torch.from_numpy(src).to(dev)]
    exact = bool(torch.equal(back, want_k))
    for name, seconds in runs.items():
        gbps = nbytes / statistics.median(seconds) / 1e9
        table.add(
            f"hicache copy {name}, {tokens} scattered tokens ({nbytes / 2**20:.0f} MiB), {device}",
            f"{gbps:.1f} GB/s; KV back exact: {exact}",
            f">= {COPY_TARGET_GBPS:g} GB/s, exact" if cuda else "exact",
            verdict(exact and (gbps >= COPY_TARGET_GBPS or not cuda)),
        )
