"""Seed experiments 1 and 2 (/work/shared/SEED-EXPERIMENTS.md) at library level, on token ids.

No tokenizer: token-id sequences of the same shape as the published prompts, served through
the scheduler's request lifecycle: match_prompt, lock, allocate the rest, "compute",
insert prompt + output[:-1], free duplicates and the tail, unlock. ``cached(X)`` is the
matched length. Run with ``-s`` to see the tables.
"""

from __future__ import annotations

import pytest

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.radix_cache import RadixCache, check_slot_integrity, common_prefix_len

OUTPUT_TOKENS = 1  # max_tokens 1 is enough for these experiments


def serve(cache: RadixCache, alloc: KVSlotAllocator, prompt: list[int]) -> int:
    """One request's KV bookkeeping; returns cached(prompt)."""
    m = cache.match_prompt(prompt)
    cache.lock(m.node)
    cached = len(m.slots)
    own = alloc.alloc(len(prompt) - cached + OUTPUT_TOKENS, cached, m.slots[-1] if cached else 0)
    assert own is not None
    check_slot_integrity(alloc, cache, held_by_requests=alloc.slots_needed(len(own), cached))
    output = [90_000 + i for i in range(OUTPUT_TOKENS)]  # "compute": the sampled tokens
    seq = prompt + output[:-1]  # the last token has no KV
    slots = m.slots + own
    res = cache.insert_prefix(seq, slots[: len(seq)])
    kept = len(seq) - len(seq) % cache.page_size
    alloc.free(slots[cached : res.prefix_len] + slots[kept:])
    cache.unlock(m.node)
    cache.check_integrity()
    check_slot_integrity(alloc, cache, held_by_requests=0)
    return cached


def fresh(page_size: int) -> tuple[RadixCache, KVSlotAllocator]:
    alloc = KVSlotAllocator(4096, page_size)
    return RadixCache(alloc, page_size), alloc


def paged(n: int, page_size: int) -> int:
    return page_size * (n // page_size)


# -- experiment 1: the tree grows branches -------------------------------------------------
P = list(range(1000, 1021))  # 21 tokens, like the published P
A = P + list(range(2000, 2009))  # 30 tokens
B = P + list(range(3000, 3010))  # leaves A's branch right after P
C = A + list(range(4000, 4005))  # follows A to its end


@pytest.mark.parametrize("page_size", [1, 16])
def test_experiment_1_tree_grows_branches(page_size):
    cache, alloc = fresh(page_size)
    got = {name: serve(cache, alloc, prompt) for name, prompt in (("A", A), ("B", B), ("C", C))}
    print(f"\nexperiment 1, page size {page_size}: A {len(A)} tokens, hits {got}")
    assert got["A"] == 0
    assert got["B"] == paged(common_prefix_len(A, B), page_size)
    assert got["C"] == paged(common_prefix_len(A, C), page_size)
    if page_size == 1:  # the published run: B hit 21 (= P), C hit 30 (= all of A)
        assert (got["B"], got["C"]) == (len(P), len(A))
        assert got["C"] > got["B"]


# -- experiment 2: any shared length is reused (page size 1), unlike full blocks -----------
def pair(n: int, marker: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a 12-token marker plus n repeats of one word token, then
    different last tokens."""
    shared = [marker + i for i in range(12)] + [777] * n
    return shared + [501], shared + [502]


def test_experiment_2_any_shared_length_is_reused():
    rows = []
    caches = {ps: fresh(ps) for ps in (1, 16)}
    for idx, n in enumerate([0, 2, 7, 20]):
        first, second = pair(n, marker=10_000 * (idx + 1))
        shared = common_prefix_len(first, second)
        hits = {}
        for ps, (cache, alloc) in caches.items():
            assert serve(cache, alloc, first) == 0
            hits[ps] = serve(cache, alloc, second)
        assert hits[1] == len(second) - 1 == shared  # everything but the last token
        assert hits[16] == 16 * (shared // 16)  # what full-block hashing gives
        assert hits[1] - hits[16] == shared % 16 <= 15
        rows.append((n, len(second), shared, hits[1], hits[16], hits[1] - hits[16]))
    print("\nexperiment 2: second prompt of each pair")
    print(f"{'N':>3} {'prompt':>6} {'shared':>6} {'hit@1':>6} {'hit@16':>6} {'gap':>4}")
    for row in rows:
        print("{:>3} {:>6} {:>6} {:>6} {:>6} {:>4}".format(*row))
