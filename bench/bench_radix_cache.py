"""Benchmark of the scheduler's radix cache alone (no model, no tensors): not a test.

Generated-shared-prefix trace: G groups x R requests; each group has one system prompt,
each request adds its own question and produces output tokens; requests are shuffled and
the slot pool is smaller than the trace, so eviction runs. Per request it times the whole
bookkeeping lifecycle: match, lock, allocate (evicting as needed), insert, free duplicates
and the tail, unlock. Then it times ``evict`` on a tree with many evictable leaves.

    .venv/bin/python bench/bench_radix_cache.py [--page-size 16] [--policy lfu]
                                                   (figures: docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array

from services.common.transport import pack_i32
from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.eviction import policy_names
from services.scheduler.radix_cache import RadixCache, TreeNode, check_slot_integrity
from services.scheduler.tokens import Tokens, as_tokens, tokens_from_wire


def build_trace(args: argparse.Namespace, rng: random.Random) -> list[tuple[Tokens, Tokens]]:
    """(prompt, output) per request, shuffled. Each prompt is an int32 token array unpacked
    from its own packed bytes, as the scheduler builds a request's ids from the wire
    (tokens_from_wire); the output is the array the request's sampled tokens fill."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    systems = [ids(args.system_len) for _ in range(args.groups)]
    trace = []
    for g in range(args.groups):
        for _ in range(args.per_group):
            wire = pack_i32(systems[g] + ids(args.question_len))
            trace.append((tokens_from_wire(wire), as_tokens(ids(args.output_len))))
    rng.shuffle(trace)
    return trace


def admit(
    cache: RadixCache, alloc: KVSlotAllocator, prompt: Tokens, output: Tokens
) -> tuple[TreeNode, int, list[int], Tokens]:
    """Arrival: match and lock the cached prefix, allocate slots for every other token
    (evicting if short); returns the locked node, the cached length, the request's slots
    and the sequence to insert."""
    m = cache.match_prompt(prompt)
    cache.lock(m.node)
    cached = len(m.slots)
    n_new = len(prompt) - cached + len(output)  # uncached prompt + every output token
    short = alloc.slots_needed(n_new, cached) - alloc.num_free
    if short > 0:
        cache.evict(short)
    new = alloc.alloc(n_new, cached, m.slots[-1] if cached else 0)
    if new is None:
        raise RuntimeError("pool too small for one request")
    slots = m.slots  # a fresh list the caller owns (as KVManager.match keeps it): no copy
    slots += new
    return m.node, cached, slots, prompt + output[:-1]  # the last output token has no KV


def serve_one(cache: RadixCache, alloc: KVSlotAllocator, prompt: Tokens, output: Tokens) -> int:
    """One request's KV bookkeeping, as the scheduler does it; returns the cached length."""
    node, cached, slots, seq = admit(cache, alloc, prompt, output)
    last = slots.pop()  # the last output token's slot (no KV to cache): insert takes the rest
    # start: the locked match is seq's prefix, as KVManager.commit passes req.node.
    res = cache.insert_prefix(seq, slots, start=node)
    slots.append(last)
    kept = len(seq) - len(seq) % cache.page_size
    # Duplicates the request computed itself, plus what the tree did not take.
    alloc.free(slots[cached : res.prefix_len] + slots[kept:])
    cache.unlock(node)
    return cached


def bench_trace(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    for _ in range(args.warmup):  # a long-running server is warm: grown heap, no page faults
        alloc = KVSlotAllocator(args.pool, args.page_size)
        cache = RadixCache(alloc, args.page_size, args.policy)
        for prompt, output in build_trace(args, rng):
            serve_one(cache, alloc, prompt, output)
    trace = build_trace(args, rng)
    alloc = KVSlotAllocator(args.pool, args.page_size)
    cache = RadixCache(alloc, args.page_size, args.policy)
    wall, cpu, hit, total = [], [], 0, 0
    for prompt, output in trace:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        hit += serve_one(cache, alloc, prompt, output)
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
        total += len(prompt)
    check_slot_integrity(alloc, cache, 0)
    cache.check_integrity()
    ref = compare_reference(rng, args.system_len)
    print(
        f"trace: {args.groups} groups x {args.per_group} requests, system {args.system_len}, "
        f"question {args.question_len}, output {args.output_len}, pool {args.pool}, "
        f"page_size {args.page_size}, policy {args.policy}, "
        f"int32 token arrays, {args.warmup} warm-up pass(es)"
    )
    for name, ns in (("wall", wall), ("cpu", cpu)):
        us = sorted(t / 1000 for t in ns)
        print(
            f"  per request ({name:4s}): median {statistics.median(us):6.1f} us, "
            f"p90 {us[int(0.9 * len(us))]:6.1f} us, mean {statistics.fmean(us):6.1f} us "
            f"over {len(us)} requests"
        )
        print(
            f"    median = {statistics.median(us) / ref:.1f} x one bare comparison of two "
            f"{args.system_len}-token lists ({ref:.1f} us now: the machine-speed yardstick)"
        )
    print(f"  hit rate: {hit / total:.3f} ({hit} of {total} prompt tokens)")


def compare_reference(rng: random.Random, n: int) -> float:
    """Median us of ``a == b`` for two equal n-token lists of distinct int objects: a
    machine-speed yardstick, so per-request figures can be read as a ratio on a busy
    machine (the tree itself compares int32 arrays, ~20x faster than this)."""
    a = [rng.randrange(1 << 15) for _ in range(n)]
    b = array("i", a).tolist()
    times = []
    for _ in range(301):
        t0 = time.thread_time_ns()
        _ = a == b
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1000


def build_wide_tree(
    args: argparse.Namespace, rng: random.Random
) -> tuple[RadixCache, KVSlotAllocator]:
    """args.leaves evictable leaves: 100 shared prefixes of 2 pages, each with leaves of 1 page,
    touched again in random order so the heap holds stale scores."""
    ps = max(args.page_size, 16)
    groups = 100
    per = args.leaves // groups
    alloc = KVSlotAllocator((groups * 2 + args.leaves + 4) * ps, args.page_size)
    cache = RadixCache(alloc, args.page_size, args.policy)
    seqs = []
    for g in range(groups):
        prefix = [g] + [rng.randrange(args.vocab) for _ in range(2 * ps - 1)]
        for i in range(per):
            seq = prefix + [i] + [rng.randrange(args.vocab) for _ in range(ps - 1)]
            slots = alloc.alloc(len(seq))
            assert slots is not None  # the pool is sized for every leaf
            res = cache.insert_prefix(seq, slots)
            alloc.free(slots[: res.prefix_len])
            seqs.append(seq)
    rng.shuffle(seqs)
    for seq in seqs[: len(seqs) // 2]:
        cache.match_prefix(seq)
    return cache, alloc


def bench_evict(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    times = []
    for _ in range(args.evict_repeats):
        cache, alloc = build_wide_tree(args, rng)
        t0 = time.thread_time_ns()
        freed = cache.evict(args.evict_tokens)
        times.append((time.thread_time_ns() - t0) / 1000)
        cache.check_integrity()
        check_slot_integrity(alloc, cache, 0)
    med = statistics.median(times)
    print(
        f"evict({args.evict_tokens}) from {args.leaves} evictable leaves "
        f"(leaf = {max(args.page_size, 16)} tokens, freed {freed}): median {med:.0f} us "
        f"over {args.evict_repeats} trees, {med * 1000 / freed:.0f} ns per freed token"
    )
    # What the heap saves: one scan of all leaves for the minimum score, per evicted leaf.
    cache, _ = build_wide_tree(args, rng)
    leaves = [
        n
        for anchor in cache.root.children.values()
        for p in anchor.children.values()
        for n in p.children.values()
    ]
    t0 = time.thread_time_ns()
    min(leaves, key=cache.policy.score)
    scan = (time.thread_time_ns() - t0) / 1000
    print(
        f"  for scale: one scan of the {len(leaves)} leaves for the lowest score takes "
        f"{scan:.0f} us (needed per evicted leaf without the heap)"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--policy", default="lru", choices=policy_names())
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--pool", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed passes over a trace (fresh cache) before the timed one",
    )
    p.add_argument("--leaves", type=int, default=10_000)
    p.add_argument("--evict-tokens", type=int, default=1_000)
    p.add_argument("--evict-repeats", type=int, default=5)
    args = p.parse_args()
    bench_trace(args)
    bench_evict(args)


if __name__ == "__main__":
    main()
