"""The scheduler's cache events (issue 37): what a finished request leaves in the tree is
published as block keys a router computes from the prompt alone, over a real PUB socket,
with heartbeats, snapshots at the stream's seq, and a clear when the tree is flushed."""

from __future__ import annotations

import time

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.page_keys import block_keys, split_keys
from services.scheduler import event_publisher
from services.scheduler.cache_events import TreeEvents, route_seed
from services.scheduler.event_publisher import EventPublisher
from tests.fake_worker import make, run, submit


def _apply(index: set[bytes], msg: engine_pb2.CacheEvents) -> None:
    if msg.cleared:
        index.clear()
    index -= set(split_keys(msg.removed))
    index |= set(split_keys(msg.stored))


def test_a_finished_prompt_is_published_as_the_keys_a_router_computes():
    sched, _ = make(num_slots=2048)
    assert sched.events is not None and sched.events.seed == route_seed("fake")
    prompts = {"a": list(range(1, 70)), "b": list(range(1, 40)) + [999] * 30}
    for rid, p in prompts.items():
        submit(sched, rid, p, 4, cache_salt="s" if rid == "b" else "")
    run(sched)
    index: set[bytes] = set()
    msg = sched.events.take()
    assert msg is not None and msg.seq == 1
    _apply(index, msg)
    b = sched.events.block_tokens
    for rid, p in prompts.items():
        ns = "s" if rid == "b" else ""
        want = block_keys(sched.events.seed, ns, p, 0, len(p) // b, b)
        assert set(want) <= index, rid
    # Another namespace's keys differ even for the same first tokens.
    assert not set(block_keys(sched.events.seed, "other", prompts["a"], 0, 4, b)) & index
    assert sched.flush_cache().flushed
    msg = sched.events.take()
    assert msg is not None and msg.cleared and msg.seq == 2
    _apply(index, msg)
    assert not index


def test_events_can_be_turned_off():
    sched, _ = make(cache_events_port=-1)
    assert sched.events is None and sched.kv.cache.events is None
    submit(sched, "a", list(range(1, 40)), 2)
    run(sched)


def test_the_publisher_sends_changes_heartbeats_and_snapshots_in_order(monkeypatch):
    monkeypatch.setattr(event_publisher, "HEARTBEAT_S", 0.05)
    ctx = zmq.Context()
    sched, _ = make(num_slots=1024)
    assert sched.events is not None
    pub = EventPublisher(ctx, "127.0.0.1", 0, sched.events)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # a slow joiner: heartbeats until the subscription is in
            pub.publish(0)
            time.sleep(0.06)
            assert time.monotonic() < deadline
        beat = transport.recv(sub, engine_pb2.CacheEvents)
        assert beat.seq == 0 and not beat.stored and beat.instance_id == sched.events.instance_id
        submit(sched, "a", list(range(1, 50)), 2)
        run(sched)
        pub.publish(0)
        msg = transport.recv(sub, engine_pb2.CacheEvents)
        while msg.seq == 0:  # heartbeats sent before
            msg = transport.recv(sub, engine_pb2.CacheEvents)
        assert msg.seq == 1 and len(split_keys(msg.stored)) == 49 // sched.events.block_tokens
        submit(sched, "b", list(range(100, 150)), 2)
        run(sched)
        snap = pub.snapshot(sched.kv.cache.root, 0)  # sends b's keys first
        assert snap.snapshot and snap.seq == 2
        assert len(split_keys(snap.stored)) == 2 * (49 // sched.events.block_tokens)
        assert transport.recv(sub, engine_pb2.CacheEvents).seq == 2
        pub.publish(3)  # the load alone changed: its message repeats the seq
        load = transport.recv(sub, engine_pb2.CacheEvents)
        assert (load.seq, load.num_requests, load.stored, load.removed) == (2, 3, b"", b"")
        pub.publish(3)
        assert not sub.poll(20)  # unchanged: nothing until the heartbeat
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


def test_a_new_worker_clears_what_the_routers_know():
    sched, worker = make(num_slots=1024)
    submit(sched, "a", list(range(1, 50)), 2)
    run(sched)
    assert sched.events is not None
    sched.events.take()
    sched.attach_worker(sched.link.sock, worker.info)
    msg = sched.events.take()
    assert msg is not None and msg.cleared and not msg.stored


def test_block_sizes_below_one_are_refused():
    import pytest

    with pytest.raises(ValueError, match="--cache-event-block-tokens"):
        TreeEvents(0, b"x")


def test_blocks_are_whole_pages():
    from services.scheduler.cache_events import block_tokens_for

    assert [block_tokens_for(16, p) for p in (1, 4, 16, 32, 64)] == [16, 16, 16, 32, 64]
    assert block_tokens_for(20, 16) == 32
    sched, _ = make(page_size=32)
    assert sched.events is not None and sched.events.block_tokens == 32


def test_evicting_one_of_two_sequences_that_share_part_of_a_page_keeps_the_others_blocks():
    """At page size 16, [0]*8 + [1]*8 and [0]*32 sit in sibling nodes though they share 8
    tokens: blocks of whole pages keep the shared half out of both."""
    from services.scheduler.allocator import KVSlotAllocator
    from services.scheduler.cache_events import block_tokens_for
    from services.scheduler.radix_cache import RadixCache

    cache = RadixCache(KVSlotAllocator(256, 16), 16, "lru")
    cache.events = TreeEvents(block_tokens_for(4, 16), b"seed")
    index: set[bytes] = set()
    a, b = [0] * 8 + [1] * 8, [0] * 32
    for seq in (a, b):
        slots = cache.allocator.alloc(len(seq))
        assert slots is not None
        cache.insert_prefix(seq, slots)
    msg = cache.events.take()
    assert msg is not None
    _apply(index, msg)
    cache.evict(16)  # a, the older leaf
    msg = cache.events.take()
    assert msg is not None
    _apply(index, msg)
    assert index == set(block_keys(b"seed", "", b, 0, 2, 16))
