"""Property test of the storage tier: the tiered cache's state machine with a volume behind
the host tier, pages that vanish from it, loads that fail and workers that restart (new
device and host tiers, the same volume). Every slot still carries what the KV written there
stands for, and every match returns exactly the KV of the tokens it matched, whichever
tier it came back from."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.host_tier import WRITE_POLICIES, Direction
from services.scheduler.radix_cache import RadixCache
from services.scheduler.storage_tier import StorageTier
from tests.property.test_hicache_property import TieredCacheMachine
from tests.property.test_radix_cache_property import NAMESPACES, token_lists


class StorageCacheMachine(TieredCacheMachine):
    storage_pages = 2  # storage page = this many KV pages

    @initialize(policy=st.sampled_from(["lru", "lfu"]), write=st.sampled_from(WRITE_POLICIES))
    def setup(self, policy, write):
        super().setup(policy, write)
        self.policy, self.write = policy, write
        self.volume: dict[bytes, list] = {}  # page key -> each token's content
        self.answers: list[tuple[int, int]] = []
        self.fail_next = False
        self._new_cache()

    def _new_cache(self) -> None:
        ps = self.page_size
        self.alloc = KVSlotAllocator(self.pool_pages * ps, ps)
        storage = StorageTier(self.storage_pages * ps, b"engine")
        self.cache = RadixCache(
            self.alloc, ps, self.policy, host_slots=self.host_pages * ps,
            write_policy=self.write, storage=storage,
        )  # fmt: skip
        self.device, self.host = {}, {}

    def apply_copies(self) -> None:
        p = self.storage_pages * self.page_size
        for c in self.cache.take_copies():
            if c.direction is Direction.DEVICE_TO_STORAGE:
                for i, key in enumerate(c.keys):
                    page = [self.device[s] for s in c.src[i * p : (i + 1) * p]]
                    assert self.volume.setdefault(key, page) == page, "one key, two contents"
            elif c.direction is Direction.STORAGE_TO_HOST:
                found = 0
                for i, key in enumerate(c.keys):
                    if self.fail_next or key not in self.volume:
                        break
                    for d, content in zip(
                        c.dst[i * p : (i + 1) * p], self.volume[key], strict=True
                    ):
                        self.host[d] = content
                    found += 1
                self.answers.append((c.load_id, found))
                self.fail_next = False
            else:
                frm, to = (
                    (self.device, self.host)
                    if c.direction is Direction.DEVICE_TO_HOST
                    else (self.host, self.device)
                )
                for s, d in zip(c.src, c.dst, strict=True):
                    to[d] = frm[s]

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), fail=st.booleans())
    def ask_storage(self, data, ns, fail):
        """A new request asks the volume for what the tree lacks; the answer settles it."""
        tokens = data.draw(token_lists(self.page_size))
        if self.seen and data.draw(st.booleans()):
            tokens, ns = data.draw(st.sampled_from(self.seen))
        self.fail_next = fail
        event(f"volume {bool(self.volume)}")
        if self.cache.ask_storage(tokens, ns):
            self.apply_copies()
            for load_id, found in self.answers:
                event(f"found {found > 0}")
                self.cache.storage_answer(load_id, found)
            self.answers.clear()
        self.fail_next = False
        m = self.cache.match_prompt(tokens, ns)
        self.apply_copies()
        self.check_slots(tokens, ns, m.slots)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def serve(self, data, ns):
        """A request from start to finish (its KV reaches the tree, then the volume)."""
        r = self.start_request(data, ns)
        if r is not None:
            self.finish_request(r)

    @rule(data=st.data())
    def lose_a_page(self, data):
        if self.volume:
            self.volume.pop(data.draw(st.sampled_from(sorted(self.volume))))

    @rule()
    def restart_worker(self):
        """The worker is killed: device and host tiers are gone, the volume stays."""
        if not self.in_flight:
            self._new_cache()


class StorageCacheMachinePage16(StorageCacheMachine):
    page_size = 16
    pool_pages = 6
    host_pages = 8
    storage_pages = 2


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestStoragePage1 = StorageCacheMachine.TestCase
TestStoragePage1.settings = _SETTINGS
TestStoragePage16 = StorageCacheMachinePage16.TestCase
TestStoragePage16.settings = _SETTINGS
