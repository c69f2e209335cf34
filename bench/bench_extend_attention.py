"""The C extend-attention kernel (kernels/cpu/extend_attention.py) vs torch's SDPA, per call.

One request per shape, its K/V in the pool at scattered slots, measured side by side in
one process (the two alternate call by call, which goes first alternating; medians):

  kernel   cpu_extend_attention: reads K/V from the pool through the request's table row
  sdpa     what the torch backend did per request and layer: no prefix, SDPA with
           is_causal over the new rows; with a prefix, the context K/V gathered from the
           pool (index_select) and SDPA with the shifted causal mask (built beforehand, as
           prepare() does once per batch)

GFLOP/s count the causal work, 4 * D * H * sum over query rows of the keys each sees.

    .venv/bin/python bench/bench_extend_attention.py [--reps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import extend_attention as cpu_extend_attention  # noqa: E402

# (heads, kv heads, head dim, new rows, prefix): the peers' small model, Qwen2-0.5B, a hit
SHAPES = [(8, 4, 64, 1000, 0), (14, 2, 64, 512, 0), (8, 4, 64, 200, 1000)]


def setup(h: int, kvh: int, d: int, n: int, p: int) -> tuple[Callable, Callable, float]:
    """(kernel call, sdpa call, causal GFLOP) for one request of n rows on a p prefix."""
    g = torch.Generator().manual_seed(0)
    pool = 2 * (n + p) + 1
    k_pool, v_pool = (torch.randn(pool, kvh, d, generator=g) for _ in range(2))
    slots = (torch.randperm(pool - 1, generator=g)[: n + p] + 1).to(torch.int32)
    table = torch.zeros(2, n + p + 8, dtype=torch.int32)
    table[1, : n + p] = slots
    q = torch.randn(n, h + 2 * kvh, d, generator=g)[:, :h]  # a view of a fused qkv output
    k_new, v_new = k_pool[slots[p:].long()], v_pool[slots[p:].long()]
    i32 = torch.int32
    req, qo, pre = (torch.tensor(x, dtype=i32) for x in ([1], [0, n], [p]))
    kernel = cpu_extend_attention.load()
    assert kernel is not None, "no kernel here"
    scale = d**-0.5
    mask = torch.arange(n + p)[None, :] <= torch.arange(n)[:, None] + p if p else None
    ctx = slots.long()

    def run_kernel(block_q: int = 0) -> torch.Tensor:
        return kernel(q, k_pool, v_pool, table, req, qo, pre, scale, block_q=block_q)

    def run_sdpa() -> torch.Tensor:
        if p:
            k, v = k_pool.index_select(0, ctx), v_pool.index_select(0, ctx)
        else:
            k, v = k_new, v_new
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=h > kvh,
        )  # fmt: skip
        return o[0].transpose(0, 1)

    torch.testing.assert_close(run_kernel(), run_sdpa(), rtol=1e-4, atol=1e-4)
    seen = n * p + n * (n + 1) / 2  # keys summed over query rows
    return run_kernel, run_sdpa, 4 * d * h * seen / 1e9


def measure(calls: dict[str, Callable], reps: int) -> dict[str, float]:
    """Median seconds per call of each, interleaved (the order alternates every rep)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for i in range(reps + 1):
        for name in names if i % 2 else reversed(names):
            start = time.perf_counter()
            calls[name]()
            if i:  # rep 0 warms up
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, medians of {args.reps} interleaved calls")
    print(
        "| H / KVH / D | new rows | prefix | kernel ms | sdpa ms | kernel GFLOP/s "
        "| sdpa GFLOP/s | sdpa / kernel |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for h, kvh, d, n, p in SHAPES:
        kernel, sdpa, gflop = setup(h, kvh, d, n, p)
        t = measure({"kernel": kernel, "sdpa": sdpa}, args.reps)
        print(f"| {h} / {kvh} / {d} | {n} | {p} | {t['kernel'] * 1e3:.2f} | "
              f"{t['sdpa'] * 1e3:.2f} | {gflop / t['kernel']:.0f} | {gflop / t['sdpa']:.0f} | "
              f"{t['sdpa'] / t['kernel']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
