"""One cache across the fleet (issue 37) over real processes: three engines, two frontends
(cache_aware routing fed by the engines' cache events) and a real redis-server as the
engines' shared storage tier.

- a conversation's next turn, sent through the other frontend, lands on the engine whose
  tree holds its history;
- a flushed engine's index is emptied in every frontend (the cleared event);
- an engine killed with SIGKILL is routed around, and the engine that gets its
  conversation loads the history from the shared store instead of computing it, token-exact;
  another namespace (cache salt) never loads those pages;
- the store killed mid-run costs misses, never a failed request.
"""

from __future__ import annotations

import tempfile
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from tests.cluster_util import Cluster, until
from tests.redis_util import RedisServer
from tests.server_util import free_port, greedy

pytestmark = pytest.mark.slow

IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
SYSTEM = (
    "System: you answer in the style of the Zen of Python. Beautiful is better than ugly. "
    "Explicit is better than implicit. Simple is better than complex."
)


@pytest.fixture(scope="module")
def fleet():
    tmp = Path(tempfile.mkdtemp(prefix="radixserve-fleet-"))
    redis = RedisServer(tmp / "redis")
    c = Cluster(tmp)
    c.metrics_ports = []  # type: ignore[attr-defined]
    try:
        worker = (
            "--hicache-ratio=2",
            f"--hicache-storage-url={redis.url}",
            "--hicache-storage-page-tokens=16",
            "--hicache-storage-timeout-ms=200",
        )
        for ip in IPS:
            c.start_engine(ip, worker, ("--hicache-write-policy=write_through",))
        c.publish(IPS)
        for _ in range(2):
            port = free_port()
            c.metrics_ports.append(port)  # type: ignore[attr-defined]
            c.start_frontend("--enable-metrics", f"--metrics-port={port}")
        for ip in IPS:
            c.wait_engine(ip)
        c.settle(IPS)
        yield c, redis
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()
        redis.kill()


def _stub(addr: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))


def _generate(
    addr: str, ids: list[int], salt: str = "", n: int = 6
) -> tuple[list[int], pb.GenerateResponse]:
    req = pb.GenerateRequest(
        input_ids=pb.InputIds(ids=ids), sampling=greedy(n, ignore_eos=True), cache_salt=salt
    )
    out, last = [], None
    for msg in _stub(addr).Generate(req, timeout=120):
        out.extend(msg.token_ids)
        last = msg
    assert last is not None and last.finish_reason == "length"
    return out, last


def _tokenize(addr: str, text: str) -> list[int]:
    return list(_stub(addr).Tokenize(pb.TokenizeRequest(text=text), timeout=10).ids)


def _frontend_metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == name
    )


def _where(c: Cluster, before: dict[str, float]) -> str:
    (ip,) = [ip for ip in IPS if c.requests_done(ip) > before[ip]]
    return ip


def test_turns_follow_the_history_across_frontends_and_the_store_outlives_an_engine(fleet):
    c, redis = fleet
    a, b = (addr for _, addr in c.frontends)
    convs = [_tokenize(a, f"{SYSTEM} User {i}: what is better than nested?") for i in range(4)]
    history = []
    for ids in convs:
        out, _ = _generate(a, ids)
        history.append(ids + out + _tokenize(a, " And flat?"))
    # Turn 2 through the other frontend: on the engine that holds turn 1 (its whole prompt
    # and answer are cached there), whatever the shared system prompt says.
    homes = []
    for ids, hist in zip(convs, history, strict=True):
        before = {ip: c.requests_done(ip) for ip in IPS}
        _, last = _generate(b, hist)
        assert last.cached_tokens >= len(ids) - 1, (last.cached_tokens, len(ids))
        total = sum(before.values())
        until(lambda t=total: sum(map(c.requests_done, IPS)) > t, 5, "counted")
        homes.append(_where(c, before))
    assert _frontend_metric(c.metrics_ports[1], "radixserve:frontend_routing_decisions_total") > 0
    for port in c.metrics_ports:
        assert _frontend_metric(port, "radixserve:frontend_cache_index_keys") > 0

    # kill -9 of the engine that holds conversation 0: its next turn goes elsewhere and
    # comes back from the shared store (written through), token-exact with turn 2 there.
    victim = homes[0]
    want, _ = _generate(b, history[0])  # served by the victim, from its own tree
    c.kill(victim)
    alive = [ip for ip in IPS if ip != victim]
    until(lambda: _routable(c, a, len(alive)), 20, "the dead engine routed around")
    got, last = _generate(a, history[0])
    assert got == want
    assert last.cached_tokens_details.storage >= 16, last.cached_tokens_details
    # Another namespace never loads those pages.
    _, other = _generate(a, history[0], salt="tenant-2")
    assert other.cached_tokens_details.storage == 0 and other.cached_tokens == 0

    # The store killed mid-run: requests keep succeeding (misses are counted, not failures).
    redis.kill()
    for i in range(3):
        _generate(b, _tokenize(b, f"After the store died {i}: now is better than never."))


def test_a_flushed_engine_is_emptied_in_every_frontends_index(fleet):
    c, _ = fleet
    a = c.frontends[0][1]
    until(lambda: _stub(a).FlushCache(pb.FlushCacheRequest(), timeout=30).flushed, 30, "flush")
    for port in c.metrics_ports:  # type: ignore[attr-defined]
        until(
            lambda p=port: _frontend_metric(p, "radixserve:frontend_cache_index_keys") == 0,
            5,
            "indexes emptied",
        )


def _routable(c: Cluster, addr: str, n: int) -> bool:
    try:
        info = _stub(addr).GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
        return info.num_engines == n
    except grpc.RpcError:
        return False
