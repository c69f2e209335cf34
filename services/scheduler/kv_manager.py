"""Request-level KV bookkeeping: the allocator and the radix cache seen through one request.

The scheduler never touches slots directly; it asks this manager to match a request's
prefix, grow its KV, hand finished KV to the tree and give back what the tree did not
keep. Every slot stays in exactly one place (allocator, tree, or one request).
"""

from __future__ import annotations

from services.common.config import SchedulerConfig
from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.cache_events import TreeEvents
from services.scheduler.radix_cache import (
    BasePrefixCache,
    check_slot_integrity,
    create_prefix_cache,
)
from services.scheduler.request import Req
from services.scheduler.storage_tier import StorageTier


class KVManager:
    def __init__(self, allocator: KVSlotAllocator, cache: BasePrefixCache):
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self._held: dict[str, int] = {}  # rid -> own slots (whole pages) held outside the tree

    @classmethod
    def for_pool(
        cls,
        pool_slots: int,
        cfg: SchedulerConfig,
        host_slots: int = 0,
        storage: StorageTier | None = None,
        events: TreeEvents | None = None,
    ) -> KVManager:
        """The allocator and cache for a worker whose KV pool has pool_slots slots (and
        whose host tier host_slots, and storage tier ``storage``: the hierarchical cache)."""
        allocator = KVSlotAllocator(usable_slots(pool_slots, cfg.page_size), cfg.page_size)
        cache = create_prefix_cache(
            allocator,
            cfg.page_size,
            cfg.disable_radix_cache,
            cfg.radix_eviction_policy,
            cfg.slru_protected_hits,
            usable_slots(host_slots, cfg.page_size) if host_slots else 0,
            cfg.hicache_write_policy,
            storage,
            events,
        )
        return cls(allocator, cache)

    def take_copies(self) -> list:
        """Copies between the device pool and the host tier for the next batch to carry."""
        return self.cache.take_copies()

    def has_copies(self) -> bool:
        return bool(self.cache.host is not None and self.cache.host.copies)

    # -- sizes ------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.allocator.total

    @property
    def available(self) -> int:
        """Slots a new allocation can get: free now, or freed by evicting unlocked cache."""
        return self.allocator.num_free + self.cache.size_info().evictable

    @property
    def used(self) -> int:
        """Slots neither free nor evictable: held by requests or locked in the tree."""
        return self.total - self.allocator.num_free - self.cache.size_info().evictable

    @property
    def usage(self) -> float:
        """The share of the pool in use (the per-batch log's "token usage")."""
        return self.used / max(1, self.total)

    def held_by_requests(self) -> int:
        return sum(self._held.values())

    def _own_pages_slots(self, req: Req) -> int:
        """Slots the request holds outside the tree, counted in whole pages."""
        own = req.kv_len - req.locked_len
        ps = self.page_size
        return -(-own // ps) * ps if ps > 1 else own

    def _sync_held(self, req: Req) -> None:
        n = self._own_pages_slots(req)
        if n:
            self._held[req.rid] = n
        else:
            self._held.pop(req.rid, None)

    # -- request lifecycle ------------------------------------------------------------
    def match(self, req: Req, limit: int | None = None) -> int:
        """Locks the longest cached prefix of the request (never its last token, nor more
        than ``limit`` tokens); returns its length."""
        ids = req.fill_ids if limit is None else req.fill_ids[: limit + 1]
        m = self.cache.match_prompt(ids, req.namespace, req.priority)
        self.cache.lock(m.node)
        req.node = m.node
        req.kv_slots = m.slots  # a fresh list per match: the request may own it
        req.locked_len = len(m.slots)
        req.table_dirty = True
        return req.locked_len

    def unmatch(self, req: Req) -> None:
        """Undoes match() for a request that could not be scheduled after all."""
        self.cache.unlock(req.node)
        req.node, req.kv_slots, req.locked_len = None, [], 0

    def slots_needed(self, req: Req, n: int) -> int:
        return self.allocator.slots_needed(n, req.kv_len)

    def grow(self, req: Req, n: int) -> list[int] | None:
        """n more KV slots for the request, evicting cache if needed; None if impossible."""
        need = self.slots_needed(req, n)
        if need > self.allocator.num_free:
            self.cache.evict(need - self.allocator.num_free)
        last = req.kv_slots[-1] if req.kv_slots else 0
        slots = self.allocator.alloc(n, cur_len=req.kv_len, last_slot=last)
        if slots is None:
            return None
        req.kv_slots.extend(slots)
        self._sync_held(req)
        return slots

    def shrink(self, req: Req, n: int) -> None:
        """Gives back the last n slots grown for the request (a batch that was not sent)."""
        keep = req.kv_len - n
        ps = self.page_size
        # Free whole pages only: those that start at or after the first page not kept.
        first_free = -(-keep // ps) * ps if ps > 1 else keep
        gone = req.kv_slots[max(first_free, req.locked_len) :]
        if gone:
            self.allocator.free(gone)
        del req.kv_slots[keep:]
        self._sync_held(req)

    def commit(self, req: Req, n: int | None = None) -> bool:
        """Inserts the KV of the request's first n positions (default: all it has) into the
        tree and re-locks the deeper node. Slots beyond n (a step already queued) stay its own.

        Returns True when the tree already held some of those tokens under other slots:
        the request now reads the tree's slots, so the worker's table row must be rewritten.
        """
        n = req.kv_len if n is None else n
        # start: req.node is the locked match of fill_ids' first locked_len tokens, so the
        # insert resumes there instead of comparing that prefix again.
        kv = req.kv_slots if n == req.kv_len else req.kv_slots[:n]  # insert only reads it
        res = self.cache.insert_prefix(
            req.fill_ids[:n], kv, req.namespace, req.priority, start=req.node
        )
        dup = req.kv_slots[req.locked_len : res.prefix_len]
        if dup:
            self.allocator.free(dup)
        # The insert's node ends at the last whole page of the n tokens: a match of them
        # would land there, so its path gives the tree's slots without a second walk.
        node = res.node
        slots = self.cache.path_slots(node)
        self.cache.lock(node)
        self.cache.unlock(req.node)
        changed = bool(dup)
        req.kv_slots[: len(slots)] = slots
        req.node, req.locked_len = node, len(slots)
        self._sync_held(req)
        if changed:
            req.table_dirty = True
        return changed

    def release(self, req: Req, cache_it: bool = True) -> None:
        """The request leaves the running set: its KV goes to the tree (or back to the
        allocator)."""
        if req.node is None:
            return
        if cache_it and req.kv_len > req.locked_len:
            self.commit(req)
        own = req.kv_slots[req.locked_len :]
        if own:
            self.allocator.free(own)
        self.cache.unlock(req.node)
        req.node, req.kv_slots, req.locked_len = None, [], 0
        req.table_dirty = True
        self._held.pop(req.rid, None)

    def check(self) -> None:
        """Slot invariant (raises SlotLeakError naming the four counts) plus the tree's own
        check."""
        self.cache.check_integrity()
        check_slot_integrity(self.allocator, self.cache, self.held_by_requests())

    def flush(self) -> None:
        self.cache.reset()


def usable_slots(pool_slots: int, page_size: int) -> int:
    """Slots the allocator may hand out so that none exceeds the worker's pool (1..pool_slots).

    With pages, page 0 (which holds padding slot 0) is reserved and only whole pages that
    end at or before slot pool_slots count.
    """
    if page_size == 1:
        return pool_slots
    return max(0, (pool_slots + 1) // page_size - 1) * page_size
