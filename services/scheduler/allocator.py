"""KV slot allocator: which slots of the worker's KV pool are free (slot numbers, no tensors).

Slot 0 is padding and never handed out; with page_size p > 1 slots come in pages of p and
the whole first page is reserved. Never-used pages are a watermark (``_fresh`` up); given-
back pages sit in a stack plus a set for C-level double-free checks. Why the *freed* set,
not a used one: a serving pool stays nearly full, so it stays small and rehashes cheaply.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

# Below this size the free set's table fits in cache: not worth rebuilding smaller.
_SHRINK_MIN = 4096


class SlotError(ValueError):
    """A bad slot number or size (nothing was changed)."""


class DoubleFreeError(SlotError):
    """Freeing a slot (page) that is already free."""


class KVSlotAllocator:
    def __init__(self, num_slots: int, page_size: int = 1):
        if page_size < 1:
            raise SlotError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0:
            raise SlotError(f"num_slots must be >= 0, got {num_slots}")
        self.page_size = page_size
        self._num_pages = num_slots // page_size  # usable pages are 1 .. _num_pages
        self._fresh = 1  # pages _fresh .. _num_pages were never handed out
        self._free_pages: list[int] = []  # pages given back; the top is handed out first
        self._free_set: set[int] = set()  # the same pages, for membership
        self._free_set_peak = 0

    # -- sizes ------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Usable slots (excludes the padding page)."""
        return self._num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return self._num_free_pages() * self.page_size

    def _num_free_pages(self) -> int:
        return len(self._free_pages) + self._num_pages + 1 - self._fresh

    def slots_needed(self, n: int, cur_len: int = 0) -> int:
        return self.pages_needed(n, cur_len) * self.page_size

    def pages_needed(self, n: int, cur_len: int = 0) -> int:
        _check_sizes(n, cur_len)
        ps = self.page_size
        room = (-cur_len) % ps  # unused slots left in the page of position cur_len - 1
        return -(-max(0, n - room) // ps)

    def is_free(self, slot: int) -> bool:
        page = slot // self.page_size
        return 0 < page <= self._num_pages and (page >= self._fresh or page in self._free_set)

    # -- alloc / free -----------------------------------------------------------------
    def alloc(self, n: int, cur_len: int = 0, last_slot: int = 0) -> list[int] | None:
        """n slots for positions cur_len .. cur_len+n-1 of a sequence whose position cur_len-1
        sits in ``last_slot`` (its page is filled first). None (nothing taken) if too few."""
        need = self.pages_needed(n, cur_len)
        if need > self._num_free_pages():
            return None
        ps = self.page_size
        out: list[int] = []
        if ps > 1 and cur_len % ps:
            self._check_owned_slot(last_slot, cur_len)
            fill = min(n, ps - cur_len % ps)
            out.extend(range(last_slot + 1, last_slot + 1 + fill))
            n -= fill
        if need == 0:
            return out
        pages = self._take_pages(need)
        if ps == 1:
            return pages
        for page in pages:
            out.extend(range(page * ps, page * ps + ps))
        del out[len(out) - (need * ps - n) :]  # the last page may be only partly used
        return out

    def _take_pages(self, need: int) -> list[int]:
        freed = self._free_pages
        take = min(need, len(freed))
        pages = freed[len(freed) - take :]
        del freed[len(freed) - take :]
        pages.reverse()
        if take:
            self._free_set.difference_update(pages)
            peak = self._free_set_peak
            if peak > _SHRINK_MIN and len(self._free_set) * 8 < peak:
                self._shrink_free_set()
        if take < need:
            fresh = self._fresh
            pages.extend(range(fresh, fresh + need - take))
            self._fresh = fresh + need - take
        return pages

    def free(self, slots: Sequence[int]) -> None:
        """Gives back the pages the slots lie in. Raises, changing nothing, on slot 0, an
        out-of-range slot, a slot already free or one given twice."""
        if len(slots) == 0:
            return
        ps = self.page_size
        pages = slots if ps == 1 else {s // ps for s in slots}
        if min(pages) < 1 or max(pages) >= self._fresh:
            raise self._bad_free(slots)
        free = self._free_set
        before = len(free)
        free.update(pages)  # one C-level pass; the count tells whether all were in use
        if len(free) - before != len(pages):
            raise self._undo_bad_free(slots, pages)
        if len(free) > self._free_set_peak:
            self._free_set_peak = len(free)
        self._free_pages.extend(pages)

    def _shrink_free_set(self) -> None:
        """A set never shrinks its table, so after a mass free it would keep missing the
        cache; rebuilt once it lost 7/8 of its peak (amortized O(1) per page)."""
        self._free_set = set(self._free_pages)
        self._free_set_peak = len(self._free_set)

    # -- checks -----------------------------------------------------------------------
    def check(self) -> None:
        """Full self-check (O(pool)): every usable page is exactly once free or in use."""
        free = set(self._free_pages)
        if len(free) != len(self._free_pages):
            raise RuntimeError("allocator: a page is twice in the free list")
        if free != self._free_set:
            raise RuntimeError("allocator: the free list and the free set differ")
        if not 1 <= self._fresh <= self._num_pages + 1:
            raise RuntimeError(f"allocator: fresh-page watermark {self._fresh} is off the pool")
        if not free <= set(range(1, self._fresh)):
            raise RuntimeError(
                "allocator: the free list holds pages never handed out or off the pool"
            )

    def _undo_bad_free(self, slots: Sequence[int], pages: Collection[int]) -> SlotError:
        """Undoes what a bad free() put in the set (O(pool), error path only)."""
        self._free_set = set(self._free_pages)  # the list was not touched: it is the truth
        return self._bad_free(slots)

    def _bad_free(self, slots: Sequence[int]) -> SlotError:
        free_now = self._free_set
        ps, last = self.page_size, (self._num_pages + 1) * self.page_size - 1
        pad = [s for s in slots if 0 <= s < ps]
        if pad:
            return SlotError(f"slot {pad[0]} lies in the padding page and is never allocated")
        out = [s for s in slots if not 0 <= s <= last]
        if out:
            return SlotError(f"slots out of range 1..{last}: {out[:8]}")
        bad = [s for s in slots if s // ps in free_now or s // ps >= self._fresh]
        if bad:
            return DoubleFreeError(f"slots already free: {bad[:8]}")
        return DoubleFreeError(f"free() was given the same slot twice: {_first_dup(slots)}")

    def _check_owned_slot(self, last_slot: int, cur_len: int) -> None:
        ps = self.page_size
        page = last_slot // ps
        if not 0 < page < self._fresh or page in self._free_set:
            raise SlotError(f"last_slot {last_slot} is not an allocated slot")
        if last_slot % ps != (cur_len - 1) % ps:
            raise SlotError(
                f"last_slot {last_slot} sits at offset {last_slot % ps} of its page, but "
                f"position {cur_len - 1} belongs at offset {(cur_len - 1) % ps} (page_size {ps})"
            )


def _check_sizes(n: int, cur_len: int) -> None:
    if n < 0:
        raise SlotError(f"cannot allocate a negative number of slots ({n})")
    if cur_len < 0:
        raise SlotError(f"cur_len must be >= 0, got {cur_len}")


def _first_dup(slots: Sequence[int]) -> int:
    seen: set[int] = set()
    for s in slots:
        if s in seen:
            return s
        seen.add(s)
    raise AssertionError("no duplicate")  # only called after a duplicate was detected
