"""The CPU decode-attention kernel (kernels/cpu/decode_attention.py): this tree's build
against another revision's, and how the pool's slot layout changes its time (issue 18).

Both builds run the same calls in one process, alternating (which goes first alternates
too); medians of the per-call times over all layers of a step. Layouts of each request's
``--prompt-len + --decode-len`` slots in a 200k-slot pool:

  server      the prompt's slots contiguous, then one slot per request per decode step,
              interleaved across the batch (as the scheduler's allocator hands them out)
  contiguous  every request's slots in one run
  hot         every request reads the same slots (the K/V rows stay in the caches: what is
              left is the kernel's arithmetic)

    .venv/bin/python bench/bench_decode_attention.py --against HEAD~1
    .venv/bin/python bench/bench_decode_attention.py --against HEAD~1 --layouts server hot \
        --shapes 16x8x4x8 64x8x4x8 16x14x2x24 8x14x2x24
    .venv/bin/python bench/bench_decode_attention.py --against HEAD~1 --head-dim 48 \
        --shapes 16x4x2x4 1x4x2x4   # the shipped model
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels.cpu import decode_attention as cpu_decode_attention  # noqa: E402

POOL_SLOTS = 200_000


def module_at(rev: str) -> ModuleType:
    """The CPU decode-attention module as it was at ``rev`` (kernels/cpu/decode_attention.py,
    or kernels/cpu_decode_attention.py before the move), with that revision's kernels/
    imported as another package, so that its C source, not this tree's, is built (and
    cached separately by its key)."""
    name = "kernels_at_" + re.sub(r"\W", "_", rev)
    tmp = Path(tempfile.mkdtemp(prefix="kernels-at-rev-"))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "kernels"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    (tmp / "kernels").rename(tmp / name)
    for py in (tmp / name).rglob("*.py"):
        # imports and resources.files("kernels...") alike, each once
        py.write_text(re.sub(r"\bkernels(?=[. \"])", name, py.read_text()))
    moved = (tmp / name / "cpu" / "decode_attention.py").exists()
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module(
            f"{name}.cpu.decode_attention" if moved else f"{name}.cpu_decode_attention"
        )
    finally:  # everything it needs is read at import (the C source, as a string)
        sys.path.remove(str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)


def table(layout: str, b: int, prompt: int, decode: int) -> torch.Tensor:
    """[b, prompt + decode] int32 slots of each request, laid out as named."""
    n = prompt + decode
    if layout == "contiguous":
        return torch.arange(1, 1 + b * n, dtype=torch.int32).view(b, n)
    if layout == "hot":
        return torch.arange(1, 1 + n, dtype=torch.int32).repeat(b, 1)
    t = torch.empty(b, n, dtype=torch.int32)
    t[:, :prompt] = torch.arange(1, 1 + b * prompt, dtype=torch.int32).view(b, prompt)
    steps = torch.arange(1 + b * prompt, 1 + b * n, dtype=torch.int32).view(decode, b)
    t[:, prompt:] = steps.T
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision of the other build")
    ap.add_argument(
        "--shapes", nargs="+", default=["16x8x4x8", "64x8x4x8", "16x14x2x24", "8x14x2x24"],
        help="requests x query heads x kv heads x layers",
    )  # fmt: skip
    ap.add_argument("--head-dim", type=int, default=64)
    layouts = ["server", "contiguous", "hot"]
    ap.add_argument("--layouts", nargs="+", default=["server"], choices=layouts)
    ap.add_argument("--prompt-len", type=int, default=288)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    builds = {"this tree": cpu_decode_attention.load(), ns.against: module_at(ns.against).load()}
    if any(fn is None for fn in builds.values()):
        sys.exit("a kernel did not build here (no C compiler, or RADIXSERVE_CPU_KERNELS=0)")
    n = ns.prompt_len + ns.decode_len
    print(f"{ns.threads} threads, head dim {ns.head_dim}, "
          f"{ns.prompt_len} + {ns.decode_len} slots per request, "
          f"medians of {ns.rounds} alternating rounds, ms per step (all layers)")  # fmt: skip
    print(f"| requests | heads (q / kv) | layers | layout | {ns.against} ms | this tree ms "
          "| speed | max abs. difference |")  # fmt: skip
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for shape in ns.shapes:
        b, h, kvh, layers = (int(x) for x in shape.split("x"))
        d = ns.head_dim
        pools = [(torch.randn(POOL_SLOTS, kvh, d), torch.randn(POOL_SLOTS, kvh, d))
                 for _ in range(min(layers, 8))]  # fmt: skip
        q = torch.randn(b, h, d)
        req_slots = torch.arange(b, dtype=torch.int32)
        lens = torch.full((b,), n, dtype=torch.int32)
        for layout in ns.layouts:
            t = table(layout, b, ns.prompt_len, ns.decode_len)
            outs = [fn(q, *pools[0], t, req_slots, lens, 0.125) for fn in builds.values()]
            diff = (outs[0] - outs[1]).abs().max().item()
            times: dict[str, list[float]] = {k: [] for k in builds}
            for r in range(ns.rounds):
                for name in builds if r % 2 else reversed(list(builds)):
                    fn = builds[name]
                    start = time.perf_counter()
                    for i in range(layers):
                        fn(q, *pools[i % len(pools)], t, req_slots, lens, 0.125)
                    times[name].append(time.perf_counter() - start)
            old, new = (1e3 * statistics.median(times[k]) for k in (ns.against, "this tree"))
            print(f"| {b} | {h} / {kvh} | {layers} | {layout} | {old:.2f} | {new:.2f} | "
                  f"{old / new:.2f}x | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
