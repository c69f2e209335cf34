"""KVSlotAllocator: slot 0 / page 0 is padding, page-aligned allocation, clear errors."""

from __future__ import annotations

import pytest

from services.scheduler.allocator import DoubleFreeError, KVSlotAllocator, SlotError


@pytest.mark.parametrize("page_size", [1, 16])
def test_total_excludes_padding_and_rounds_down(page_size):
    a = KVSlotAllocator(10 * page_size + page_size - 1, page_size)
    assert a.total == 10 * page_size
    assert a.num_free == a.total
    slots = a.alloc(a.total)
    assert slots is not None and len(slots) == a.total
    assert 0 not in slots and min(slots) == page_size  # the whole first page is padding
    assert sorted(slots) == list(range(page_size, 11 * page_size))
    assert a.num_free == 0
    a.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_returns_none_and_takes_nothing_when_short(page_size):
    a = KVSlotAllocator(4 * page_size, page_size)
    assert a.alloc(4 * page_size + 1) is None
    assert a.num_free == a.total
    got = a.alloc(3 * page_size)
    assert a.alloc(page_size + 1) is None
    assert a.num_free == page_size
    a.free(got)
    assert a.num_free == a.total
    a.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_then_realloc_reuses_slots(page_size):
    a = KVSlotAllocator(8 * page_size, page_size)
    first = a.alloc(8 * page_size)
    a.free(first)
    again = a.alloc(8 * page_size)
    assert sorted(again) == sorted(first)


def test_page_aligned_allocation_fills_the_current_page_first():
    ps = 4
    a = KVSlotAllocator(5 * ps, ps)
    s = a.alloc(6)  # positions 0..5: one whole page, half of the next
    assert len(s) == 6
    assert s[0] % ps == 0 and s[:4] == list(range(s[0], s[0] + 4))
    assert s[4] % ps == 0 and s[5] == s[4] + 1
    assert a.num_free == 3 * ps  # two pages taken
    more = a.alloc(5, cur_len=6, last_slot=s[5])  # positions 6..10
    assert more[:2] == [s[5] + 1, s[5] + 2]  # rest of the half-used page
    assert more[2] % ps == 0 and more[2:] == list(range(more[2], more[2] + 3))
    assert a.num_free == 2 * ps
    # Every position k of the sequence sits at page offset k % ps.
    for pos, slot in enumerate(s + more):
        assert slot % ps == pos % ps


def test_pages_needed_and_slots_needed():
    a = KVSlotAllocator(64, 16)
    assert a.pages_needed(0) == 0
    assert a.pages_needed(1) == 1
    assert a.pages_needed(16) == 1
    assert a.pages_needed(17) == 2
    assert a.pages_needed(5, cur_len=12) == 1  # 4 fit in the current page, 1 spills
    assert a.pages_needed(4, cur_len=12) == 0
    assert a.slots_needed(17) == 32
    b = KVSlotAllocator(64, 1)
    assert b.slots_needed(7, cur_len=3) == 7


def test_alloc_within_current_page_takes_no_new_page():
    a = KVSlotAllocator(32, 16)
    s = a.alloc(3)
    free_before = a.num_free
    more = a.alloc(2, cur_len=3, last_slot=s[-1])
    assert more == [s[-1] + 1, s[-1] + 2]
    assert a.num_free == free_before


def test_paged_free_frees_whole_pages():
    a = KVSlotAllocator(64, 16)
    s = a.alloc(20)  # page X fully, page Y 4 slots
    a.free(s[16:])  # the partial page: frees page Y
    assert a.num_free == 64 - 16
    a.free([s[3]])  # any slot of page X names page X
    assert a.num_free == 64
    a.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free_raises_and_changes_nothing(page_size):
    a = KVSlotAllocator(8 * page_size, page_size)
    s = a.alloc(4 * page_size)
    a.free(s[:page_size])
    free_before = a.num_free
    with pytest.raises(DoubleFreeError, match="already free"):
        a.free(s[: 2 * page_size])  # first page free already, second not
    assert a.num_free == free_before
    a.free(s[page_size:])  # the untouched rest is still freeable exactly once
    assert a.num_free == a.total
    a.check()


def test_same_slot_twice_in_one_free_raises():
    a = KVSlotAllocator(8)
    s = a.alloc(3)
    with pytest.raises(DoubleFreeError, match="same slot twice"):
        a.free([s[0], s[1], s[0]])
    assert a.num_free == 5
    a.free(s)
    a.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_of_padding_or_out_of_range_raises(page_size):
    a = KVSlotAllocator(4 * page_size, page_size)
    s = a.alloc(page_size)
    with pytest.raises(SlotError, match="padding"):
        a.free([0])
    with pytest.raises(SlotError, match="out of range"):
        a.free([10_000])
    with pytest.raises(SlotError, match="out of range"):
        a.free([-5])
    assert a.num_free == 3 * page_size
    a.free(s)
    a.check()


def test_negative_sizes_raise():
    a = KVSlotAllocator(8)
    with pytest.raises(SlotError, match="negative"):
        a.alloc(-1)
    with pytest.raises(SlotError, match="cur_len"):
        a.slots_needed(1, cur_len=-2)
    with pytest.raises(SlotError):
        KVSlotAllocator(-1)
    with pytest.raises(SlotError):
        KVSlotAllocator(8, page_size=0)


def test_last_slot_must_match_the_position():
    a = KVSlotAllocator(64, 16)
    s = a.alloc(3)
    with pytest.raises(SlotError, match="offset"):
        a.alloc(2, cur_len=3, last_slot=s[0])  # s[0] is position 0, not 2
    with pytest.raises(SlotError, match="not an allocated slot"):
        a.alloc(2, cur_len=3, last_slot=48 + 2)  # a free page
    assert a.num_free == 48


def test_is_free():
    a = KVSlotAllocator(2)
    assert not a.is_free(0) and not a.is_free(3)
    s = a.alloc(1)
    assert not a.is_free(s[0])
    a.free(s)
    assert a.is_free(s[0])


def test_fresh_pages_then_freed_ones_and_the_free_set_shrinks_exactly():
    a = KVSlotAllocator(10_000)
    first = a.alloc(9_000)
    assert first == list(range(1, 9_001))  # fresh pages in order
    with pytest.raises(DoubleFreeError, match="already free"):
        a.free([9_001])  # never handed out: free already
    a.free(first)  # 9,000 freed pages: above the size from which the set is rebuilt
    again = a.alloc(8_990)  # freed pages first (last freed first), then none fresh
    assert again == first[::-1][:8_990]
    a.check()  # the freed set was rebuilt smaller: it must still be exact
    with pytest.raises(DoubleFreeError, match="already free"):
        a.free(again[-1:] + first[:1])  # first[0] is still free
    assert a.num_free == 1_010
    rest = a.alloc(1_010)
    assert rest == first[9::-1] + list(range(9_001, 10_001))
    assert a.alloc(1) is None
    a.free(rest + again)
    assert a.num_free == a.total
    a.check()
