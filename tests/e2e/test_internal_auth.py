"""CURVE on the internal links (issue 15), with the three real processes over tcp://.

With --internal-keys-dir the scheduler admits only the frontends' key and the worker only
its scheduler's: a peer with no key, a key of its own, or the frontend's key at the worker
gets no frame through (the scheduler's prompt-token counter and queue do not move, and the
refusal is logged), while the server keeps answering exactly as before. A peer holding the
frontend's key does get an answer, so the probe itself can see a frame that gets through.
The control gRPC needs the token from the same folder; a tcp:// link without keys refuses
to start."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import zmq

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from radixserve.v1 import generation_pb2
from services.common.curve import InternalKeys, generate_keys
from services.common.transport import pack_i32, private_ipc_dir
from tests.server_util import REPO, Server, free_port, greedy, scrape_metrics

pytestmark = pytest.mark.slow
PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> InternalKeys:
    folder = str(tmp_path_factory.mktemp("keys"))
    generate_keys(folder)
    return InternalKeys(folder)


@pytest.fixture(scope="module")
def server(keys):
    worker, sched, control = free_port(), free_port(), free_port()
    with Server(
        f"--worker-addr=tcp://127.0.0.1:{worker}",
        f"--scheduler-addr=tcp://127.0.0.1:{sched}",
        f"--control-port={control}",
        f"--internal-keys-dir={keys.folder}",
        "--max-total-tokens=4096",
        metrics=True,
    ) as s:
        s.worker_addr, s.sched_addr = f"tcp://127.0.0.1:{worker}", f"tcp://127.0.0.1:{sched}"
        s.control = f"127.0.0.1:{control}"
        yield s


def _peer(addr: str, pair: tuple[bytes, bytes] | None, server_key: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if pair is not None:
        sock.curve_publickey, sock.curve_secretkey = pair
        sock.curve_serverkey = server_key
    sock.connect(addr)
    return sock


def _request(rid: str) -> bytes:
    req = engine_pb2.TokenizedRequest(
        rid=rid, input_ids=pack_i32([5, 6, 7]), sampling=engine_pb2.SamplingParams(max_tokens=2)
    )
    return engine_pb2.FrontendToScheduler(generate=req).SerializeToString()


def _prompt_tokens(server) -> float:
    return scrape_metrics(server.sched_metrics).get("radixserve:prompt_tokens_total", 0.0)


def test_peers_without_the_right_key_get_nothing_through(server, keys):
    before, _, _ = server.generate(text=PROMPT, sampling=greedy(8))
    counted = _prompt_tokens(server)
    intruder = zmq.curve_keypair()
    forward = engine_pb2.SchedulerToWorker(
        forward=engine_pb2.ForwardBatch(batch_id=1, is_decode=True)
    ).SerializeToString()
    frontend_pair = (keys.own("frontend").public, keys.own("frontend").secret)
    peers = [
        (_peer(server.sched_addr, None, None), _request("no-key")),
        (_peer(server.sched_addr, intruder, keys.public("scheduler")), _request("own-key")),
        # the frontend's key is good for the scheduler, not for the worker
        (_peer(server.worker_addr, frontend_pair, keys.public("worker")), forward),
        (_peer(server.worker_addr, intruder, keys.public("worker")), forward),
    ]
    for sock, frame in peers:
        for _ in range(20):
            _try_send(sock, frame)
    time.sleep(2.0)
    for sock, _ in peers:
        assert not sock.poll(0), "a refused peer got an answer"
        sock.close()
    assert _prompt_tokens(server) == counted  # not one of their requests was handled
    out = server.output()
    assert "scheduler ZeroMQ: refused a peer whose CURVE key is not configured" in out
    assert "worker ZeroMQ: refused a peer whose CURVE key is not configured" in out
    after, _, last = server.generate(text=PROMPT, sampling=greedy(8))
    assert after == before and last.finish_reason
    assert _prompt_tokens(server) > counted  # the counter does move for a real request


def _try_send(sock: zmq.Socket, frame: bytes) -> None:
    """Queues a frame; a peer whose handshake never completes may refuse to queue more."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_a_peer_with_the_frontends_key_gets_through(server, keys):
    pair = (keys.own("frontend").public, keys.own("frontend").secret)
    sock = _peer(server.sched_addr, pair, keys.public("scheduler"))
    try:
        sock.send(_request("keyed"))
        assert sock.poll(20_000), "the scheduler did not answer a keyed peer"
        reply = engine_pb2.SchedulerToFrontend()
        reply.ParseFromString(sock.recv())
        assert reply.outputs[0].rid == "keyed"
    finally:
        sock.close()


def test_control_needs_the_token(server, keys):
    with grpc.insecure_channel(server.control) as ch:
        stub = engine_pb2_grpc.SchedulerControlStub(ch)
        for metadata in (None, [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(engine_pb2.StatsRequest(), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.FlushCache(engine_pb2.FlushRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = [("authorization", f"Bearer {keys.control_token()}")]
        assert stub.GetStats(engine_pb2.StatsRequest(), metadata=token, timeout=5).page_size


def test_tcp_without_keys_refuses_to_start():
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "scheduler",
        f"--scheduler-addr=tcp://127.0.0.1:{free_port()}",
        f"--worker-addr=tcp://127.0.0.1:{free_port()}",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--internal-keys-dir" in done.stderr and "--insecure-internal" in done.stderr


def test_serve_hands_the_api_key_to_its_frontend_by_environment_only():
    """Also: with an API key the control port needs a token too (serve makes one), and
    SIGINT stops serve even when its shell started it with SIGINT ignored, leaving no
    socket files behind."""
    key = "sk-serve-e2e-key"
    control = free_port()
    flags = ("--api-key", key, "--max-total-tokens=2048", f"--control-port={control}")
    with Server(*flags, ignore_sigint=True) as s:
        with pytest.raises(grpc.RpcError) as err:
            s.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = [("authorization", f"Bearer {key}")]
        assert s.stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=10, metadata=metadata
        ).model_id
        children = subprocess.run(
            ["pgrep", "-P", str(s.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 3
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
        assert key not in s.output()
        with grpc.insecure_channel(f"127.0.0.1:{control}") as ch:
            stub = engine_pb2_grpc.SchedulerControlStub(ch)
            for call, msg in ((stub.FlushCache, engine_pb2.FlushRequest()),
                              (stub.GetStats, engine_pb2.StatsRequest())):  # fmt: skip
                with pytest.raises(grpc.RpcError) as err:
                    call(msg, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        sockets = glob.glob(os.path.join(private_ipc_dir(), f"*-{s.proc.pid}-*.sock"))
        assert len(sockets) == 2, sockets  # the worker's and the scheduler's
        os.kill(s.proc.pid, signal.SIGINT)
        assert s.proc.wait(60) == 0, s.output()
        assert not [p for p in sockets if os.path.exists(p)]
