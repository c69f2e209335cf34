"""Cache-aware routing (issue 37): the engines' trees as block-key indexes fed by their
CacheEvents, the rules of --routing-policy cache_aware, and the subscriber that follows a
stream (gaps, restarts, garbage) over real ZeroMQ PUB/SUB and a real CacheSnapshot RPC.

The schedulers' side is faked here (FakeTree): a PUB socket and a SchedulerControl servicer
over a set of keys the test changes, speaking the contract of engine.proto's CacheEvents.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import transport
from services.common.config import FrontendConfig
from services.common.curve import InternalKeys, generate_keys, serve_securely
from services.common.page_keys import block_keys
from services.frontend import engine_pool
from services.frontend.cache_events import CacheSubscriber, EventFollower, host_of
from services.frontend.cache_index import CacheIndex, PromptKeys
from services.frontend.engine_client import EngineClient
from services.frontend.engine_discovery import StaticResolver
from services.frontend.main import routing_params
from services.frontend.metrics import RoutingMetrics
from services.frontend.router import Router, RoutingParams, pick, prefix_key, ranking
from tests.server_util import free_port

SEED = b"radixserve-zen"
BT = 16  # block_tokens


def _keys(ids: list[int], salt: str = "", seed: bytes = SEED, bt: int = BT) -> list[bytes]:
    return block_keys(seed, salt, ids, 0, len(ids) // bt, bt)


def _ids(tag: int, n: int = 64) -> list[int]:
    return [(tag * 7919 + i) % 30000 + 3 for i in range(n)]


def _events(instance: str, seq: int, stored=(), removed=(), cleared=False, **kw):
    return engine_pb2.CacheEvents(
        instance_id=instance,
        seq=seq,
        block_tokens=kw.pop("block_tokens", BT),
        seed=kw.pop("seed", SEED),
        cleared=cleared,
        stored=b"".join(stored),
        removed=b"".join(removed),
        **kw,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _index(clock: Clock | None = None) -> CacheIndex:
    index = CacheIndex(pending_ttl_s=5.0, clock=clock or Clock())
    index.replace(BT, SEED, b"")
    return index


# ---- the index ---------------------------------------------------------------------------


def test_index_applies_stored_removed_and_cleared():
    index = _index()
    a, b = _keys(_ids(1)), _keys(_ids(2))
    index.apply(False, b"".join(a + b), b"")
    assert len(index) == 8
    index.apply(False, b"", b"".join(a[2:]))
    assert index.keys == set(a[:2] + b)
    index.apply(True, b"".join(a[:1]), b"")  # cleared first, then stored
    assert index.keys == {a[0]}
    index.replace(BT, SEED, b"".join(b))  # a snapshot is everything held
    assert index.keys == set(b)
    with pytest.raises(ValueError, match="whole number"):
        index.apply(False, b"x" * 15, b"")


def test_match_is_the_longest_leading_run_of_the_prompts_blocks():
    index = _index()
    ids = _ids(3, 100)  # 6 whole blocks and a partial one
    keys = _keys(ids)
    assert len(keys) == 6
    index.apply(False, b"".join(keys[:2] + keys[3:]), b"")
    assert index.match_prompt(PromptKeys("", ids)) == 2 * BT  # the hole at block 2 ends it
    index.apply(False, keys[2], b"")
    assert index.match_prompt(PromptKeys("", ids)) == 6 * BT
    assert index.match_prompt(PromptKeys("other-salt", ids)) == 0  # the namespace counts
    assert index.match_prompt(PromptKeys("", ids[:40])) == 2 * BT  # 40 tokens: 2 blocks
    changed = list(ids)
    changed[0] += 1  # a block key hashes everything before it
    assert index.match_prompt(PromptKeys("", changed)) == 0
    assert CacheIndex().match_prompt(PromptKeys("", ids)) == 0  # nothing known yet


def test_prompt_keys_are_hashed_once_per_geometry():
    prompt = PromptKeys("s", _ids(4, 70))
    first = prompt.keys(SEED, 16)
    assert prompt.keys(SEED, 16) is first
    assert prompt.keys(SEED, 32) == _keys(_ids(4, 70), "s", bt=32) and len(first) == 4
    assert prompt.keys(b"other", 16) != first


def test_pending_keys_count_until_confirmed_removed_or_expired():
    clock = Clock()
    index = _index(clock)
    ids = _ids(5)
    prompt = PromptKeys("", ids)
    index.note_sent(prompt)
    assert index.match_prompt(prompt) == 64 and len(index) == 0 and index.pending == 4
    clock.now += 4.9
    assert index.match_prompt(prompt) == 64
    clock.now += 0.2
    assert index.match_prompt(prompt) == 0 and index.pending == 0  # expired
    index.note_sent(prompt)
    keys = _keys(ids)
    index.apply(False, b"".join(keys[:2]), b"")  # the events confirm two blocks
    assert index.pending == 2
    index.apply(False, b"", keys[2])  # and say the third is gone
    assert index.pending == 1
    clock.now += 10
    assert index.match_prompt(prompt) == 32  # confirmed blocks stay; pending ones expired
    index.note_sent(prompt)
    clock.now += 3
    index.note_sent(prompt)  # sent again: counts from now
    clock.now += 3
    assert index.match_prompt(prompt) == 64
    index.apply(True, b"", b"")  # a flush: what we sent is gone too
    assert index.match_prompt(prompt) == 0 and index.pending == 0


# ---- the rules -----------------------------------------------------------------------------


NAMES = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def _choose(loads: dict[str, int], matched: dict[str, int], key: bytes = b"k", **kw):
    return Router(RoutingParams(**kw)).choose(key, loads, lambda n: matched.get(n, 0))


def test_a_an_overloaded_engine_sheds_to_the_best_of_the_rest():
    matched = {"10.0.0.1": 2048}
    kw = {"balance_abs": 4, "load_cost_tokens": 0}  # the balance rule alone
    # 10 - 5 > 4 and 10 > 1.5 x 5: .1 is out; of the rest, the least loaded
    d = _choose({"10.0.0.1": 10, "10.0.0.2": 5, "10.0.0.3": 6}, matched, **kw)
    assert (d.engine, d.branch) == ("10.0.0.2", "balance")
    # ... unless another holds some of the prompt: .3 (within the bound of .2) wins by it
    d = _choose({"10.0.0.1": 10, "10.0.0.2": 5, "10.0.0.3": 6}, {**matched, "10.0.0.3": 256}, **kw)
    assert (d.engine, d.branch, d.matched_tokens) == ("10.0.0.3", "balance", 256)
    # an overloaded engine that holds nothing of the prompt changes nothing
    d = _choose({"10.0.0.1": 0, "10.0.0.2": 10, "10.0.0.3": 1}, matched, **kw)
    assert (d.engine, d.branch) == ("10.0.0.1", "cache_hit")
    # only the absolute spread: 20 - 15 > 4 but 20 < 1.5 x 15
    d = _choose({"10.0.0.1": 20, "10.0.0.2": 15, "10.0.0.3": 16}, matched, **kw)
    assert (d.engine, d.branch) == ("10.0.0.1", "cache_hit")
    # only the relative one: 4 > 1.5 x 0 but 4 - 0 is not > 4
    d = _choose({"10.0.0.1": 4, "10.0.0.2": 0, "10.0.0.3": 0}, matched, **kw)
    assert d.branch == "cache_hit"
    # equally least loaded: rendezvous order of the prefix decides, the same everywhere
    key = prefix_key("", _ids(9))
    d = _choose({"10.0.0.1": 9, "10.0.0.2": 0, "10.0.0.3": 0}, {}, key, **kw)
    assert d.engine == next(n for n in ranking(key, NAMES) if n != "10.0.0.1")


def test_b_matched_tokens_are_weighed_against_load():
    # 64 tokens a request: a 512-token lead outweighs 7 requests more, not 8 (a tie on
    # score goes to the lower load) or 9
    matched = {"10.0.0.1": 1024, "10.0.0.2": 512}
    d = _choose({"10.0.0.1": 7, "10.0.0.2": 0, "10.0.0.3": 0}, matched, balance_abs=100)
    assert (d.engine, d.branch) == ("10.0.0.1", "cache_hit")
    d = _choose({"10.0.0.1": 8, "10.0.0.2": 0, "10.0.0.3": 0}, matched, balance_abs=100)
    assert d.engine == "10.0.0.2"
    d = _choose({"10.0.0.1": 9, "10.0.0.2": 0, "10.0.0.3": 0}, matched, balance_abs=100)
    assert (d.engine, d.branch, d.matched_tokens) == ("10.0.0.2", "balance", 512)


def test_b_a_hot_prefix_counts_as_held_by_every_engine():
    # Only .1 holds the 1,024-token system prompt; hot, it spreads by load...
    loads = {"10.0.0.1": 3, "10.0.0.2": 1, "10.0.0.3": 2}
    router = Router(RoutingParams())
    d = router.choose(b"k", loads, lambda n: 1024 if n == "10.0.0.1" else 0, hot_tokens=1024)
    assert (d.engine, d.branch) == ("10.0.0.2", "balance")
    # ... only as far as some engine holds it: cold everywhere, prefix_hash decides
    d = router.choose(b"k", loads, lambda n: 0, hot_tokens=1024)
    assert d.branch == "fallback"
    # a conversation's history beyond the hot prefix keeps it on its engine
    d = router.choose(b"k", loads, lambda n: 1536 if n == "10.0.0.1" else 0, hot_tokens=1024)
    assert (d.engine, d.branch) == ("10.0.0.1", "cache_hit")
    # cold (not hot), the holder keeps it
    d = router.choose(b"k", loads, lambda n: 1024 if n == "10.0.0.1" else 0)
    assert (d.engine, d.branch) == ("10.0.0.1", "cache_hit")


def test_hot_prefixes_are_where_prompts_fork():
    from services.frontend.hot_prefixes import HotPrefixes

    hot = HotPrefixes(forks=3, max_keys=1000)
    system = [b"s%d" % i for i in range(4)]
    conversation = system + [b"c0", b"c1"]
    for turn in range(5):  # one conversation's turns only extend it: never hot
        hot.note(conversation + [b"t%d" % turn])
        conversation = conversation + [b"t%d" % turn]
    assert hot.hot_blocks(conversation) == 0
    for other in ("a", "b"):  # two more continuations after the system prompt: 3 forks
        hot.note(system + [other.encode()])
    assert hot.hot_blocks(conversation) == len(system)
    assert hot.hot_blocks([b"s0", b"x"]) == 0
    hot = HotPrefixes(forks=2, max_keys=2)  # bounded: an old generation is dropped
    hot.note([b"a", b"b", b"c", b"d"])
    hot.note([b"e", b"f", b"g", b"h"])
    hot.note([b"a", b"z"])
    assert hot.hot_blocks([b"a"]) == 0  # "a -> b" was forgotten two generations ago


def test_b_the_most_matched_engine_wins_ties_by_load_then_rendezvous():
    loads = {n: 2 for n in NAMES}
    d = _choose(loads, {"10.0.0.1": 64, "10.0.0.2": 512, "10.0.0.3": 256})
    assert (d.engine, d.branch, d.matched_tokens) == ("10.0.0.2", "cache_hit", 512)
    tied = {"10.0.0.2": 512, "10.0.0.3": 512}
    d = _choose({**loads, "10.0.0.3": 1}, tied)
    assert d.engine == "10.0.0.3"  # same match: the lower load
    for i in range(20):
        key = prefix_key("", _ids(i))
        d = _choose(loads, tied, key)
        assert d.engine == next(n for n in ranking(key, NAMES) if n in tied)


def test_c_without_a_useful_match_prefix_hash_decides():
    rng = random.Random(3)
    for i in range(100):
        key = prefix_key("", _ids(i))
        loads = {n: rng.randrange(4) for n in NAMES}
        matched = {rng.choice(NAMES): rng.choice([0, 16])}  # below --routing-min-match-tokens
        d = _choose(loads, matched, key)
        assert d.branch == "fallback" and d.engine == pick(key, loads, 1.25)
    d = _choose({n: 0 for n in NAMES}, {"10.0.0.3": 16}, min_match_tokens=16)
    assert (d.engine, d.branch) == ("10.0.0.3", "cache_hit")


def test_other_policies():
    key = prefix_key("", _ids(1))
    loads = {"a": 3, "b": 1, "c": 1}
    assert Router(RoutingParams("prefix_hash")).choose(key, loads).engine == pick(key, loads)
    rr = Router(RoutingParams("round_robin"))
    assert [rr.choose(key, loads).engine for _ in range(4)] == ["a", "b", "c", "a"]
    least = Router(RoutingParams("least_load")).choose(key, loads)
    assert least.engine == next(n for n in ranking(key, list(loads)) if n != "a")
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingParams("random")
    with pytest.raises(ValueError):
        Router().choose(key, {})


def test_flags_make_the_params_and_are_checked():
    cfg = FrontendConfig(routing_policy="least_load", routing_balance_abs_threshold=8)
    p = routing_params(cfg)
    assert (p.policy, p.balance_abs, p.balance_rel, p.min_match_tokens) == (
        "least_load",
        8,
        1.5,
        32,
    )
    assert routing_params(FrontendConfig()).policy == "cache_aware"
    for bad in (
        {"routing_balance_rel_threshold": 0.5},
        {"routing_min_match_tokens": 0},
        {"routing_balance_abs_threshold": -1},
        {"routing_load_factor": float("nan")},
    ):
        with pytest.raises(ValueError, match="must be (a finite number )?>="):
            FrontendConfig(**bad)


def test_two_frontends_fed_the_same_events_decide_the_same():
    rng = random.Random(11)
    prompts = [_ids(i, rng.randrange(16, 200)) for i in range(40)]
    stream: dict[str, list[engine_pb2.CacheEvents]] = {n: [] for n in NAMES}
    for name in NAMES:
        held: set[bytes] = set()
        for seq in range(1, 30):
            stored = set(_keys(rng.choice(prompts))[: rng.randrange(1, 8)]) - held
            removed = set(rng.sample(sorted(held), min(len(held), rng.randrange(3))))
            held = (held | stored) - removed
            stream[name].append(_events("i-" + name, seq, sorted(stored), sorted(removed)))

    def frontend(order: list[str]) -> dict[str, CacheIndex]:
        indexes = {}
        for name in order:
            follower = EventFollower(CacheIndex())
            follower.on_snapshot(_events("i-" + name, 0, snapshot=True))
            for msg in stream[name]:
                follower.on_message(msg)
            indexes[name] = follower.index
        return indexes

    one, two = frontend(NAMES), frontend(list(reversed(NAMES)))
    routers = Router(), Router()
    branches = set()
    for _ in range(300):
        ids = rng.choice(prompts)
        loads = {n: rng.randrange(8) for n in NAMES}
        key, p1, p2 = prefix_key("", ids), PromptKeys("", ids), PromptKeys("", ids)
        a = routers[0].choose(key, loads, lambda n, p=p1: one[n].match_prompt(p))
        reordered = dict(reversed(loads.items()))
        b = routers[1].choose(key, reordered, lambda n, p=p2: two[n].match_prompt(p))
        assert a == b
        branches.add(a.branch)
    assert branches == {"cache_hit", "balance", "fallback"}


# ---- the stream, without sockets -------------------------------------------------------------


def test_follower_applies_in_order_and_asks_for_snapshots():
    f = EventFollower(CacheIndex())
    assert f.wanted == "connect"
    a, b, c = _keys(_ids(1)), _keys(_ids(2)), _keys(_ids(3))
    f.on_snapshot(_events("x", 5, a, snapshot=True))
    assert f.synced and f.wanted is None and f.index.keys == set(a)
    f.on_message(_events("x", 4, b))  # older than the snapshot: already in it
    f.on_message(_events("x", 5))  # a heartbeat
    assert f.index.keys == set(a)
    f.on_message(_events("x", 6, b, a[:1]))
    assert f.index.keys == set(a[1:] + b) and f.seq == 6
    f.on_message(_events("x", 8, c))  # 7 was lost
    assert f.wanted == "gap" and not f.synced and f.index.keys == set(a[1:] + b)
    f.on_message(_events("x", 9, c))  # nothing applies until the snapshot
    f.on_snapshot(_events("x", 9, b + c, snapshot=True))
    f.on_message(_events("x", 10))  # a heartbeat of seq 10: the change of seq 10 was lost
    assert f.wanted == "gap" and f.seq == 9
    f.on_snapshot(_events("x", 9, b + c, snapshot=True))
    assert f.index.keys == set(b + c) and f.seq == 9
    f.on_message(_events("x", 10, cleared=True))
    assert f.index.keys == set()
    f.on_message(_events("y", 1, a))  # another process
    assert f.wanted == "restart" and len(f.index) == 0 and f.index.block_tokens == 0
    f.on_snapshot(_events("y", 1, a, snapshot=True))
    f.on_message(_events("y", 2, b, block_tokens=32))  # another geometry: start over
    assert f.wanted == "restart" and len(f.index) == 0
    f.forget()
    assert f.instance is None and f.wanted is None and len(f.index) == 0
    f.on_message(_events("y", 3))  # it speaks again
    assert f.wanted == "connect"


def test_host_of_a_control_address():
    assert host_of("10.1.0.3:30101") == "10.1.0.3"
    assert host_of("[fd00::7]:30101") == "[fd00::7]"
    assert host_of("localhost:1") == "localhost"


# ---- the stream, over real sockets ---------------------------------------------------------


class FakeTree:
    """A scheduler's cache events: a PUB socket and a SchedulerControl servicer (GetStats
    reports the PUB port, CacheSnapshot the held keys), over keys the test changes."""

    def __init__(self, keys: InternalKeys | None = None, zmq_addr: str = "") -> None:
        self.ctx = zmq.Context()
        self.keys = keys
        self._lock = threading.Lock()
        self.held: set[bytes] = set()
        self.instance, self.seq = uuid.uuid4().hex, 0
        self.snapshots = 0
        self.setup, _ = serve_securely(self.ctx, keys, "scheduler", ["frontend"])
        self.router = transport.router(self.ctx, zmq_addr, self.setup) if zmq_addr else None
        self.zmq_addr = zmq_addr
        self._bind_pub()
        self.control_port = free_port()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        engine_pb2_grpc.add_SchedulerControlServicer_to_server(_Control(self), self._grpc)
        self._grpc.add_insecure_port(self.control_addr)
        self._grpc.start()

    @property
    def control_addr(self) -> str:
        return f"127.0.0.1:{self.control_port}"

    @property
    def addr(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _bind_pub(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.setup is not None:
            self.setup(self.pub)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")

    def change(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (), **kw) -> None:
        """One step of the tree; ``lost``: the message never reaches the subscriber."""
        lost, cleared = kw.get("lost", False), kw.get("cleared", False)
        with self._lock:
            if cleared:
                self.held.clear()
            stored = set(stored) - self.held
            removed = set(removed) & self.held
            self.held = (self.held | stored) - removed
            self.seq += 1
            msg = _events(self.instance, self.seq, sorted(stored), sorted(removed), cleared)
        if not lost:
            self.pub.send(msg.SerializeToString())

    def heartbeat(self) -> None:
        with self._lock:
            msg = _events(self.instance, self.seq)
        self.pub.send(msg.SerializeToString())

    def restart(self, new_port: bool = False) -> None:
        """A new scheduler process: a new instance, an empty tree (a new PUB port)."""
        with self._lock:
            self.instance, self.seq, self.held = uuid.uuid4().hex, 0, set()
            if new_port:
                self.pub.close(linger=0)
                self._bind_pub()

    def snapshot(self) -> engine_pb2.CacheEvents:
        with self._lock:
            self.snapshots += 1
            return _events(self.instance, self.seq, sorted(self.held), snapshot=True)

    def requests(self) -> list[engine_pb2.TokenizedRequest]:
        """What frontends sent so far (the ROUTER's queue, drained)."""
        got = []
        while self.router is not None and self.router.poll(0):
            _, msg = transport.recv_routed(self.router, engine_pb2.FrontendToScheduler)
            got.append(msg.generate)
        return got

    def stop_control(self) -> None:
        self._grpc.stop(0)

    def close(self) -> None:
        self._grpc.stop(0)
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.destroy(linger=0)


class _Control(engine_pb2_grpc.SchedulerControlServicer):
    def __init__(self, tree: FakeTree) -> None:
        self._tree = tree

    def GetStats(self, request, context):
        worker = engine_pb2.WorkerInfo(model_id="tiny", max_model_len=4096, vocab_size=32000)
        return engine_pb2.SchedulerStats(
            page_size=1, worker=worker, cache_events_port=self._tree.port
        )

    def CacheSnapshot(self, request, context):
        return self._tree.snapshot()


@pytest.fixture
def trees():
    made: list[FakeTree] = []

    def make(**kw) -> FakeTree:
        made.append(FakeTree(**kw))
        return made[-1]

    yield make
    for t in made:
        t.close()


async def _until(cond: Callable[[], bool], tick: Callable[[], None] | None = None, timeout=10.0):
    """Waits for ``cond``; ``tick`` (a heartbeat) runs meanwhile, as a publisher's would."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        if tick is not None:
            tick()
        await asyncio.sleep(0.02)


def _subscribe(ctx: zmq.asyncio.Context, tree: FakeTree, index: CacheIndex, reasons: list[str]):
    channel = grpc.aio.insecure_channel(tree.control_addr)
    stub = engine_pb2_grpc.SchedulerControlStub(channel)

    def snapshot():
        return stub.CacheSnapshot(engine_pb2.CacheSnapshotRequest(), timeout=5)

    sub = CacheSubscriber(ctx, tree.addr, index, snapshot, name="t", on_resync=reasons.append)
    return sub, channel


def test_a_gap_asks_a_snapshot_and_the_index_equals_the_publishers_tree(trees):
    tree = trees()
    rng = random.Random(5)
    prompts = [_keys(_ids(i, 160)) for i in range(30)]
    tree.change(prompts[0])  # before anyone listens: only the snapshot tells

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        index, reasons = CacheIndex(), []
        sub, channel = _subscribe(ctx, tree, index, reasons)
        try:
            await _until(lambda: index.keys == tree.held, tree.heartbeat)
            assert reasons[0] == "connect"
            for step in range(60):
                held = sorted(tree.held)
                tree.change(
                    rng.choice(prompts)[: rng.randrange(1, 10)],
                    rng.sample(held, min(len(held), rng.randrange(4))),
                    lost=step % 20 == 7,  # a message the socket dropped
                    cleared=step == 45,
                )
            await _until(lambda: index.keys == tree.held, tree.heartbeat)
            assert "gap" in reasons and sub.drops.dropped == 0
            assert sub.follower.seq == tree.seq and len(index) == len(tree.held)
        finally:
            sub.close()
            await channel.close()
            ctx.term()

    asyncio.run(run())


def test_a_restarted_publisher_drops_the_index(trees):
    tree = trees()
    old, new = _keys(_ids(1, 128)), _keys(_ids(2, 128))

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        index, reasons = CacheIndex(), []
        sub, channel = _subscribe(ctx, tree, index, reasons)
        try:
            await _until(lambda: sub.follower.synced, tree.heartbeat)
            tree.change(old)
            await _until(lambda: index.keys == set(old), tree.heartbeat)
            tree.restart()  # same port, a new process: its tree starts empty
            tree.change(new[:3])
            await _until(lambda: index.keys == set(new[:3]), tree.heartbeat)
            assert reasons[-1] == "restart" and not index.keys & set(old)
        finally:
            sub.close()
            await channel.close()
            ctx.term()

    asyncio.run(run())


def test_malformed_messages_are_counted_and_ignored(trees):
    tree = trees()
    keys = _keys(_ids(3, 64))

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        index, reasons = CacheIndex(), []
        sub, channel = _subscribe(ctx, tree, index, reasons)
        try:
            await _until(lambda: sub.follower.synced and sub.drops.dropped == 0)
            garbage = [
                [b"\x0a\xff not a protobuf"],
                [b"topic", _events(tree.instance, 1, keys).SerializeToString()],
                [_events(tree.instance, 1, [b"x" * 15]).SerializeToString()],  # half a key
                [_events(tree.instance, 1, keys, block_tokens=0).SerializeToString()],
            ]

            def send_garbage() -> None:
                for frames in garbage:
                    tree.pub.send_multipart(frames)

            # The subscription may still be on its way: send until some garbage arrives.
            await _until(lambda: sub.drops.dropped >= len(garbage), send_garbage)
            assert index.keys == set() and sub.follower.seq == 0 and reasons == ["connect"]
            tree.change(keys)
            await _until(lambda: index.keys == set(keys), tree.heartbeat)
        finally:
            sub.close()
            await channel.close()
            ctx.term()

    asyncio.run(run())


def test_silence_drops_the_index_until_the_stream_speaks(trees, monkeypatch):
    from services.frontend import cache_events

    monkeypatch.setattr(cache_events, "EVENTS_SILENT_S", 0.3)
    tree = trees()
    keys = _keys(_ids(4, 64))
    tree.change(keys)

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        index, reasons = CacheIndex(), []
        sub, channel = _subscribe(ctx, tree, index, reasons)
        try:
            await _until(lambda: index.keys == set(keys))
            await _until(lambda: not index.keys)  # no heartbeat: not known any more
            await _until(lambda: index.keys == set(keys), tree.heartbeat)
            assert reasons == ["connect", "connect"]
        finally:
            sub.close()
            await channel.close()
            ctx.term()

    asyncio.run(run())


def test_the_real_schedulers_events_index_its_prompts(monkeypatch):
    """The scheduler's own publisher (services/scheduler/event_publisher.py) over a real
    socket: what its tree keeps of finished requests, each prompt matches in full blocks,
    and a flush empties the index."""
    from services.scheduler import event_publisher
    from services.scheduler.event_publisher import EventPublisher
    from tests.fake_worker import make, run, submit

    monkeypatch.setattr(event_publisher, "HEARTBEAT_S", 0.05)
    sched, _ = make(num_slots=2048)
    assert sched.events is not None
    small = [[(tag * 31 + i) % 990 + 3 for i in range(n)] for tag, n in ((1, 70), (2, 40))]
    prompts = {"a": ("", small[0]), "b": ("salt", small[0]), "c": ("", small[1])}  # vocab 1000
    ctx = zmq.Context()
    pub = EventPublisher(ctx, "127.0.0.1", 0, sched.events)

    async def snapshot() -> engine_pb2.CacheEvents:
        return pub.snapshot(sched.kv.cache.root, 0)

    def matches() -> dict[str, int]:
        return {rid: index.match_prompt(PromptKeys(ns, ids)) for rid, (ns, ids) in prompts.items()}

    async def run_() -> None:
        actx = zmq.asyncio.Context()
        sub = CacheSubscriber(actx, f"tcp://127.0.0.1:{pub.port}", index, snapshot, name="s")
        try:
            await _until(lambda: sub.follower.synced, lambda: pub.publish(0))
            for rid, (ns, ids) in prompts.items():
                submit(sched, rid, ids, 3, cache_salt=ns)
            run(sched)
            pub.publish(0)
            want = {rid: len(ids) // BT * BT for rid, (_, ids) in prompts.items()}
            await _until(lambda: matches() == want, lambda: pub.publish(0))
            assert index.seed == sched.events.seed and index.block_tokens == BT
            assert sched.flush_cache().flushed
            pub.publish(0)
            await _until(lambda: not index.keys, lambda: pub.publish(0))
            assert matches() == {rid: 0 for rid in prompts}
        finally:
            sub.close()
            actx.term()

    index = CacheIndex()
    try:
        asyncio.run(run_())
    finally:
        pub.close()
        ctx.term()


# ---- in the engine pool ------------------------------------------------------------------------


def _value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", **labels})


def test_the_pool_routes_to_the_engine_holding_the_prompt(trees, tmp_path, monkeypatch):
    """Two engines over CURVE: a prompt goes where its blocks are cached even against its
    rendezvous choice; a new port is followed; an engine down has no index."""
    monkeypatch.setattr(engine_pool, "HEALTH_INTERVAL_S", 0.05)
    monkeypatch.setattr(engine_pool, "PROBE_INTERVAL_S", 0.05)
    generate_keys(str(tmp_path / "keys"))
    keys = InternalKeys(str(tmp_path / "keys"))
    a, b = (trees(keys=keys, zmq_addr=transport.new_ipc_addr("fake-sched")) for _ in range(2))
    resolver = StaticResolver([a.zmq_addr, b.zmq_addr], [a.control_addr, b.control_addr])
    registry = CollectorRegistry()
    metrics = RoutingMetrics(registry, {"model_name": "m"})
    ids = next(
        _ids(i, 96) for i in range(1000) if ranking(prefix_key("", _ids(i)), ["0", "1"])[0] == "0"
    )

    def request(rid: str, prompt: list[int]) -> engine_pb2.TokenizedRequest:
        return engine_pb2.TokenizedRequest(rid=rid, input_ids=transport.pack_i32(prompt))

    async def run() -> None:
        client = EngineClient(resolver, keys=keys, metrics=metrics)
        await client.start()
        try:
            engines = {e.name: e for e in client.pool.engines.values()}

            def synced() -> bool:
                return all(e.events and e.events.follower.synced for e in engines.values())

            def beat() -> None:
                a.heartbeat()
                b.heartbeat()

            await _until(synced, beat)
            b.change(_keys(ids))  # engine "1" holds the prompt; rendezvous prefers "0"
            await _until(lambda: len(engines["1"].index) == 6, b.heartbeat)
            assert _value(registry, "radixserve:frontend_cache_index_keys", engine="1") == 6
            client.submit(request("hit", ids), ids)
            await _until(lambda: any(r.rid == "hit" for r in b.requests()))
            assert (
                _value(registry, "radixserve:frontend_routing_decisions_total", branch="cache_hit")
                == 1
            )
            fresh = [i + 1 for i in ids]  # cached nowhere: prefix_hash's pick, then pending there
            client.submit(request("new", fresh), fresh)
            first = ranking(prefix_key("", fresh), ["0", "1"])[0]
            assert engines[first].index.match_prompt(PromptKeys("", fresh)) == 96
            assert (
                _value(registry, "radixserve:frontend_routing_decisions_total", branch="fallback")
                == 1
            )
            # engine "1" restarts on another port: followed there, its old tree forgotten
            b.restart(new_port=True)
            b.change(_keys(fresh)[:2])
            await _until(lambda: engines["1"].events_port == b.port, b.heartbeat)
            await _until(lambda: engines["1"].index.keys == set(_keys(fresh)[:2]), b.heartbeat)
            a.stop_control()  # engine "0" stops answering: routed around, its index gone
            await _until(lambda: engines["0"].events is None and len(engines["0"].index) == 0)
            assert (
                _value(registry, "radixserve:frontend_cache_resyncs_total", reason="connect") >= 3
            )
        finally:
            await client.close()
        assert _value(registry, "radixserve:frontend_cache_index_keys", engine="1") is None

    asyncio.run(run())


def test_other_policies_follow_no_events(trees):
    tree = trees(zmq_addr=transport.new_ipc_addr("fake-sched"))

    async def run() -> None:
        resolver = StaticResolver([tree.zmq_addr], [tree.control_addr])
        client = EngineClient(resolver, routing=RoutingParams("prefix_hash"))
        await client.start()
        try:
            await _until(lambda: client.ready)
            await asyncio.sleep(0.1)
            assert all(e.events is None for e in client.pool.engines.values())
            assert tree.snapshots == 0
        finally:
            await client.close()

    asyncio.run(run())


# ---- cost ------------------------------------------------------------------------------------


def test_a_routing_decision_is_cheap_at_ten_thousand_pages_per_engine():
    """Sanity only (bench/bench_routing.py measures): a 2k-token prompt against 3 engines x
    10k indexed blocks, keys hashed, matched, decided and recorded, well under a ms each."""
    rng = random.Random(1)
    indexes = {n: _index() for n in NAMES}
    for index in indexes.values():
        index.apply(False, b"".join(rng.randbytes(16) for _ in range(10_000)), b"")
    prompt_ids = [rng.randrange(32000) for _ in range(2048)]
    indexes[NAMES[1]].apply(False, b"".join(_keys(prompt_ids)[:100]), b"")
    router, loads = Router(), {n: 2 for n in NAMES}
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        prompt = PromptKeys("", prompt_ids)
        d = router.choose(
            prefix_key("", prompt_ids), loads, lambda n, p=prompt: indexes[n].match_prompt(p)
        )
        indexes[d.engine].note_sent(prompt)
        times.append(time.perf_counter() - t0)
    assert d.engine == NAMES[1] and d.matched_tokens == 2048  # 100 blocks, then pending
    assert statistics.median(times) < 0.005  # generous: 2 shared cores; typically ~0.1 ms


def test_an_engines_load_is_its_latest_count_plus_what_was_sent_since():
    from services.frontend.engine_discovery import Endpoint
    from services.frontend.engine_replica import Replica

    e = Replica(Endpoint("a", "tcp://127.0.0.1:1", ""))
    e.sent("r1")
    e.sent("r2")
    assert e.load == 2
    e.on_reported(7, from_events=True)  # other frontends' requests too; r1, r2 among them
    assert e.load == 7
    e.sent("r3")  # not yet in the engine's count
    assert e.load == 8
    e.on_reported(1, from_events=False)  # a probe while the events speak: older, ignored
    assert e.load == 8
    e.done("r3")
    e.on_reported(5, from_events=True)
    assert e.load == 5
    e.events_load_at -= 60  # the events fell silent: the probes count again
    e.on_reported(1, from_events=False)
    assert e.load == 2  # never below our own requests in flight (r1, r2)
