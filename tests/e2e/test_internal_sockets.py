"""Hostile bytes on the internal ZeroMQ sockets (issue 15): random frames, wrong frame
counts, truncated and empty messages, a request that skips the frontend with a token outside
the vocabulary or out-of-range sampling. None of it may stop a process or touch another
request: afterwards the server answers with exactly the tokens it gave before."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import zmq

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from tests.server_util import Server, free_port, greedy

pytestmark = pytest.mark.slow
PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def server():
    worker, sched = free_port(), free_port()
    with Server(
        "--worker-addr",
        f"tcp://127.0.0.1:{worker}",
        "--scheduler-addr",
        f"tcp://127.0.0.1:{sched}",
        "--max-total-tokens",
        "4096",
        # Plain tcp on purpose: this test is about what reaches the sockets' decoders (with
        # keys, test_internal_auth.py shows none of it would get past the handshake).
        "--insecure-internal",
    ) as s:
        s.worker_addr, s.sched_addr = f"tcp://127.0.0.1:{worker}", f"tcp://127.0.0.1:{sched}"
        yield s


def _garbage(rng: random.Random, valid: bytes) -> list[list[bytes]]:
    """Frames a hostile peer might send, as multipart messages (a DEALER adds nothing)."""
    out: list[list[bytes]] = []
    for _ in range(60):
        n = rng.randint(0, 300)
        out.append([rng.randbytes(n)])
    out += [
        [b""],
        [b"\xff" * 10_000],
        [valid[: len(valid) // 2]],  # truncated
        [valid, valid],  # two message frames
        [b"", b"", b""],
        [valid + rng.randbytes(7)],
    ]
    return out


def _flood(addr: str, frames: list[list[bytes]]) -> zmq.Socket:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    for parts in frames:
        sock.send_multipart(parts)
    return sock


def test_garbage_on_both_sockets_changes_nothing(server):
    before, _, _ = server.generate(text=PROMPT, sampling=greedy(12))
    rng = random.Random(7)
    forward = engine_pb2.SchedulerToWorker(
        forward=engine_pb2.ForwardBatch(batch_id=3, is_decode=True)
    ).SerializeToString()
    request = engine_pb2.FrontendToScheduler(
        generate=engine_pb2.TokenizedRequest(rid="x", input_ids=pack_i32([1, 2, 3]))
    ).SerializeToString()
    socks = [
        _flood(server.worker_addr, _garbage(rng, forward)),
        _flood(server.sched_addr, _garbage(rng, request)),
    ]
    time.sleep(1.0)
    after, _, last = server.generate(text=PROMPT, sampling=greedy(12))
    assert after == before and last.finish_reason
    for s in socks:
        s.close()


def _ask_scheduler(addr: str, req: engine_pb2.TokenizedRequest) -> engine_pb2.TokenDelta:
    sock = _flood(addr, [[engine_pb2.FrontendToScheduler(generate=req).SerializeToString()]])
    try:
        assert sock.poll(20_000), "the scheduler did not answer"
        reply = engine_pb2.SchedulerToFrontend()
        reply.ParseFromString(sock.recv())
        return reply.outputs[0]
    finally:
        sock.close()


@pytest.mark.parametrize(
    "ids, sampling, words",
    [
        ([5, 10**6, 7], {}, "outside the vocabulary"),
        ([5, -3], {}, "outside the vocabulary"),
        ([5, 6], {"top_p": 0.0}, "top_p"),
        ([5, 6], {"temperature": float("nan")}, "temperature"),
        ([5, 6], {"top_logprobs": 500}, "top_logprobs"),
        ([5, 6], {"stop_token_ids": [10**7]}, "stop_token_ids"),
    ],
)
def test_request_that_skips_the_frontend_fails_alone(server, ids, sampling, words):
    req = engine_pb2.TokenizedRequest(
        rid=f"direct-{words}",
        input_ids=pack_i32(np.asarray(ids, dtype=np.int64).astype(np.int32)),
        sampling=engine_pb2.SamplingParams(max_tokens=4, **sampling),
    )
    delta = _ask_scheduler(server.sched_addr, req)
    assert delta.finish_reason == "abort" and delta.error_code == "INVALID_ARGUMENT"
    assert words in delta.finish_message
    ids_after, _, _ = server.generate(text=PROMPT, sampling=greedy(4))
    assert len(ids_after) == 4
