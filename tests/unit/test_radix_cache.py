"""Radix cache unit tests, each at page size 1 and 16.

Sequences are written in "pages": ``seq(1, 2, 3)`` is three pages whose tokens are all 1,
2 and 3 (one token per page at page size 1), so the same test reads alike at both sizes.
"""

from __future__ import annotations

import pytest

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.cache_integrity import CacheIntegrityError, SlotLeakError
from services.scheduler.eviction import LeafHeap, LRUPolicy, policy_names
from services.scheduler.radix_cache import (
    CacheLockError,
    DisabledCache,
    RadixCache,
    check_slot_integrity,
    create_prefix_cache,
)

PAGE_SIZES = [1, 16]


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def ps(request) -> int:
    return request.param


def seq(ps: int, *pages: int) -> list[int]:
    return [t for p in pages for t in [p] * ps]


def make(ps: int, pages: int = 64, policy: str = "lru", **kw) -> tuple[RadixCache, KVSlotAllocator]:
    alloc = KVSlotAllocator(pages * ps, ps)
    return RadixCache(alloc, ps, policy, **kw), alloc


def put(cache: RadixCache, alloc: KVSlotAllocator, tokens: list[int], ns: str = "", prio: int = 0):
    """A request that computed all its tokens: alloc, insert, free duplicates and tail."""
    slots = alloc.alloc(len(tokens))
    res = cache.insert_prefix(tokens, slots, ns, prio)
    kept = len(tokens) - len(tokens) % cache.page_size
    alloc.free(slots[: res.prefix_len] + slots[kept:])
    return res, slots


def check(cache, alloc, held: int = 0) -> None:
    cache.check_integrity()
    check_slot_integrity(alloc, cache, held)
    alloc.check()


def cached_len(cache, tokens, ns: str = "") -> int:
    """Match length without side effects on the policy that matter to these tests."""
    return len(cache.match_prefix(tokens, ns).slots)


# -- match / insert -----------------------------------------------------------------------
def test_empty_cache_matches_nothing_and_root_lock_is_a_no_op(ps):
    cache, alloc = make(ps)
    m = cache.match_prefix(seq(ps, 1, 2))
    assert m.slots == []
    cache.lock(m.node)
    cache.unlock(m.node)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.size_info() == (0, 0)
    check(cache, alloc)


def test_insert_then_match_full_and_partial(ps):
    cache, alloc = make(ps)
    tokens = seq(ps, 1, 2, 3)
    res, slots = put(cache, alloc, tokens)
    assert res.prefix_len == 0
    assert cache.match_prefix(tokens).slots == slots
    m = cache.match_prefix(seq(ps, 1, 2, 4))
    assert m.slots == slots[: 2 * ps]  # the match ends inside [1,2,3]: it is split there
    assert cache.match_prefix(seq(ps, 1, 2, 3, 4, 5)).slots == slots
    assert cached_len(cache, seq(ps, 2, 1)) == 0
    assert cache.size_info() == (3 * ps, 0)
    check(cache, alloc)


def test_match_prompt_never_covers_the_whole_prompt(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    assert len(cache.match_prompt(seq(ps, 1, 2, 3)).slots) == 2 * ps  # prompt-1, whole pages
    assert len(cache.match_prompt(seq(ps, 1, 2, 3) + [9]).slots) == 3 * ps
    assert len(cache.match_prompt(seq(ps, 1)[:1]).slots) == 0
    assert len(cache.match_prompt([]).slots) == 0


def test_insert_returns_what_was_already_there(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    res, _ = put(cache, alloc, seq(ps, 1, 2, 4, 5))
    assert res.prefix_len == 2 * ps
    res, _ = put(cache, alloc, seq(ps, 1, 2, 4))
    assert res.prefix_len == 3 * ps  # everything was there: all duplicates
    assert cache.size_info().evictable == 5 * ps  # [1,2] + [3] + [4] + [5]
    check(cache, alloc)


def test_insert_node_ends_at_the_last_inserted_token(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    res, _ = put(cache, alloc, seq(ps, 1, 2))  # ends inside [1,2,3]: split, node = [1,2]
    cache.lock(res.node)
    assert cache.size_info() == (ps, 2 * ps)
    cache.unlock(res.node)
    check(cache, alloc)


def test_only_whole_pages_are_cached():
    ps = 16
    cache, alloc = make(ps)
    tokens = list(range(100, 140))  # 40 tokens: 2 pages + 8
    res, slots = put(cache, alloc, tokens)
    assert cache.size_info().evictable == 32
    assert cache.match_prefix(tokens).slots == slots[:32]
    # A sequence that leaves the cached one inside the second page reuses the first only.
    other = tokens[:20] + [7] * 20
    assert cached_len(cache, other) == 16
    res, _ = put(cache, alloc, other)
    assert res.prefix_len == 16
    check(cache, alloc)


def test_insert_resuming_at_the_locked_match_is_the_same_insert(ps):
    # Two identical histories; the second resumes each insert at the request's locked match.
    runs = []
    for resume in (False, True):
        cache, alloc = make(ps)
        put(cache, alloc, seq(ps, 1, 2, 3, 4))
        put(cache, alloc, seq(ps, 1, 2, 5))
        tokens = seq(ps, 1, 2, 3, 6, 7)
        m = cache.match_prompt(tokens)
        cache.lock(m.node)
        own = alloc.alloc(len(tokens) - len(m.slots))
        slots = m.slots + own
        res = cache.insert_prefix(tokens, slots, start=m.node if resume else None)
        assert res.prefix_len == 3 * ps
        assert cache.path_slots(res.node) == cache.match_prefix(tokens, peek=True).slots
        cache.unlock(m.node)
        alloc.free(own[: res.prefix_len - len(m.slots)])
        check(cache, alloc)
        # The insert stamps its whole path for the eviction policy, resumed or not.
        stamps, node = set(), res.node
        while not node.anchor:
            stamps.add(node.last_access)
            node = node.parent
        runs.append((res.prefix_len, cache.size_info(), cache.path_slots(res.node), stamps))
    assert runs[0] == runs[1]
    assert len(runs[1][3]) == 1


def test_insert_start_must_be_in_the_tree_and_the_namespace(ps):
    cache, alloc = make(ps)
    res, _ = put(cache, alloc, seq(ps, 1, 2), ns="a")
    tokens = seq(ps, 1, 2, 3)
    with pytest.raises(ValueError, match="namespace"):
        cache.insert_prefix(tokens, alloc.alloc(len(tokens)), "b", start=res.node)
    cache.evict(2 * ps)
    with pytest.raises(CacheLockError, match="no longer in the tree"):
        cache.insert_prefix(tokens, alloc.alloc(len(tokens)), "a", start=res.node)
    with pytest.raises(CacheLockError, match="no longer in the tree"):
        cache.path_slots(res.node)


def test_insert_start_beyond_the_tokens_is_ignored(ps):
    cache, alloc = make(ps)
    res, _ = put(cache, alloc, seq(ps, 1, 2, 3))
    tokens = seq(ps, 1, 2)
    slots = alloc.alloc(len(tokens))
    got = cache.insert_prefix(tokens, slots, start=res.node)  # res.node ends at 3 pages
    assert got.prefix_len == 2 * ps
    assert cache.path_slots(got.node) == cache.match_prefix(tokens, peek=True).slots
    alloc.free(slots)
    check(cache, alloc)


def test_inputs_may_be_tuples(ps):
    cache, alloc = make(ps)
    tokens = tuple(seq(ps, 4, 5))
    slots = alloc.alloc(len(tokens))
    cache.insert_prefix(tokens, tuple(slots))
    assert cache.match_prefix(tokens).slots == slots
    check(cache, alloc)


def test_namespaces_never_share(ps):
    cache, alloc = make(ps)
    _, slots_a = put(cache, alloc, seq(ps, 1, 2), ns="adapter-a")
    assert cached_len(cache, seq(ps, 1, 2)) == 0
    assert cached_len(cache, seq(ps, 1, 2), "adapter-b") == 0
    assert cache.match_prefix(seq(ps, 1, 2), "adapter-a").slots == slots_a
    res, slots_b = put(cache, alloc, seq(ps, 1, 2), ns="adapter-b")
    assert res.prefix_len == 0
    assert cache.match_prefix(seq(ps, 1, 2), "adapter-b").slots == slots_b
    assert set(slots_a).isdisjoint(slots_b)
    check(cache, alloc)


# -- locking ------------------------------------------------------------------------------
def test_lock_protects_the_path_and_counts_stay_right(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    put(cache, alloc, seq(ps, 1, 2, 4))
    m = cache.match_prefix(seq(ps, 1, 2, 3))
    cache.lock(m.node)
    assert cache.size_info() == (ps, 3 * ps)  # [4] evictable; [1,2] and [3] protected
    assert cache.evict(100 * ps) == ps  # only [4] can go
    assert cache.match_prefix(seq(ps, 1, 2, 3)).slots == m.slots
    check(cache, alloc)
    cache.unlock(m.node)
    assert cache.size_info() == (3 * ps, 0)
    check(cache, alloc)


def test_match_inside_a_node_locks_only_the_matched_part(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    m = cache.match_prefix(seq(ps, 1, 2, 9))
    cache.lock(m.node)
    assert cache.size_info() == (ps, 2 * ps)
    assert cache.evict(ps) == ps
    assert cache.size_info() == (0, 2 * ps)
    cache.unlock(m.node)
    check(cache, alloc)


def test_split_of_a_locked_node_keeps_locks(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    m = cache.match_prefix(seq(ps, 1, 2, 3))
    cache.lock(m.node)
    put(cache, alloc, seq(ps, 1, 5))  # splits the locked [1,2,3] after [1]
    assert cache.size_info() == (ps, 3 * ps)
    check(cache, alloc)
    cache.unlock(m.node)
    assert cache.size_info() == (4 * ps, 0)
    check(cache, alloc)


def test_two_requests_lock_the_same_node(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2))
    a = cache.match_prefix(seq(ps, 1, 2))
    b = cache.match_prefix(seq(ps, 1, 2))
    cache.lock(a.node)
    cache.lock(b.node)
    cache.unlock(a.node)
    assert cache.size_info() == (0, 2 * ps)
    cache.unlock(b.node)
    assert cache.size_info() == (2 * ps, 0)


def test_unlock_of_an_unlocked_node_raises(ps):
    cache, alloc = make(ps)
    res, _ = put(cache, alloc, seq(ps, 1, 2))
    with pytest.raises(CacheLockError, match="not locked"):
        cache.unlock(res.node)
    check(cache, alloc)


def test_locking_an_evicted_node_raises(ps):
    cache, alloc = make(ps)
    res, _ = put(cache, alloc, seq(ps, 1, 2))
    cache.evict(2 * ps)
    with pytest.raises(CacheLockError, match="no longer in the tree"):
        cache.lock(res.node)


# -- eviction -----------------------------------------------------------------------------
def test_evict_frees_leaves_then_their_parents(ps):
    cache, alloc = make(ps, pages=8)
    put(cache, alloc, seq(ps, 1, 2, 3))
    put(cache, alloc, seq(ps, 1, 2, 4))  # [1,2] -> [3], [4]
    assert alloc.num_free == 4 * ps
    assert cache.evict(ps) == ps  # one leaf
    assert cache.evict(ps) == ps  # the other leaf
    assert cached_len(cache, seq(ps, 1, 2, 3)) == 2 * ps
    assert cache.evict(1) == 2 * ps  # now [1,2] is a leaf; a whole node goes
    assert cache.size_info() == (0, 0)
    assert alloc.num_free == alloc.total
    assert cache.evict(5) == 0  # nothing left; the root never goes
    check(cache, alloc)


def test_evict_frees_at_least_n(ps):
    cache, alloc = make(ps)
    for first in range(1, 6):
        put(cache, alloc, seq(ps, first, 7, 7))
    freed = cache.evict(4 * ps)
    assert freed >= 4 * ps
    assert alloc.num_free == alloc.total - cache.size_info().evictable
    assert cache.evict(0) == 0
    check(cache, alloc)


def test_lru_evicts_the_least_recently_used(ps):
    cache, alloc = make(ps)
    for first in (1, 2, 3):
        put(cache, alloc, seq(ps, first, 9))
    cache.match_prefix(seq(ps, 1, 9))  # recency now: 2 < 3 < 1
    cache.evict(1)
    assert cached_len(cache, seq(ps, 2, 9)) == 0  # (a miss touches nothing)
    assert cached_len(cache, seq(ps, 3, 9)) == 2 * ps
    assert cached_len(cache, seq(ps, 1, 9)) == 2 * ps  # recency now: 3 < 1
    cache.evict(1)
    assert cached_len(cache, seq(ps, 3, 9)) == 0
    assert cached_len(cache, seq(ps, 1, 9)) == 2 * ps


def test_lfu_evicts_the_least_hit_then_the_oldest(ps):
    cache, alloc = make(ps, policy="lfu")
    for first in (1, 2, 3):
        put(cache, alloc, seq(ps, first))
    for _ in range(3):
        cache.match_prefix(seq(ps, 1))
    cache.match_prefix(seq(ps, 3))
    cache.match_prefix(seq(ps, 2))
    cache.match_prefix(seq(ps, 2))  # hits: 1 -> 3, 2 -> 2, 3 -> 1
    cache.evict(1)
    assert cached_len(cache, seq(ps, 3)) == 0
    cache.evict(1)
    assert cached_len(cache, seq(ps, 2)) == 0
    assert cache.size_info().evictable == ps


@pytest.mark.parametrize("protected_hits", [2, 3])
def test_slru_probationary_goes_before_protected(ps, protected_hits):
    cache, alloc = make(ps, policy="slru", slru_protected_hits=protected_hits)
    put(cache, alloc, seq(ps, 1))
    put(cache, alloc, seq(ps, 2))
    cache.match_prefix(seq(ps, 1))
    cache.match_prefix(seq(ps, 1))  # 1: two hits, oldest access after this
    cache.match_prefix(seq(ps, 2))  # 2: one hit, most recent
    cache.evict(1)
    gone = 2 if protected_hits == 2 else 1  # protected 1 survives; else plain LRU
    assert cache.match_prefix(seq(ps, gone)).slots == []


def test_priority_evicts_low_priority_first_and_takes_the_max(ps):
    cache, alloc = make(ps, policy="priority")
    put(cache, alloc, seq(ps, 1), prio=5)
    put(cache, alloc, seq(ps, 2), prio=0)  # more recent but less important
    put(cache, alloc, seq(ps, 3), prio=0)
    cache.match_prefix(seq(ps, 3), priority=9)  # a priority-9 request used it: max is 9
    cache.evict(1)
    assert [len(cache.match_prefix(seq(ps, f)).slots) for f in (1, 2, 3)] == [ps, 0, ps]
    cache.evict(1)
    assert len(cache.match_prefix(seq(ps, 1)).slots) == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_peek_is_not_a_use(ps, policy):
    cache, alloc = make(ps, policy=policy)
    put(cache, alloc, seq(ps, 1))
    put(cache, alloc, seq(ps, 2))
    cache.match_prefix(seq(ps, 2))  # 2: one hit and the latest use
    for _ in range(3):
        assert len(cache.match_prompt(seq(ps, 1, 7), peek=True).slots) == ps
    cache.evict(1)
    assert cache.match_prefix(seq(ps, 1), peek=True).slots == []
    assert len(cache.match_prefix(seq(ps, 2), peek=True).slots) == ps


@pytest.mark.parametrize("policy", policy_names())
def test_no_policy_can_pin_only_locks_do(ps, policy):
    cache, alloc = make(ps, policy=policy)
    for first in range(1, 5):
        put(cache, alloc, seq(ps, first, 8), prio=first)
        for _ in range(first):
            cache.match_prefix(seq(ps, first, 8), priority=first)
    keep = cache.match_prefix(seq(ps, 2, 8))
    cache.lock(keep.node)
    assert cache.evict(10**6) == 6 * ps  # everything but the locked path
    assert cache.size_info() == (0, 2 * ps)
    cache.unlock(keep.node)
    check(cache, alloc)


def test_evict_negative_raises(ps):
    cache, _ = make(ps)
    with pytest.raises(ValueError, match="negative"):
        cache.evict(-1)


def test_leaf_heap_re_files_touched_nodes_and_stays_bounded():
    class Node:
        def __init__(self, t: int):
            self.last_access, self.hit_count, self.priority, self.heap_seq = t, 0, 0, -1

    heap = LeafHeap(LRUPolicy().score)
    a, b = Node(1), Node(2)
    heap.push(a)
    heap.push(b)
    a.last_access = 3  # touched after filing: b is older now
    assert heap.pop(lambda n: True) is b
    for _ in range(5000):  # lock/unlock cycles re-file the same node
        heap.push(a)
    assert len(heap) == 1 and len(heap._heap) <= 2 * len(heap) + 1024
    assert heap.pop(lambda n: False) is None  # no candidate left
    assert len(heap) == 0


# -- reset --------------------------------------------------------------------------------
def test_reset_returns_every_slot(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2, 3))
    put(cache, alloc, seq(ps, 1, 4), ns="x")
    cache.reset()
    assert alloc.num_free == alloc.total
    assert cache.size_info() == (0, 0)
    assert cached_len(cache, seq(ps, 1, 2, 3)) == 0
    check(cache, alloc)
    put(cache, alloc, seq(ps, 1, 2))  # usable again afterwards
    check(cache, alloc)


def test_reset_refuses_while_locked_and_changes_nothing(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2))
    m = cache.match_prefix(seq(ps, 1, 2))
    cache.lock(m.node)
    with pytest.raises(CacheLockError, match="locked"):
        cache.reset()
    assert cache.match_prefix(seq(ps, 1, 2)).slots == m.slots
    assert cache.size_info() == (0, 2 * ps)
    cache.unlock(m.node)
    check(cache, alloc)


def test_stale_handle_after_reset_cannot_be_locked(ps):
    cache, alloc = make(ps)
    res, _ = put(cache, alloc, seq(ps, 1, 2))
    cache.reset()
    with pytest.raises(CacheLockError):
        cache.lock(res.node)


# -- bad calls and integrity --------------------------------------------------------------
def test_bad_calls_raise(ps):
    cache, alloc = make(ps)
    with pytest.raises(ValueError, match="tokens but"):
        cache.insert_prefix(seq(ps, 1, 2), [1])
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixCache(alloc, ps, "fifo")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(alloc, ps * 2)
    with pytest.raises(ValueError, match="slru_protected_hits"):
        RadixCache(alloc, ps, "slru", slru_protected_hits=0)
    check(cache, alloc)


def test_paged_insert_rejects_slots_that_are_not_whole_pages():
    cache, alloc = make(16)
    slots = alloc.alloc(32)
    bad = slots[1:16] + slots[:1] + slots[16:]  # first page out of order
    with pytest.raises(ValueError, match="whole page"):
        cache.insert_prefix(list(range(32)), bad)
    alloc.free(slots)
    check(cache, alloc)


def test_integrity_check_catches_a_wrong_counter(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2))
    cache._evictable += 1
    with pytest.raises(CacheIntegrityError, match="recount"):
        cache.check_integrity()


def test_integrity_check_catches_a_broken_lock_count(ps):
    cache, alloc = make(ps)
    put(cache, alloc, seq(ps, 1, 2))
    res, _ = put(cache, alloc, seq(ps, 1, 2, 3))
    res.node.lock_ref = 1  # child locked, parent not: impossible
    with pytest.raises(CacheIntegrityError):
        cache.check_integrity()


def test_integrity_check_catches_a_slot_the_allocator_calls_free(ps):
    cache, alloc = make(ps)
    _, slots = put(cache, alloc, seq(ps, 1, 2))
    alloc.free(slots[:ps])  # a bug elsewhere frees a cached page
    with pytest.raises(CacheIntegrityError, match="allocator calls free"):
        cache.check_integrity()


def test_slot_integrity_names_all_four_numbers(ps):
    cache, alloc = make(ps, pages=10)
    put(cache, alloc, seq(ps, 1, 2))
    held = alloc.alloc(3 * ps)
    m = cache.match_prefix(seq(ps, 1))
    cache.lock(m.node)
    check_slot_integrity(alloc, cache, held_by_requests=len(held))
    with pytest.raises(SlotLeakError) as err:
        check_slot_integrity(alloc, cache, held_by_requests=0)
    msg = str(err.value)
    for part in (
        f"free {5 * ps}",
        f"evictable {ps}",
        f"protected {ps}",
        "held by requests 0",
        f"total is {10 * ps}",
        f"leaked: {3 * ps}",
    ):
        assert part in msg


# -- disabled cache and the factory -------------------------------------------------------
def test_disabled_cache_keeps_nothing(ps):
    alloc = KVSlotAllocator(8 * ps, ps)
    cache = create_prefix_cache(alloc, ps, disable=True, policy="lru", slru_protected_hits=2)
    assert isinstance(cache, DisabledCache)
    slots = alloc.alloc(2 * ps)
    res = cache.insert_prefix(seq(ps, 1, 2), slots)
    assert res.prefix_len == 0
    assert cache.match_prompt(seq(ps, 1, 2, 3)).slots == []
    cache.lock(res.node)
    cache.unlock(res.node)
    assert cache.evict(10) == 0
    assert cache.size_info() == (0, 0)
    check_slot_integrity(alloc, cache, held_by_requests=2 * ps)  # the caller still owns them
    alloc.free(slots)
    cache.reset()
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.insert_prefix([1], [])


def test_factory_and_policy_names():
    assert policy_names() == ["lfu", "lru", "priority", "slru"]
    alloc = KVSlotAllocator(64, 16)
    cache = create_prefix_cache(alloc, 16, disable=False, policy="slru", slru_protected_hits=3)
    assert isinstance(cache, RadixCache) and cache.page_size == 16
    assert cache.policy.name == "slru" and cache.policy.protected_hits == 3
