"""Property test: random request lifecycles against a brute-force model of the cache.

The model is, per namespace, the set of cached sequences (whole pages). What the tree
should match is the longest common prefix with any of them; what it should hold is the
number of distinct page-prefixes. After an eviction the model is re-read from the tree
(the policy decides *which* leaves go) and checked: only unlocked tokens went, at least n
of them when possible, and exactly as many as the allocator got back.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.eviction import policy_names
from services.scheduler.radix_cache import (
    CacheLockError,
    RadixCache,
    check_slot_integrity,
    common_prefix_len,
)

NAMESPACES = ["", "salt"]


def token_lists(ps: int) -> st.SearchStrategy[list[int]]:
    """Small alphabets, so prefixes collide; at page size 16, sequences of a few shared
    chunks (two of which part inside a page) plus a partial-page tail."""
    if ps == 1:
        return st.lists(st.integers(0, 2), max_size=8)
    chunks = [[0] * 16, [1] * 16, [0] * 8 + [1] * 8, [0] * 15 + [2]]
    body = st.lists(st.sampled_from(chunks), max_size=3).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.integers(0, 1), max_size=5)
    return st.builds(lambda b, t: b + t, body, tail)


@given(
    a=st.lists(st.integers(0, 2), max_size=80),
    b=st.lists(st.integers(0, 2), max_size=80),
    start=st.integers(0, 80),
)
def test_common_prefix_len_is_the_definition(a, b, start):
    """The helper the model below relies on, against its definition (its bisection must
    find the first mismatch anywhere, and an end inside tokens)."""
    start = min(start, len(b))
    for end in (None, len(b), (start + len(b)) // 2):
        tail = b[start:end]
        pairs = enumerate(zip(a, tail, strict=False))
        want = next((i for i, (x, y) in pairs if x != y), min(len(a), len(tail)))
        assert common_prefix_len(a, b, start, end) == want


class Request:
    def __init__(self, tokens, ns, node, matched_slots, own, held):
        self.tokens, self.ns, self.node = tokens, ns, node
        self.matched_slots, self.own, self.held = matched_slots, own, held


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    pool_pages = 40
    requests = Bundle("requests")

    @initialize(policy=st.sampled_from(policy_names()))
    def setup(self, policy):
        ps = self.page_size
        self.alloc = KVSlotAllocator(self.pool_pages * ps, ps)
        self.cache = RadixCache(self.alloc, ps, policy, slru_protected_hits=2)
        self.model: dict[str, set[tuple[int, ...]]] = {ns: set() for ns in NAMESPACES}
        self.held = 0
        self.in_flight: list[Request] = []

    # -- the model ----------------------------------------------------------------------
    def aligned(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def expected_match(self, tokens, ns) -> int:
        best = max((common_prefix_len(list(s), tokens) for s in self.model[ns]), default=0)
        return best - best % self.page_size

    def model_size(self) -> int:
        ps = self.page_size
        prefixes = {
            (ns, s[:k])
            for ns in NAMESPACES
            for s in self.model[ns]
            for k in range(ps, len(s) + 1, ps)
        }
        return len(prefixes) * ps

    def evict(self, n: int) -> int:
        """cache.evict(n), then re-read the model from the tree and check what went."""
        info, before = self.cache.size_info(), self.model_size()
        free_before = self.alloc.num_free
        freed = self.cache.evict(n)
        assert freed >= min(n, info.evictable)
        assert freed <= info.evictable, "a locked token was evicted"
        assert self.alloc.num_free - free_before == freed
        for ns in NAMESPACES:
            kept = set()
            for s in self.model[ns]:
                m = len(self.cache.match_prefix(list(s), ns).slots)
                assert m <= len(s)
                if m:
                    kept.add(s[:m])
            self.model[ns] = kept
        assert before - self.model_size() == freed
        for r in self.in_flight:  # locked prefixes survive whole
            assert (
                self.cache.match_prefix(r.tokens[: len(r.matched_slots)], r.ns).slots
                == r.matched_slots
            )
        return freed

    # -- rules --------------------------------------------------------------------------
    @rule(target=requests, tokens=st.data(), ns=st.sampled_from(NAMESPACES))
    def start_request(self, tokens, ns):
        """match_prompt, lock, allocate the rest (evicting as needed)."""
        tokens = tokens.draw(token_lists(self.page_size))
        m = self.cache.match_prompt(tokens, ns)
        want = self.expected_match(tokens[:-1], ns)
        assert len(m.slots) == want
        self.cache.lock(m.node)
        n_own = len(tokens) - want
        need = self.alloc.slots_needed(n_own, want)
        if need > self.alloc.num_free:
            self.evict(need - self.alloc.num_free)
        own = self.alloc.alloc(n_own, want, m.slots[-1] if want else 0)
        if own is None:  # everything else is locked: give up, as the scheduler would
            assert self.alloc.num_free + self.cache.size_info().evictable < need
            self.cache.unlock(m.node)
            return None
        r = Request(tokens, ns, m.node, m.slots, own, need)
        self.held += need
        self.in_flight.append(r)
        return r

    @rule(r=consumes(requests), resume=st.booleans())
    def finish_request(self, r, resume):
        """insert prompt -> slots (resuming at the locked match or not: the same insert),
        free duplicates and the tail, unlock."""
        if r is None:
            return
        slots = r.matched_slots + r.own
        want = self.expected_match(r.tokens, r.ns)
        res = self.cache.insert_prefix(r.tokens, slots, r.ns, start=r.node if resume else None)
        assert res.prefix_len == want
        # The insert's node is where a match of the inserted tokens ends.
        peeked = self.cache.match_prefix(r.tokens, r.ns, peek=True)
        assert peeked.node is res.node
        assert self.cache.path_slots(res.node) == peeked.slots
        kept = len(self.aligned(r.tokens))
        self.alloc.free(slots[len(r.matched_slots) : res.prefix_len] + slots[kept:])
        self.cache.unlock(r.node)
        self.held -= r.held
        self.in_flight.remove(r)
        if kept:
            self.model[r.ns].add(self.aligned(r.tokens))

    @rule(r=consumes(requests))
    def abort_request(self, r):
        """A request that never finished: its own slots go back, nothing is cached."""
        if r is None:
            return
        self.alloc.free(r.own)
        self.cache.unlock(r.node)
        self.held -= r.held
        self.in_flight.remove(r)

    @rule(tokens=st.data(), ns=st.sampled_from(NAMESPACES), peek=st.booleans())
    def match(self, tokens, ns, peek):
        tokens = tokens.draw(token_lists(self.page_size))
        got = self.cache.match_prefix(tokens, ns, peek=peek).slots
        assert len(got) == self.expected_match(tokens, ns)

    @rule(n=st.integers(0, 60))
    def evict_some(self, n):
        self.evict(n * self.page_size // 4 if self.page_size > 1 else n)

    @rule()
    def reset(self):
        if self.cache.size_info().protected:  # some request holds a lock
            before = self.cache.size_info()
            with pytest.raises(CacheLockError):
                self.cache.reset()
            assert self.cache.size_info() == before
        else:
            self.cache.reset()
            self.model = {ns: set() for ns in NAMESPACES}
            assert self.alloc.num_free == self.alloc.total - self.held

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def double_unlock_is_refused(self, data):
        """Unlocking one request's node once more than it was locked raises."""
        r = data.draw(st.sampled_from(self.in_flight))
        if r.node.anchor or r.node.lock_ref != 1:
            return  # shared with another request (or nothing locked): not a double unlock
        self.cache.unlock(r.node)
        with pytest.raises(CacheLockError):
            self.cache.unlock(r.node)
        self.cache.lock(r.node)

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        check_slot_integrity(self.alloc, self.cache, self.held)
        info = self.cache.size_info()
        assert info.evictable + info.protected == self.model_size()


class CacheMachinePage16(CacheMachine):
    page_size = 16
    pool_pages = 12


_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRadixCachePage1 = CacheMachine.TestCase
TestRadixCachePage1.settings = _SETTINGS
TestRadixCachePage16 = CacheMachinePage16.TestCase
TestRadixCachePage16.settings = _SETTINGS
