"""KV slot allocator: which slots of the worker's KV pool are free (slot numbers, no tensors).

Slot 0 is padding (the worker points unused table entries at it) and is never handed out.
With ``page_size`` p > 1 slots come in pages of p consecutive slots and the whole first
page is reserved, so that one request's positions k*p .. k*p+p-1 share one page:

    page_size = 4, num_slots = 8:
    slot:   0  1  2  3 | 4  5  6  7 | 8  9 10 11
    page:   0 (padding) | 1          | 2
    usable: -- -- -- -- | yes ...    | yes ...     total = 8

The free pages sit in a stack (a list: the top is handed out first) and the allocated ones
in a set, so that a free() of hundreds of slots is checked (padding, range, double free)
with a few C-level set operations rather than a Python loop per slot. Plain Python beats
numpy here: converting a list of slots to an array costs more than the set operations.
Memory: about 80 bytes per page (a Python int in the stack or the set), i.e. ~160 MB for
a pool of 2M slots at page_size 1; a page size of 16 needs 16x less.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class SlotError(ValueError):
    """A bad slot number or size given to the allocator (nothing was changed)."""


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
        # Descending, so that a fresh allocator hands out pages 1, 2, 3, ... (readable logs).
        self._free_pages: list[int] = list(range(self._num_pages, 0, -1))
        self._used: set[int] = set()

    # -- sizes ------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Usable slots (excludes the padding page)."""
        return self._num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free_pages) * self.page_size

    def slots_needed(self, n: int, cur_len: int = 0) -> int:
        """Free slots that ``alloc(n, cur_len, ...)`` would consume (whole new pages)."""
        return self.pages_needed(n, cur_len) * self.page_size

    def pages_needed(self, n: int, cur_len: int = 0) -> int:
        """New pages that ``alloc(n, cur_len, ...)`` takes: the rest of the current page first."""
        _check_sizes(n, cur_len)
        ps = self.page_size
        room = (-cur_len) % ps  # unused slots left in the page of position cur_len - 1
        return -(-max(0, n - room) // ps)

    def is_free(self, slot: int) -> bool:
        """Whether ``slot``'s page is free (slot 0 and out-of-range slots are never free)."""
        page = slot // self.page_size
        return 0 < page <= self._num_pages and page not in self._used

    # -- alloc / free -----------------------------------------------------------------
    def alloc(self, n: int, cur_len: int = 0, last_slot: int = 0) -> list[int] | None:
        """n slots for positions cur_len .. cur_len+n-1 of one sequence whose position
        cur_len-1 sits in ``last_slot``. With page_size > 1 the rest of last_slot's page is
        used first, then whole new pages. None (nothing taken) when too few pages are free."""
        need = self.pages_needed(n, cur_len)
        if need > len(self._free_pages):
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
        pages = self._free_pages[-need:]
        del self._free_pages[-need:]
        pages.reverse()
        self._used.update(pages)
        if ps == 1:
            return pages
        for page in pages:
            out.extend(range(page * ps, page * ps + ps))
        del out[len(out) - (need * ps - n) :]  # the last page may be only partly used
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Gives slots back; with page_size > 1 the distinct pages they lie in (the caller
        guarantees nobody else uses those pages). Raises, changing nothing, on slot 0, an
        out-of-range slot, a slot already free or one given twice."""
        if len(slots) == 0:
            return
        ps = self.page_size
        pages = slots if ps == 1 else {s // ps for s in slots}
        used = self._used
        before = len(used)
        used.difference_update(pages)  # one C-level pass; the count tells whether all were in use
        if before - len(used) != len(pages):
            raise self._undo_bad_free(slots, pages)
        self._free_pages.extend(pages)

    # -- checks -----------------------------------------------------------------------
    def check(self) -> None:
        """Full self-check (O(pool)): every usable page is exactly once free or in use."""
        free = set(self._free_pages)
        if len(free) != len(self._free_pages):
            raise RuntimeError("allocator: a page is twice in the free list")
        if free & self._used:
            raise RuntimeError(
                f"allocator: pages both free and in use: {sorted(free & self._used)[:8]}"
            )
        if free | self._used != set(range(1, self._num_pages + 1)):
            raise RuntimeError("allocator: free + used pages are not exactly the usable pages")

    def _undo_bad_free(self, slots: Sequence[int], pages: Collection[int]) -> SlotError:
        """Puts back the pages a bad free() took out of use; returns the error naming why.
        O(pool), but only on the error path."""
        free_now = set(self._free_pages)
        self._used.update(p for p in set(pages) if p not in free_now and 1 <= p <= self._num_pages)
        ps, last = self.page_size, (self._num_pages + 1) * self.page_size - 1
        pad = [s for s in slots if 0 <= s < ps]
        if pad:
            return SlotError(f"slot {pad[0]} lies in the padding page and is never allocated")
        out = [s for s in slots if not 0 <= s <= last]
        if out:
            return SlotError(f"slots out of range 1..{last}: {out[:8]}")
        bad = [s for s in slots if s // ps in free_now]
        if bad:
            return DoubleFreeError(f"slots already free: {bad[:8]}")
        return DoubleFreeError(f"free() was given the same slot twice: {_first_dup(slots)}")

    def _check_owned_slot(self, last_slot: int, cur_len: int) -> None:
        ps = self.page_size
        if last_slot // ps not in self._used:
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
