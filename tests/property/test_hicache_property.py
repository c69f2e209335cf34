"""Property test of the hierarchical cache: random request lifecycles against a cache with
a host tier, where every slot, in either tier, carries what the KV written there stands
for (the namespace and the tokens up to its position). Copies the tree decides are applied
in order, as the worker does, and every match must return slots holding exactly the KV of
the tokens it matched: a demotion, a load, an adoption or a drop that loses track of KV
fails at once. The integrity recount covers both tiers after every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.host_tier import WRITE_POLICIES, Direction
from services.scheduler.radix_cache import RadixCache, check_slot_integrity
from tests.property.test_radix_cache_property import NAMESPACES, token_lists

Content = tuple[str, tuple[int, ...]]


class Request:
    def __init__(self, tokens, ns, node, slots, held):
        self.tokens, self.ns, self.node, self.slots, self.held = tokens, ns, node, slots, held


class TieredCacheMachine(RuleBasedStateMachine):
    page_size = 1
    pool_pages = 10
    host_pages = 14
    requests = Bundle("requests")

    @initialize(policy=st.sampled_from(["lru", "lfu"]), write=st.sampled_from(WRITE_POLICIES))
    def setup(self, policy, write):
        ps = self.page_size
        self.alloc = KVSlotAllocator(self.pool_pages * ps, ps)
        self.cache = RadixCache(
            self.alloc, ps, policy, host_slots=self.host_pages * ps, write_policy=write
        )
        self.device: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.held = 0
        self.in_flight: list[Request] = []
        self.seen: list[tuple[list[int], str]] = []  # finished prompts: a revisit may load

    def apply_copies(self) -> None:
        for c in self.cache.take_copies():
            frm, to = (
                (self.device, self.host)
                if c.direction is Direction.DEVICE_TO_HOST
                else (self.host, self.device)
            )
            for s, d in zip(c.src, c.dst, strict=True):
                to[d] = frm[s]  # a copy of a never-written slot is a bug: KeyError

    def check_slots(self, tokens, ns, slots) -> None:
        for i, s in enumerate(slots):
            assert self.device.get(s) == (ns, tuple(tokens[: i + 1])), f"slot {s} holds wrong KV"

    @rule(target=requests, data=st.data(), ns=st.sampled_from(NAMESPACES))
    def start_request(self, data, ns):
        tokens = data.draw(token_lists(self.page_size))
        m = self.cache.match_prompt(tokens, ns)
        self.apply_copies()
        self.check_slots(tokens, ns, m.slots)
        self.cache.lock(m.node)
        have, n_own = len(m.slots), len(tokens) - len(m.slots)
        need = self.alloc.slots_needed(n_own, have)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
            self.apply_copies()
        own = self.alloc.alloc(n_own, have, m.slots[-1] if have else 0)
        if own is None:
            self.cache.unlock(m.node)
            return None
        for i, s in enumerate(own):  # the request computes its KV
            self.device[s] = (ns, tuple(tokens[: have + i + 1]))
        r = Request(tokens, ns, m.node, m.slots + own, need)
        self.held += need
        self.in_flight.append(r)
        return r

    @rule(r=consumes(requests))
    def finish_request(self, r):
        if r is None:
            return
        res = self.cache.insert_prefix(r.tokens, r.slots, r.ns, start=r.node)
        self.apply_copies()
        kept = len(r.tokens) - len(r.tokens) % self.page_size
        locked = len(self.cache.path_slots(r.node)) if not r.node.anchor else 0
        tree = self.cache.path_slots(res.node)
        assert tree[:locked] == r.slots[:locked]
        self.check_slots(r.tokens, r.ns, tree)
        # What the tree did not take: duplicates before prefix_len, and the partial page.
        self.alloc.free(r.slots[locked : res.prefix_len] + r.slots[kept:])
        self.cache.unlock(r.node)
        self.held -= r.held
        self.in_flight.remove(r)
        self.seen.append((r.tokens, r.ns))

    @rule(r=consumes(requests))
    def abort_request(self, r):
        if r is None:
            return
        locked = len(self.cache.path_slots(r.node)) if not r.node.anchor else 0
        self.alloc.free(r.slots[locked:])
        self.cache.unlock(r.node)
        self.held -= r.held
        self.in_flight.remove(r)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def match(self, data, ns):
        tokens = data.draw(token_lists(self.page_size))
        m = self.cache.match_prefix(tokens, ns)
        self.apply_copies()
        self.check_slots(tokens, ns, m.slots)

    @rule(data=st.data())
    def revisit(self, data):
        """A finished prompt again (a chat's next turn): often demoted by now, so loaded."""
        if self.seen:
            tokens, ns = data.draw(st.sampled_from(self.seen))
            m = self.cache.match_prefix(tokens, ns)
            self.apply_copies()
            self.check_slots(tokens, ns, m.slots)

    @rule(n=st.integers(0, 40))
    def evict_some(self, n):
        self.cache.evict(n * self.page_size)
        self.apply_copies()

    @rule()
    def flush(self):
        if not self.cache.size_info().protected and not self.in_flight:
            self.cache.reset()
            self.apply_copies()
            assert self.cache.host is not None and self.cache.host.used == 0

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        check_slot_integrity(self.alloc, self.cache, self.held)


class TieredCacheMachinePage16(TieredCacheMachine):
    page_size = 16
    pool_pages = 6
    host_pages = 8


_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestHiCachePage1 = TieredCacheMachine.TestCase
TestHiCachePage1.settings = _SETTINGS
TestHiCachePage16 = TieredCacheMachinePage16.TestCase
TestHiCachePage16.settings = _SETTINGS
