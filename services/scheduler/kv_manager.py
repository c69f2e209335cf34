"""Request-level KV bookkeeping: the allocator and the radix cache seen through one request.

The scheduler never touches slots directly. Every slot stays in exactly one place
(allocator, tree, or one request).
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
        """The allocator and cache for a worker pool of pool_slots slots (and host tier)."""
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
        return self.cache.take_copies()

    def has_copies(self) -> bool:
        return bool(self.cache.host is not None and self.cache.host.copies)

    # -- sizes ------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.allocator.total

    @property
    def available(self) -> int:
        """Free slots plus those evicting unlocked cache would free."""
        return self.allocator.num_free + self.cache.size_info().evictable

    @property
    def used(self) -> int:
        return self.total - self.allocator.num_free - self.cache.size_info().evictable

    @property
    def usage(self) -> float:
        return self.used / max(1, self.total)

    def held_by_requests(self) -> int:
        return sum(self._held.values())

    def _own_pages_slots(self, req: Req) -> int:
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
        """Locks the longest cached prefix (at most ``limit``); returns its length."""
        ids = req.fill_ids if limit is None else req.fill_ids[: limit + 1]
        m = self.cache.match_prompt(ids, req.namespace, req.priority)
        self.cache.lock(m.node)
        req.node = m.node
        req.kv_slots = m.slots  # a fresh list per match: the request may own it
        req.locked_len = len(m.slots)
        req.table_dirty = True
        return req.locked_len

    def unmatch(self, req: Req) -> None:
        self.cache.unlock(req.node)
        req.node, req.kv_slots, req.locked_len = None, [], 0

    def slots_needed(self, req: Req, n: int) -> int:
        return self.allocator.slots_needed(n, req.kv_len)

    def grow(self, req: Req, n: int) -> list[int] | None:
        """n more KV slots, evicting cache if needed; None if impossible."""
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
        # Free whole pages only.
        first_free = -(-keep // ps) * ps if ps > 1 else keep
        gone = req.kv_slots[max(first_free, req.locked_len) :]
        if gone:
            self.allocator.free(gone)
        del req.kv_slots[keep:]
        self._sync_held(req)

    def commit(self, req: Req, n: int | None = None) -> bool:
        """Inserts the KV of the first n positions (default: all) and re-locks. True when the
        tree held some under other slots: the worker's table row must be rewritten."""
        n = req.kv_len if n is None else n
        # req.node is the locked match of the first locked_len tokens: resume there.
        kv = req.kv_slots if n == req.kv_len else req.kv_slots[:n]  # insert only reads it
        res = self.cache.insert_prefix(
            req.fill_ids[:n], kv, req.namespace, req.priority, start=req.node
        )
        dup = req.kv_slots[req.locked_len : res.prefix_len]
        if dup:
            self.allocator.free(dup)
        # A match of the n tokens would land on the insert's node: no second walk.
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
        """Its KV goes to the tree (cache_it) or back to the allocator."""
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
        """Slot invariant (raises SlotLeakError) plus the tree's own check."""
        self.cache.check_integrity()
        check_slot_integrity(self.allocator, self.cache, self.held_by_requests())

    def flush(self) -> None:
        self.cache.reset()


def usable_slots(pool_slots: int, page_size: int) -> int:
    """Slots within the worker's pool (1..pool_slots) in whole pages, page 0 reserved."""
    if page_size == 1:
        return pool_slots
    return max(0, (pool_slots + 1) // page_size - 1) * page_size
