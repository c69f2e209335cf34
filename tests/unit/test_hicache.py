"""The hierarchical cache (issue 36): a host tier behind the device pool. Evicted prefixes
are demoted to it and loaded back into fresh device slots at admission instead of being
recomputed; the fake worker, which reads every token back through its slots, proves the
KV that returns is the KV that left, at page size 1 and 16 and with every write policy."""

from __future__ import annotations

import random

import pytest

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.host_tier import Direction
from services.scheduler.radix_cache import RadixCache
from tests.fake_worker import expected, make, run, submit


def _cache(device: int, host: int, ps: int = 1, **kw) -> RadixCache:
    return RadixCache(KVSlotAllocator(device, ps), ps, "lru", host_slots=host, **kw)


def _fill(cache: RadixCache, tokens: list[int]) -> list[int]:
    short = len(tokens) - cache.allocator.num_free
    if short > 0:
        cache.evict(short)
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    res = cache.insert_prefix(tokens, slots)
    cache.allocator.free(slots[: res.prefix_len])
    return slots


def test_eviction_demotes_and_a_match_loads_back():
    cache = _cache(device=64, host=256)
    a, b = list(range(1, 41)), list(range(100, 140))
    a_slots = _fill(cache, a)
    cache.evict(40)  # a goes to the host tier
    copies = cache.take_copies()
    assert [c.direction for c in copies] == [Direction.DEVICE_TO_HOST]
    assert copies[0].src == a_slots and cache.size_info().evictable == 0
    _fill(cache, b)
    m = cache.match_prefix(a)
    assert len(m.slots) == 40  # served from the host tier, into fresh device slots
    loads = cache.take_copies()
    assert [c.direction for c in loads][-1] == Direction.HOST_TO_DEVICE
    assert loads[-1].src == copies[0].dst and loads[-1].dst == m.slots
    cache.check_integrity()


def test_peek_counts_only_the_device_part_and_loads_nothing():
    cache = _cache(device=64, host=256)
    a = list(range(1, 41))
    _fill(cache, a)
    cache.evict(40)
    cache.take_copies()
    assert cache.match_prefix(a, peek=True).slots == []
    assert cache.take_copies() == []


def test_a_full_host_tier_drops_the_oldest_and_the_slots_add_up():
    cache = _cache(device=32, host=64)
    seqs = [[1000 * i + j for j in range(32)] for i in range(1, 6)]
    for seq in seqs:
        _fill(cache, seq)
    cache.check_integrity()
    assert cache.host is not None and cache.host.used <= 64
    assert cache.host.counters.dropped > 0
    assert len(cache.match_prefix(seqs[-1]).slots) == 32
    assert cache.match_prefix(seqs[0]).slots == []  # gone from both tiers
    cache.check_integrity()


def test_an_insert_through_host_only_nodes_adopts_the_requests_slots():
    cache = _cache(device=128, host=256)
    a = list(range(1, 41))
    _fill(cache, a)
    cache.evict(40)
    cache.take_copies()
    slots = cache.allocator.alloc(60)
    assert slots is not None
    res = cache.insert_prefix(a + list(range(200, 220)), slots)
    assert res.prefix_len == 0  # nothing on the device before: no slot is a duplicate
    assert cache.path_slots(res.node) == slots
    cache.check_integrity()


def test_write_through_copies_at_insert_and_eviction_then_copies_nothing():
    cache = _cache(device=64, host=256, write_policy="write_through")
    _fill(cache, list(range(1, 41)))
    assert [c.direction for c in cache.take_copies()] == [Direction.DEVICE_TO_HOST]
    cache.evict(40)
    assert cache.take_copies() == []  # the host copy already exists
    cache.check_integrity()


def test_write_through_selective_copies_at_the_second_hit():
    cache = _cache(device=64, host=256, write_policy="write_through_selective")
    a = list(range(1, 41))
    _fill(cache, a)
    cache.match_prefix(a)
    assert cache.take_copies() == []
    cache.match_prefix(a)
    assert [c.direction for c in cache.take_copies()] == [Direction.DEVICE_TO_HOST]


def test_flush_empties_both_tiers():
    cache = _cache(device=64, host=256)
    _fill(cache, list(range(1, 41)))
    cache.evict(40)
    cache.reset()
    assert cache.host is not None and cache.host.used == 0
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_multi_turn_beyond_the_pool_is_token_exact_and_reuses_the_host_tier(page_size, policy):
    """Chat sessions whose histories outgrow the device pool: every turn's answer is what
    the fake model gives the true sequence (so every loaded slot held the right KV), and
    later turns hit far more with the host tier than without."""
    hits = {}
    for host in (0, 8192):
        rng = random.Random(7)
        sched, worker = make(
            num_slots=640,
            max_running=4,
            host_slots=host,
            page_size=page_size,
            hicache_write_policy=policy,
        )
        sessions = {s: [rng.randrange(1, 900) for _ in range(80)] for s in range(8)}
        cached = 0
        for turn in range(4):
            for s, hist in sessions.items():
                submit(sched, f"s{s}t{turn}", hist, 12)
            final = run(sched)
            for s, hist in sessions.items():
                got = final[f"s{s}t{turn}"]
                assert not got.error_code, got.finish_message
                assert list(got.token_ids) == expected(hist, 12)
                if turn:
                    cached += got.cached_tokens
                hist += list(got.token_ids) + [rng.randrange(1, 900) for _ in range(20)]
            sched.check_idle()
        hits[host] = cached
        if host:
            assert worker.copied["h2d"] > 0 and worker.copied["d2h"] > 0
    assert hits[8192] > 2 * hits[0], hits


@pytest.mark.parametrize("page_size", [1, 16])
def test_host_tier_loads_with_chunked_prefill_and_retraction_stay_exact(page_size, caplog):
    """A pool small enough that decode retracts requests, prompts prefilled in chunks, and
    prefixes coming back from the host tier into those chunks: every answer is the true
    sequence's, and nothing is held once idle."""
    rng = random.Random(5)
    sched, worker = make(
        num_slots=640, max_running=16, host_slots=8192, page_size=page_size,
        chunked_prefill_size=48,
    )  # fmt: skip
    prompts = {
        f"p{i}": [rng.randrange(1, 900) for _ in range(rng.randrange(40, 120))] for i in range(12)
    }
    cached = 0
    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        for round_ in range(2):
            for rid, prompt in prompts.items():
                submit(sched, f"{rid}r{round_}", prompt, 60)
            got = run(sched)
            for rid, prompt in prompts.items():
                d = got[f"{rid}r{round_}"]
                assert list(d.token_ids) == expected(prompt, 60), (rid, round_)
                cached += d.cached_host_tokens if round_ else 0
            sched.check_idle()
    assert "Retract requests" in caplog.text
    assert cached > 0 and worker.copied["h2d"] > 0
