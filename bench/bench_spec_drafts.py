"""Benchmark of the speculative-decoding draft sources alone (no model): not a test.

Builds a DraftIndex over --seqs sequences of --len tokens: phrases drawn from a shared pool
with random tokens between them, so windows repeat across sequences as in templated or
agentic traffic. Memory is tracemalloc's over a build of the first --trace-seqs sequences
(tracing every allocation slows a build ~7x), scaled by tokens to the whole index;
--trace-seqs 0 traces the whole build. Then --running requests of the same kind decode
--steps tokens each, as the scheduler would drive them: per step one propose() with the
request's own tokens as the context (the index holds the request too), and one extend()
by the token it produced. Times are this thread's CPU time (time.thread_time_ns), so a busy
machine stretches them less than wall time.

    .venv/bin/python bench/bench_spec_drafts.py [--seqs 2000] [--len 500] [--k 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable

from services.scheduler.spec_drafts import DraftIndex, ngram_draft


def make_source(args: argparse.Namespace, rng: random.Random) -> Callable[[], list[int]]:
    """A generator of sequences from one phrase pool (shared by the index and the requests)."""
    pool = [
        [rng.randrange(args.vocab) for _ in range(rng.randint(4, 16))] for _ in range(args.phrases)
    ]

    def sequence() -> list[int]:
        out: list[int] = []
        while len(out) < args.len:
            if rng.random() < args.noise:
                out.append(rng.randrange(args.vocab))
            else:
                out.extend(rng.choice(pool))
        return out[: args.len]

    return sequence


def build(args: argparse.Namespace, seqs: list[list[int]]) -> tuple[DraftIndex, float]:
    """The index over seqs (finished requests), and how long building it took."""
    index = DraftIndex(max_tokens=args.max_tokens, max_depth=args.max_depth)
    t0 = time.thread_time()
    for i, s in enumerate(seqs):
        index.add("", f"done-{i}", s)
    return index, time.thread_time() - t0


def traced(args: argparse.Namespace, seqs: list[list[int]]) -> tuple[int, int, int]:
    """(nodes, peak bytes, bytes held after) of an index built under tracemalloc."""
    tracemalloc.start()
    index, _ = build(args, seqs)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return index.num_nodes, peak, held


def quantiles(ns: list[int]) -> tuple[float, float]:
    us = sorted(t / 1000 for t in ns)
    return statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))]


def decode(args: argparse.Namespace, index: DraftIndex, source: Callable[[], list[int]]) -> None:
    """--running requests, --steps decoding steps each; prints the table."""
    times: dict[str, list[int]] = {"propose": [], "propose, exclude own": [], "ngram_draft": []}
    times["extend(1 token)"] = []
    drafted = matched = hits = 0
    clock = time.thread_time_ns
    for r in range(args.running):
        seq = source()
        sid, split = f"run-{r}", len(seq) - args.steps
        index.add("", sid, seq[:split])
        for step in range(split, len(seq)):
            ctx = array("i", seq[:step])  # the scheduler's token arrays (tokens.py)
            t0 = clock()
            draft = index.propose("", ctx, args.k)
            t1 = clock()
            index.propose("", ctx, args.k, exclude=sid)
            t2 = clock()
            ngram_draft(ctx, args.k)
            t3 = clock()
            index.extend("", sid, seq[step : step + 1])
            t4 = clock()
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(dt)
            truth = seq[step : step + len(draft)]
            drafted += len(draft)
            hits += bool(draft)
            matched += next(
                (i for i, (a, b) in enumerate(zip(draft, truth, strict=False)) if a != b),
                len(draft),
            )
    steps = args.running * args.steps
    print(f"{f'operation (k={args.k}), cpu':28s} {'median us':>10s} {'p99 us':>10s}")
    for name, ns in times.items():
        med, p99 = quantiles(ns)
        print(f"{name:28s} {med:10.1f} {p99:10.1f}")
    print(
        f"drafts: {hits / steps:.0%} of {steps} steps drafted, {drafted / steps:.2f} tokens a "
        f"step, {matched / max(1, drafted):.0%} of them the sequence's next tokens (in order)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=2000)
    p.add_argument("--len", type=int, default=500)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--phrases", type=int, default=500, help="the shared phrase pool")
    p.add_argument("--noise", type=float, default=0.3, help="share of random tokens")
    p.add_argument("--max-tokens", type=int, default=1 << 20)
    p.add_argument("--max-depth", type=int, default=32)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--running", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-seqs", type=int, default=250, help="0: trace the whole build")
    args = p.parse_args()
    rng = random.Random(args.seed)
    source = make_source(args, rng)
    seqs = [source() for _ in range(args.seqs)]
    part = seqs[: args.trace_seqs or len(seqs)]
    nodes, peak, held = traced(args, part)
    index, seconds = build(args, seqs)
    n = index.num_tokens
    print(
        f"index: {n:,} tokens in {len(index)} sequences (max_depth {args.max_depth}), "
        f"{index.num_nodes:,} nodes, built in {seconds:.1f} s cpu ({seconds / n * 1e6:.1f} us "
        "a token)"
    )
    mib, scale = 1 << 20, index.num_nodes / nodes  # memory goes with nodes more than tokens
    print(
        f"memory (tracemalloc over the first {sum(map(len, part)):,} tokens, {nodes:,} nodes): "
        f"peak {peak / mib:.0f} MiB, held {held / mib:.0f} MiB; scaled by nodes to the whole "
        f"index: peak ~{peak * scale / mib:.0f} MiB ({peak * scale / n:.0f} B a token)"
    )
    decode(args, index, source)


if __name__ == "__main__":
    main()
