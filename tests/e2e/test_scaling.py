"""Three engines and two frontends on loopback, wired the way the Helm chart wires them.

Each engine (a scheduler + worker pair, as in one engine pod) gets its own loopback address
(127.0.0.2, .3, .4 ...) and the same fixed ports there, as pods do; the frontends find them
through the A records of one DNS name, which a stub DNS server answers (standing in for the
cluster DNS and the engines' headless Service). Scaling is changing those records; a dead
engine is a scheduler and worker killed with SIGKILL mid-stream.
"""

from __future__ import annotations

import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.frontend.router import prefix_key, ranking
from tests.cluster_util import LOAD_FACTOR, Cluster, healthy, until
from tests.server_util import greedy

pytestmark = pytest.mark.slow

IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(Path(tempfile.mkdtemp(prefix="radixserve-scaling-")))
    try:
        for ip in IPS:
            c.start_engine(ip)
        c.publish(IPS[:2])  # two replicas at install; the third joins later
        c.start_frontend()
        c.start_frontend()
        for ip in IPS:
            c.wait_engine(ip)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()


def _stub(addr: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))


def _engines_seen(addr: str) -> int:
    try:
        return _stub(addr).GetModelInfo(pb.GetModelInfoRequest(), timeout=2).num_engines
    except grpc.RpcError:
        return 0


def _generate(addr: str, text: str, max_tokens: int = 8, salt: str = "") -> pb.GenerateResponse:
    last = None
    req = pb.GenerateRequest(
        text=text, sampling=greedy(max_tokens, ignore_eos=True), cache_salt=salt
    )
    for msg in _stub(addr).Generate(req, timeout=120):
        last = msg
    assert last is not None and last.finish_reason == "length"
    return last


def _tokenize(addr: str, text: str) -> list[int]:
    return list(_stub(addr).Tokenize(pb.TokenizeRequest(text=text), timeout=10).ids)


def _prompt_preferring(addr: str, ip: str, ips: list[str], tag: str) -> str:
    """A prompt whose prefix ranks engine ``ip`` first among ``ips`` (routing's first choice)."""
    for i in range(500):
        text = f"{tag} {i}: Beautiful is better than ugly. Explicit is better than implicit."
        if ranking(prefix_key("", _tokenize(addr, text)), ips)[0] == ip:
            return text
    raise AssertionError(f"no prompt prefers {ip}")


def test_frontends_discover_engines_and_scale_up(cluster):
    addrs = [a for _, a in cluster.frontends]
    for addr in addrs:
        until(lambda a=addr: _engines_seen(a) == 2, 20, "two engines")
    before = cluster.requests_done(IPS[2])
    cluster.publish(IPS)  # kubectl scale --replicas=3
    for addr in addrs:
        until(lambda a=addr: _engines_seen(a) == 3, 20, "three engines")
    for i in range(12):
        _generate(addrs[i % 2], f"Request {i} about namespaces and honking great ideas.", 4)
    assert cluster.requests_done(IPS[2]) > before  # the new engine takes its share


def test_shared_prefixes_stay_cached_across_frontends(cluster):
    """Both frontends rank engines the same way, so a prefix finds its KV whichever one the
    client reached."""
    addrs = [a for _, a in cluster.frontends]
    families = [
        f"System {name}: you answer in the style of the Zen of Python. Simple is better than "
        f"complex. Complex is better than complicated. Flat is better than nested."
        for name in ("alpha", "beta", "gamma")
    ]
    cached = prompt = 0
    for family in families:
        _generate(addrs[0], family + " Question 0?", 2)  # the first one computes the prefix
        for i in range(1, 5):
            last = _generate(addrs[i % 2], family + f" Question {i}?", 2)
            cached += last.cached_tokens
            prompt += last.prompt_tokens
    print(f"shared-prefix hit rate across frontends: {cached}/{prompt} = {cached / prompt:.2f}")
    assert cached / prompt > 0.7, (cached, prompt)


def test_a_skewed_burst_is_spread_within_the_load_bound(cluster):
    """Most requests share one prefix; bounded loads cap what its engine takes at once."""
    addrs = [a for _, a in cluster.frontends]
    hot = "Hot system prompt: errors should never pass silently, unless explicitly silenced."
    prompts = [f"{hot} Case {i}." for i in range(24)]
    prompts += [f"Cold request {i}: in the face of ambiguity refuse to guess." for i in range(6)]
    before = {ip: cluster.requests_done(ip) for ip in IPS}
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(
            pool.map(lambda ip: _generate(addrs[ip[0] % 2], ip[1], 24), enumerate(prompts))
        )
    assert len(results) == len(prompts)
    taken = {ip: cluster.requests_done(ip) - before[ip] for ip in IPS}
    assert sum(taken.values()) == len(prompts)
    fair = len(prompts) / len(IPS)
    print(f"skewed burst of {len(prompts)} (24 hot), requests per engine: {taken}")
    # Two frontends each bound their own share; the engines' reported queues couple them.
    assert max(taken.values()) <= math.ceil(LOAD_FACTOR * fair) + 2, taken
    assert min(taken.values()) > 0, taken


def _drain(call) -> tuple[str, float, str]:
    """Consumes a stream: (outcome, when it ended, error details)."""
    try:
        for _ in call:
            pass
        return "ok", time.monotonic(), ""
    except grpc.RpcError as e:
        return e.code().name, time.monotonic(), e.details() or ""


def test_a_killed_engine_fails_its_streams_fast_and_traffic_moves_on(cluster):
    addrs = [a for _, a in cluster.frontends]
    victim = IPS[1]
    cluster.publish(IPS)
    for addr in addrs:
        until(lambda a=addr: _engines_seen(a) == 3, 20, "three engines")
    cluster.settle(IPS)
    long_prompts = [_prompt_preferring(addrs[0], ip, IPS, "Long") for ip in IPS]
    calls = [
        _stub(addrs[0]).Generate(
            pb.GenerateRequest(text=t, sampling=greedy(400, ignore_eos=True)), timeout=120
        )
        for t in long_prompts
    ]
    for call in calls:
        next(call)  # every stream is running
    on_victim = cluster.running(victim)
    assert on_victim >= 1  # routing's first choice, under equal loads
    with ThreadPoolExecutor(len(calls) + 3) as pool:
        ends = [pool.submit(_drain, call) for call in calls]
        killed_at = time.monotonic()
        cluster.kill(victim)  # kill -9 the scheduler and the worker
        # Requests sent right after the kill: those routed to the dead engine move on whole.
        fresh = [_prompt_preferring(addrs[1], victim, IPS, f"After{i}") for i in range(3)]
        done = list(pool.map(lambda t: _generate(addrs[1], t, 4), fresh))
        results = [f.result() for f in ends]
    assert all(r.finish_reason == "length" for r in done)
    outcomes = [outcome for outcome, _, _ in results]
    failed = [(at, details) for outcome, at, details in results if outcome != "ok"]
    print(
        f"kill -9 of {victim} ({on_victim} of 3 streams on it): streams {outcomes}, failed "
        f"{[round(at - killed_at, 2) for at, _ in failed]} s after the kill; "
        "3 requests sent after it all ok"
    )
    # Exactly the streams on the dead engine fail, with UNAVAILABLE, and fast (the frontend
    # noticed, not a client timeout); the others finish.
    assert sorted(outcomes) == ["UNAVAILABLE"] * on_victim + ["ok"] * (3 - on_victim), results
    for at, details in failed:
        assert f"engine {victim} is not answering" in details
        assert at - killed_at < 5
    for addr in addrs:
        assert healthy(addr)  # ready: two engines still serve
        until(lambda a=addr: _engines_seen(a) == 2, 10, "the dead engine routed around")


def test_scale_down_drains_and_requests_keep_succeeding(cluster):
    addrs = [a for _, a in cluster.frontends]
    alive = [IPS[0], IPS[2]]  # IPS[1] was killed
    cluster.settle(alive)
    # Counted before the stream starts: a fast engine can finish it before the waits below.
    before = {ip: cluster.requests_done(ip) for ip in alive}
    text = _prompt_preferring(addrs[0], IPS[2], alive, "Drain")
    call = _stub(addrs[0]).Generate(
        pb.GenerateRequest(text=text, sampling=greedy(400, ignore_eos=True)), timeout=120
    )
    next(call)
    # Scale down the engine that runs the stream (the dead one is gone from DNS too).
    until(lambda: sum(map(cluster.running, alive)) == 1, 10, "the stream in a batch")
    (leaving,) = [ip for ip in alive if cluster.running(ip) == 1]
    (staying,) = [ip for ip in alive if ip != leaving]
    cluster.publish([staying])
    for addr in addrs:
        until(lambda a=addr: _engines_seen(a) == 1, 10, "one engine")
    for i in range(6):
        _generate(addrs[i % 2], f"After scale-down {i}: now is better than never.", 4)
    *_, last = list(call)  # the stream on the leaving engine finished there
    assert last.finish_reason == "length"
    # Only that stream ran there (the counter may trail the stream's last message a little).
    until(lambda: cluster.requests_done(leaving) >= before[leaving] + 1, 15, "the stream counted")
    time.sleep(0.5)
    assert cluster.requests_done(leaving) == before[leaving] + 1
    cluster.publish([])  # scaled to zero: not ready, but alive
    for addr in addrs:
        until(lambda a=addr: not healthy(a), 10, "not ready")
        assert healthy(addr, "liveness")
    cluster.publish([staying])
    for addr in addrs:
        until(lambda a=addr: healthy(a), 10, "ready again")
