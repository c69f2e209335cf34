"""Verify-shaped attention on CPU: the decode kernel's rows entry vs the extend kernel, per call.

A speculative verify step gives each request 1 + k query rows over its cached context. Both
C kernels take that batch (kernels/cpu/decode_attention.py ``load_rows``,
kernels/cpu/extend_attention.py); this times them side by side in one process on the same
pools (scattered slots), alternating call by call, which goes first alternating; medians.
The torch backend sends an extend batch to the rows entry while rows x group <=
``decode_attention.MAX_LANES``.

    .venv/bin/python bench/bench_verify_attention.py
    .venv/bin/python bench/bench_verify_attention.py --shapes 16x5x4x2x48 16x5x14x2x64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import decode_attention as cpu_decode_attention  # noqa: E402
from kernels.cpu import extend_attention as cpu_extend_attention  # noqa: E402

# requests x rows x heads x kv heads x head dim: the shipped model at k = 4 and 8, then the
# peers' small model, Qwen2-0.5B and a Llama-8B-shaped group
SHAPES = ["16x5x4x2x48", "16x9x4x2x48", "16x13x4x2x48", "1x5x4x2x48", "16x5x8x4x64",
          "16x3x14x2x64", "16x3x32x8x128", "16x5x32x8x128", "16x7x32x8x128"]  # fmt: skip


def case(b: int, rows: int, h: int, kvh: int, d: int, context: int) -> tuple:
    """Pools with each request's context + rows at scattered slots; the rows' q."""
    g = torch.Generator().manual_seed(0)
    n = context + rows
    slots = b * n + 1
    k_pool = torch.randn(slots, kvh, d, generator=g)
    v_pool = torch.randn(slots, kvh, d, generator=g)
    table = (torch.randperm(slots - 1, generator=g)[: b * n] + 1).to(torch.int32).view(b, n)
    q = torch.randn(b * rows, h, d, generator=g)
    req_slots = torch.arange(b, dtype=torch.int32)
    qo = torch.arange(0, b * rows + 1, rows, dtype=torch.int32)
    prefix = torch.full((b,), context, dtype=torch.int32)
    return q, k_pool, v_pool, table, req_slots, qo, prefix, d**-0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES,
                    help="requests x rows x query heads x kv heads x head dim")  # fmt: skip
    ap.add_argument("--context", type=int, default=350, help="cached tokens per request")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    kernels = {"rows": cpu_decode_attention.load_rows(), "extend": cpu_extend_attention.load()}
    if any(fn is None for fn in kernels.values()):
        sys.exit("a kernel did not build here (no C compiler, or RADIXSERVE_CPU_KERNELS=0)")
    print(f"{ns.threads} threads, {ns.context} cached tokens per request, medians of "
          f"{ns.calls} alternating calls, us per call (one layer)")  # fmt: skip
    print("| requests | rows | heads (q / kv) | head dim | lanes | rows us | extend us | "
          "rows speed | max abs. difference |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for shape in ns.shapes:
        b, rows, h, kvh, d = (int(x) for x in shape.split("x"))
        args = case(b, rows, h, kvh, d, ns.context)
        outs = [fn(*args) for fn in kernels.values()]
        diff = (outs[0] - outs[1]).abs().max().item()
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for i in range(ns.calls + 10):
            for name in kernels if i % 2 else reversed(list(kernels)):
                start = time.perf_counter()
                kernels[name](*args)
                if i >= 10:  # warm-up calls not counted
                    times[name].append(time.perf_counter() - start)
        us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
        print(f"| {b} | {rows} | {h} / {kvh} | {d} | {rows * h // kvh} | {us['rows']:.0f} | "
              f"{us['extend']:.0f} | {us['extend'] / us['rows']:.2f}x | {diff:.1e} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
