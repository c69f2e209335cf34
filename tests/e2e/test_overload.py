"""Admission control over the three real processes (issue 41): a burst far beyond the
queue limit gets 429 with Retry-After at once, while every admitted request finishes with
the same greedy answer it gets alone, and the server serves normally afterwards; a request
that waits past --max-queue-time, or whose gRPC deadline passes mid-prefill, ends with
DEADLINE_EXCEEDED and leaves the pool whole."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from radixserve.v1 import generation_pb2 as pb
from tests.server_util import BackgroundStream, Server, idle_pool_is_whole

pytestmark = pytest.mark.slow
PROMPTS = [f"Beautiful is better than ugly, number {i}." for i in range(16)]


@pytest.fixture(scope="module")
def server():
    flags = ("--max-running-requests", "2", "--max-queued-requests", "2")
    with Server(*flags, "--max-total-tokens", "4096") as s:
        yield s


def _complete(server: Server, prompt: str) -> httpx.Response:
    # Long enough that the burst arrives while the first ones still hold the queue (64
    # tokens was not always, once the worker ran this model on the thread count it serves
    # fastest with).
    body = {"prompt": prompt, "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    return httpx.post(url, json=body, timeout=120)


def _timed(server: Server, prompt: str) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = _complete(server, prompt)
    return r, time.monotonic() - start


def test_a_burst_beyond_the_queue_gets_429_and_the_admitted_answers_are_exact(server):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        timed = list(pool.map(lambda p: _timed(server, p), PROMPTS))
    burst = [r for r, _ in timed]
    codes = [r.status_code for r in burst]
    # Refused at the door, not after waiting: every 429 came back before the admitted
    # request that waited in the queue finished. (The 429s' p99 in ms, measured apart
    # from 16 client threads' start-up: docs/benchmarks.md, Overload.)
    slowest_429 = max(t for r, t in timed if r.status_code == 429)
    assert slowest_429 < max(t for r, t in timed if r.status_code == 200), timed
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 4, codes
    for r in burst:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert "--max-queued-requests 2" in r.json()["error"]["message"]
    for prompt, r in zip(PROMPTS, burst, strict=True):
        if r.status_code == 200:  # alone, afterwards: the same greedy text
            alone = _complete(server, prompt)
            assert alone.status_code == 200
            assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def slow_server():
    """One request at a time, a short queue time, prompts prefilled 2 tokens a step."""
    flags = ("--max-running-requests", "1", "--max-queue-time", "0.2")
    with Server(*flags, "--chunked-prefill-size", "2", metrics=True) as s:
        yield s


def test_a_request_queued_past_max_queue_time_fails_and_frees_the_pool(slow_server):
    # Holds the one running slot for ~0.5-1 s (480 tokens at ~1-2 ms a step): well past
    # the queue time, also on a quiet machine (400 tokens once finished within 0.5 s).
    busy = BackgroundStream(slow_server, max_tokens=480)
    try:
        assert busy.started.wait(60)
        body = {"prompt": "Waiting in line.", "max_tokens": 8}
        url = f"http://127.0.0.1:{slow_server.http_port}/v1/completions"
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 504, r.text
        assert "--max-queue-time" in r.json()["error"]["message"]
    finally:
        busy.stop()
    idle_pool_is_whole(slow_server)


def test_a_grpc_deadline_mid_prefill_aborts_and_frees_the_pool(slow_server):
    text = " ".join(["beautiful is better than ugly"] * 40)  # 321 tokens: 161 prefill steps
    req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=150))
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in slow_server.stub.Generate(req, timeout=0.15):
            got.extend(msg.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not got, "the deadline passed after the prefill: make the prompt longer"
    idle_pool_is_whole(slow_server)
    # And the engine serves on: the same prompt with time to finish.
    done = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids, _, _ = slow_server.generate(text=text, sampling=done)
    assert len(ids) == 4
