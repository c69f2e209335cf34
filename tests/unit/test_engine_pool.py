"""Routing across engine replicas, their discovery by DNS, and the frontend's engine pool.

The pool is driven through its pluggable resolver (a list the test edits, or DnsResolver
against a stub DNS server on loopback) over real ZeroMQ and gRPC to FakeSchedulers.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.frontend import engine_pool
from services.frontend.engine_client import EngineClient
from services.frontend.engine_discovery import DnsResolver, Endpoint, StaticResolver
from services.frontend.router import load_bound, pick, prefix_key, ranking
from tests.dns_stub import DnsStub
from tests.fake_scheduler import SCRIPT_TEXT, FakeScheduler, build_tokenizer
from tests.server_util import free_port

# ---- router ------------------------------------------------------------------------------


def _key(i: int, salt: str = "") -> bytes:
    return prefix_key(salt, [1000 + i] * 40)


def test_a_prefix_ranks_engines_the_same_everywhere_and_salt_counts():
    names = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    system = list(range(100, 132))
    keys = {prefix_key("", system + [i]) for i in range(20)}
    assert len(keys) == 1  # only the first 32 tokens count
    assert ranking(_key(1), names) == ranking(_key(1), list(reversed(names)))
    firsts = {ranking(_key(i), names)[0] for i in range(200)}
    assert firsts == set(names)
    assert len({ranking(_key(1, f"user{i}"), names)[0] for i in range(50)}) > 1


def test_adding_an_engine_moves_only_the_keys_it_wins():
    before = ["a", "b", "c"]
    after = [*before, "d"]
    moved = [i for i in range(1000) if ranking(_key(i), before)[0] != ranking(_key(i), after)[0]]
    assert all(ranking(_key(i), after)[0] == "d" for i in moved)
    assert 150 < len(moved) < 350  # about a quarter


def test_idle_engines_keep_prefixes_on_their_first_choice():
    loads = {"a": 0, "b": 0, "c": 0}
    for i in range(50):
        assert pick(_key(i), loads) == ranking(_key(i), list(loads))[0]


def test_bounded_loads_under_a_skewed_workload():
    """80% of requests share one prefix; no engine goes past its bound, and the hot prefix
    stays on as few engines as the bound allows."""
    rng = random.Random(7)
    loads = {"a": 0, "b": 0, "c": 0}
    hot_on: collections.Counter[str] = collections.Counter()
    for n in range(300):
        hot = rng.random() < 0.8
        key = _key(0) if hot else _key(rng.randrange(10**6))
        bound = load_bound(loads, 1.25)
        engine = pick(key, loads, 1.25)
        assert loads[engine] < bound
        loads[engine] += 1
        hot_on[engine] += hot
        assert max(loads.values()) <= 1.25 * (n + 1) / 3 + 1
    first = ranking(_key(0), list(loads))[0]
    assert hot_on.most_common(1)[0][0] == first
    # without the bound every hot request would sit on one engine
    assert max(loads.values()) < 0.8 * 300


def test_no_engine_is_an_error():
    with pytest.raises(ValueError):
        pick(_key(0), {})


# ---- discovery -----------------------------------------------------------------------------


@pytest.fixture
def dns_stub():
    stub = DnsStub().start()
    yield stub
    stub.stop()


def test_dns_resolver_follows_the_records(dns_stub):
    resolver = DnsResolver("engines.test.local", 30100, 30101, 0.1, dns_stub.address)
    dns_stub.set("engines.test.local", ["10.1.0.7", "10.1.0.3"])
    eps = asyncio.run(resolver.resolve())
    assert eps == [
        Endpoint("10.1.0.3", "tcp://10.1.0.3:30100", "10.1.0.3:30101"),
        Endpoint("10.1.0.7", "tcp://10.1.0.7:30100", "10.1.0.7:30101"),
    ]
    dns_stub.set("engines.test.local", ["10.1.0.3"])
    assert [e.name for e in asyncio.run(resolver.resolve()) or []] == ["10.1.0.3"]
    dns_stub.set("engines.test.local", [])  # scaled to zero: NXDOMAIN, no engine
    assert asyncio.run(resolver.resolve()) == []


def test_a_failed_lookup_keeps_the_engines():
    dead = f"127.0.0.1:{free_port()}"  # nobody answers there: the lookup times out
    resolver = DnsResolver("engines.test.local", 30100, 30101, 0.1, dead)
    assert asyncio.run(resolver.resolve()) is None


def test_system_resolver_reads_hosts_and_ipv6_is_bracketed():
    eps = asyncio.run(DnsResolver("localhost", 1, 2).resolve())
    assert eps and all(e.zmq_addr.endswith(":1") and e.control_addr.endswith(":2") for e in eps)
    for e in eps:
        if ":" in e.name:
            assert e.zmq_addr == f"tcp://[{e.name}]:1"


def test_static_resolver_checks_its_lists():
    with pytest.raises(ValueError, match="--scheduler-addrs or --engine-dns-name"):
        StaticResolver([], [])
    with pytest.raises(ValueError, match="one address per scheduler"):
        StaticResolver(["tcp://a:1", "tcp://b:1"], ["a:2"])


# ---- the pool ------------------------------------------------------------------------------


class ListResolver:
    """A resolver whose answer the test sets."""

    interval_s: float | None = 0.05

    def __init__(self, fakes: list[FakeScheduler]) -> None:
        self.fakes = list(fakes)

    async def resolve(self) -> list[Endpoint] | None:
        return [Endpoint(f.addr.rsplit("/", 1)[-1], f.addr, f.control_addr) for f in self.fakes]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> list[int]:
    from services.frontend.tokenizer import Tokenizer

    tok = Tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))
    return tok.encode(SCRIPT_TEXT)


@pytest.fixture
def fakes(script):
    started: list[FakeScheduler] = []

    def make() -> FakeScheduler:
        fake = FakeScheduler(script, 320).start()
        started.append(fake)
        return fake

    yield make
    for f in started:
        try:
            f.stop()
        except Exception:  # already stopped by the test
            pass


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _request(rid: str, ids: list[int], salt: str = "", max_tokens: int = 2):
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens)
    req = engine_pb2.TokenizedRequest(
        rid=rid, input_ids=transport.pack_i32(ids), sampling=sampling, cache_salt=salt
    )
    return req, ids


async def _finish(queue: asyncio.Queue) -> engine_pb2.TokenDelta:
    while True:
        delta = await asyncio.wait_for(queue.get(), 10)
        if delta.finish_reason:
            return delta


def _prefers(name: str, names: list[str], salt: str = "") -> list[int]:
    """A prompt whose first choice among ``names`` is ``name``."""
    for i in range(10_000):
        ids = [i + 7] * 33
        if ranking(prefix_key(salt, ids), names)[0] == name:
            return ids
    raise AssertionError("no such prompt")


def test_engines_join_and_leave_at_run_time(fakes, monkeypatch):
    monkeypatch.setattr(engine_pool, "HEALTH_INTERVAL_S", 0.05)
    a, b = fakes(), fakes()
    resolver = ListResolver([a])

    async def run() -> None:
        client = EngineClient(resolver)
        await client.start()
        try:
            await _until(lambda: client.ready and client.num_engines == 1)
            resolver.fakes = [a, b]  # scale up
            await _until(lambda: client.num_engines == 2)
            assert client.info is not None and client.info.num_engines == 2
            for i in range(40):
                req, ids = _request(f"r{i}", [i + 50, 7])
                assert (await _finish(client.submit(req, ids))).finish_reason == "length"
                client.release(req.rid)
            assert len(a.requests) > 5 and len(b.requests) > 5
            # Scale down while a's request streams: it finishes there, new ones avoid a.
            names = sorted(client.loads())
            name_a = a.addr.rsplit("/", 1)[-1]
            slow_req, slow_ids = _request("slow", _prefers(name_a, names, "slow"), "slow")
            slow = client.submit(slow_req, slow_ids)
            await asyncio.wait_for(slow.get(), 5)
            resolver.fakes = [b]
            await _until(lambda: client.num_engines == 1)
            n_a = len(a.requests)
            for i in range(10):
                req, ids = _request(f"s{i}", _prefers(name_a, names))
                assert (await _finish(client.submit(req, ids))).finish_reason == "length"
                client.release(req.rid)
            assert len(a.requests) == n_a  # draining: nothing new
            assert not (await asyncio.wait_for(slow.get(), 5)).error_code  # still streaming
            client.abort("slow", "done")
            client.release("slow")
            await _until(lambda: name_a not in {e.name for e in client.pool.engines.values()})
        finally:
            await client.close()

    asyncio.run(run())


def test_a_dead_engine_fails_its_streams_fast_and_the_rest_moves(fakes, monkeypatch):
    monkeypatch.setattr(engine_pool, "HEALTH_INTERVAL_S", 0.05)
    a, b = fakes(), fakes()
    resolver = ListResolver([a, b])
    health: list[bool] = []

    async def on_health(ok: bool) -> None:
        health.append(ok)

    async def run() -> None:
        client = EngineClient(resolver, on_health=on_health)
        await client.start()
        try:
            await _until(lambda: client.num_engines == 2)
            names = sorted(client.loads())
            name_a = a.addr.rsplit("/", 1)[-1]
            slow_req, slow_ids = _request("slow", _prefers(name_a, names, "slow"), "slow")
            slow = client.submit(slow_req, slow_ids)
            await asyncio.wait_for(slow.get(), 5)  # streaming on a
            a.stop()  # killed: its control port refuses, its socket is silent
            # Sent before the pool noticed: waits on a, then moves to b whole.
            req, ids = _request("late", _prefers(name_a, names))
            late = client.submit(req, ids)
            t0 = time.monotonic()
            while not (delta := await asyncio.wait_for(slow.get(), 5)).finish_reason:
                pass
            assert delta.error_code == "UNAVAILABLE" and "is not answering" in delta.finish_message
            assert time.monotonic() - t0 < 2.0  # fast, not a client timeout
            done = await _finish(late)
            assert done.finish_reason == "length" and not done.error_code
            assert any(r.rid == "late" for r in b.requests)
            assert client.ready and client.num_engines == 1 and health == [True]
            b.stop()
            await _until(lambda: not client.ready)
            assert health == [True, False]
            req, ids = _request("none", [1, 2, 3])
            delta = await _finish(client.submit(req, ids))
            assert delta.error_code == "UNAVAILABLE"
        finally:
            await client.close()

    asyncio.run(run())
