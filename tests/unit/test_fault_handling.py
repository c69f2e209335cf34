"""Fault handling in pieces (issue 15): the scheduler failing every request when its worker
is gone and starting over on a new pool, the ZeroMQ monitor noticing a dead worker, the
worker running only its current scheduler's batches, and `radixserve serve`'s restarts.
tests/e2e/test_faults.py does the same with real processes and kill -9."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest
import zmq

from radixserve.internal.v1 import engine_pb2
from services.cli import serve as serve_mod
from services.common import transport
from services.common.config import ServeConfig
from services.scheduler.worker_conn import WorkerConn
from services.scheduler.worker_link import WorkerLost
from tests.fake_worker import FakeWorker, FakeWorkerSocket, expected, make, run, submit


def _prompt(n: int, base: int = 1) -> list[int]:
    return [base + i % 900 for i in range(n)]


def test_fail_all_ends_every_request_unavailable_and_leaks_nothing():
    sched, _ = make(num_slots=600, max_running=2)
    for i in range(4):  # two run, two wait
        submit(sched, f"r{i}", _prompt(50, 10 * i + 1), 100)
    assert sched.step() and sched.step()
    assert sched.queues.running and sched.queues.waiting
    assert sched.fail_all("the engine lost its worker (test)") == 4
    finals = [d for ds in sched.outbox.take().values() for d in ds if d.finish_reason]
    assert sorted(d.rid for d in finals) == ["r0", "r1", "r2", "r3"]
    for d in finals:
        assert d.error_code == "UNAVAILABLE" and "lost its worker" in d.finish_message
    assert not sched.has_requests() and not sched.link.in_flight
    sched.check_idle()  # the slot invariant holds: nothing held, nothing locked
    st = sched.stats()
    assert st.used_tokens == 0 and st.protected_tokens == 0


def test_attach_worker_starts_over_on_the_new_pool_and_stays_exact():
    sched, _ = make(num_slots=600)
    submit(sched, "a", _prompt(40), 8)
    run(sched)
    assert sched.stats().evictable_tokens > 0  # the old pool's KV, cached
    bigger = FakeWorker(1200)
    sched.attach_worker(FakeWorkerSocket(bigger), bigger.info)
    st = sched.stats()
    assert st.max_total_num_tokens == sched.kv.total and st.evictable_tokens == 0
    assert sched.kv.total > 600
    submit(sched, "b", _prompt(40), 8)
    got = run(sched)["b"]
    assert got.cached_tokens == 0  # nothing of the old tree survives
    assert list(got.token_ids) == expected(_prompt(40), 8)


def test_refused_request_gets_unavailable_at_once():
    sched, _ = make()
    msg = engine_pb2.TokenizedRequest(rid="x", input_ids=transport.pack_i32([1, 2]))
    sched.refuse(b"fe", msg, "the engine has no worker (test); retry shortly")
    (delta,) = sched.outbox.take()[b"fe"]
    assert delta.error_code == "UNAVAILABLE" and "no worker" in delta.finish_message
    assert not sched.has_requests()


def test_a_lost_worker_ends_the_wait_for_a_result():
    worker = FakeWorker(500)
    sock = FakeWorkerSocket(worker)
    sched, _ = make()
    sched.link.sock = sock
    sched.link.lost = lambda: "gone (test)"
    sock.send = lambda *a, **k: None  # the worker never answers
    submit(sched, "a", _prompt(10), 4)
    with pytest.raises(WorkerLost, match="gone"):
        sched.step()


def _router(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def _answer_hello(router: zmq.Socket, info: engine_pb2.WorkerInfo) -> bytes:
    assert router.poll(5000), "no hello"
    identity, payload = router.recv_multipart()
    assert transport.decode(engine_pb2.SchedulerToWorker, payload).HasField("info")
    reply = engine_pb2.WorkerToScheduler(info=info).SerializeToString()
    router.send_multipart([identity, reply])
    return identity


def _until(cond, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_worker_conn_notices_a_closed_worker_and_finds_the_next_one():
    addr = transport.new_ipc_addr("conn-test")
    ctx, wctx = zmq.Context(), zmq.Context()
    conn = WorkerConn(wctx, addr)
    try:
        router = _router(ctx, addr)
        conn.say_hello()
        first = _answer_hello(router, engine_pb2.WorkerInfo(max_total_num_tokens=10))
        assert _until(lambda: conn.hello_reply(50)).max_total_num_tokens == 10
        router.close(linger=0)  # the worker process dies: the kernel closes its socket
        why = _until(conn.lost)
        assert "closed" in why
        conn.renew()
        conn.say_hello()
        router = _router(ctx, addr)  # a new worker at the same address
        second = _answer_hello(router, engine_pb2.WorkerInfo(max_total_num_tokens=20))
        assert second != first  # a new session, as the worker sees it
        assert _until(lambda: conn.hello_reply(50)).max_total_num_tokens == 20
        router.close(linger=0)
    finally:
        conn.close()
        wctx.destroy(linger=0)
        ctx.destroy(linger=0)


_FROZEN_WORKER = """
import sys, time, zmq
from radixserve.internal.v1 import engine_pb2
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
identity, _ = sock.recv_multipart()
sock.send_multipart([identity, engine_pb2.WorkerToScheduler(info=engine_pb2.WorkerInfo(
    max_total_num_tokens=7)).SerializeToString()])
time.sleep(60)
"""


def test_worker_conn_notices_a_frozen_worker_by_heartbeats():
    """No FIN from a frozen process (or a lost node): ZMTP heartbeats end the connection."""
    import os
    import signal

    addr = transport.new_ipc_addr("frozen")
    proc = subprocess.Popen([sys.executable, "-c", _FROZEN_WORKER, addr])
    wctx = zmq.Context()
    conn = WorkerConn(wctx, addr)
    try:
        conn.say_hello()
        assert _until(lambda: conn.hello_reply(100), 30).max_total_num_tokens == 7
        os.kill(proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert "heartbeats" in _until(conn.lost, 10)
        assert time.monotonic() - frozen < 5
    finally:
        proc.kill()
        proc.wait()
        conn.close()
        wctx.destroy(linger=0)


class _Runner:
    def __init__(self) -> None:
        self.resets = 0

    def forget_requests(self) -> None:
        self.resets += 1


def test_worker_runs_only_the_current_schedulers_batches():
    from services.worker.main import Session

    runner, drops = _Runner(), transport.DropLog("test")
    session = Session(runner, drops)  # type: ignore[arg-type]
    hello = engine_pb2.SchedulerToWorker(info=engine_pb2.WorkerInfoRequest())
    batch = engine_pb2.SchedulerToWorker(forward=engine_pb2.ForwardBatch(batch_id=1))
    assert not session.admits(b"stranger", batch)  # no hello yet: nobody's batches run
    assert session.admits(b"old", hello) and runner.resets == 1
    assert session.admits(b"old", batch)
    assert session.admits(b"new", hello) and runner.resets == 2  # a replacement scheduler
    assert not session.admits(b"old", batch)  # still queued from the dead one: dropped
    assert session.admits(b"new", batch) and drops.dropped == 2


# -- `radixserve serve`'s supervisor -------------------------------------------------------


def _fake_children(monkeypatch, code: str) -> list[serve_mod.Child]:
    """Children that are python one-liners; spawn() starts the same one again."""

    def spawn(name: str, cfg) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    monkeypatch.setattr(serve_mod, "spawn", spawn)
    return [serve_mod.Child(n, spawn(n, None), "") for n in ("worker", "scheduler")]


def test_supervisor_gives_up_on_a_crash_loop_with_backoff(monkeypatch, capsys):
    kids = _fake_children(monkeypatch, "import sys; sys.exit(3)")
    kids[1] = serve_mod.Child("scheduler", subprocess.Popen(["sleep", "30"]), "")
    policy = ServeConfig(max_restarts=2, restart_window=60, restart_backoff=0.1)
    start = time.monotonic()
    assert serve_mod.supervise(kids, {"worker": None, "scheduler": None}, policy) == 1
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert "restarting it in 0.1 s (restart 1 of at most 2" in err
    assert "restarting it in 0.2 s (restart 2 of at most 2" in err  # doubled
    assert "exited with code 3 again" in err and "crash loop" in err
    assert took >= 0.3
    assert kids[1].proc.poll() is None  # the healthy sibling was never touched
    kids[1].proc.kill()


def test_on_child_exit_stop_keeps_the_old_behaviour(monkeypatch, capsys):
    kids = _fake_children(monkeypatch, "import sys; sys.exit(4)")
    policy = ServeConfig(on_child_exit="stop")
    assert serve_mod.supervise(kids, {}, policy) == 1
    assert "exited with code 4; its log is above. Stopping the others." in capsys.readouterr().err
    for k in kids:
        k.proc.wait()


def test_serve_flags_come_from_the_dataclass():
    from services.cli.main import build_parser

    ns = build_parser().parse_args(["serve", "--on-child-exit", "stop", "--max-restarts", "2"])
    assert isinstance(ns, argparse.Namespace)
    assert ns.on_child_exit == "stop" and ns.max_restarts == 2
    assert ns.restart_window == ServeConfig().restart_window


# -- the scheduler's drain after SIGTERM ----------------------------------------------------


def _slow(sock: FakeWorkerSocket, seconds: float) -> FakeWorkerSocket:
    """Each batch takes ``seconds`` (a long request outlasts a short grace period)."""
    send = sock.send

    def slow_send(payload, flags: int = 0, copy: bool = True):
        time.sleep(seconds)
        send(payload, flags, copy)

    sock.send = slow_send  # type: ignore[method-assign]
    return sock


def test_drain_finishes_what_fits_in_the_grace_and_fails_the_rest():
    import threading

    from services.common.config import SchedulerConfig
    from services.scheduler.engine_loop import EngineLoop
    from services.scheduler.metrics import SchedulerMetrics

    ctx, wctx = zmq.Context(), zmq.Context()
    conn = WorkerConn(wctx, transport.new_ipc_addr("no-worker"))
    worker, stop = FakeWorker(4096), threading.Event()
    cfg = SchedulerConfig(shutdown_grace_period=0.6)
    loop = EngineLoop(cfg, conn, worker.info, SchedulerMetrics.disabled(), stop)
    loop.sched.attach_worker(_slow(FakeWorkerSocket(worker), 0.01), worker.info)
    addr = transport.new_ipc_addr("fe")
    frontends = transport.router(ctx, addr)
    fe = transport.dealer(ctx, addr, identity=b"fe")
    for rid, n in (("short", 4), ("long", 2000)):
        sampling = engine_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        req = engine_pb2.TokenizedRequest(rid=rid, input_ids=transport.pack_i32([1, 2, 3]))
        req.sampling.CopyFrom(sampling)
        transport.send(fe, engine_pb2.FrontendToScheduler(generate=req))
    thread = threading.Thread(target=loop.run, args=(frontends,))
    thread.start()
    try:
        _until(lambda: len(loop.sched.queues.running) == 2 or not loop.sched.has_requests())
        stop.set()  # SIGTERM
        time.sleep(0.1)  # the loop has begun draining (one turn is a few ms)
        late = engine_pb2.TokenizedRequest(rid="late", input_ids=transport.pack_i32([5]))
        transport.send(fe, engine_pb2.FrontendToScheduler(generate=late))
        finals: dict[str, engine_pb2.TokenDelta] = {}
        deadline = time.monotonic() + 10
        while len(finals) < 3 and time.monotonic() < deadline:
            if fe.poll(100):
                msg = transport.recv(fe, engine_pb2.SchedulerToFrontend)
                finals.update({d.rid: d for d in msg.outputs if d.finish_reason})
        thread.join(5)
        assert not thread.is_alive(), "the loop did not end after the grace period"
    finally:
        stop.set()
        thread.join(5)
        conn.close()
        for c in (ctx, wctx):
            c.destroy(linger=0)
    assert finals["short"].finish_reason == "length" and not finals["short"].error_code
    assert (
        finals["long"].error_code == "UNAVAILABLE" and "shut down" in finals["long"].finish_message
    )
    assert (
        finals["late"].error_code == "UNAVAILABLE"
        and "shutting down" in finals["late"].finish_message
    )


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_restarts", -1, "--max-restarts must be >= 0"),
        ("restart_window", 0.0, "--restart-window must be a finite number > 0"),
        ("restart_backoff", -0.5, "--restart-backoff must be a finite number >= 0"),
    ],
)
def test_bad_supervisor_flags_are_refused_naming_the_flag(field, value, words):
    with pytest.raises(ValueError, match=words):
        ServeConfig(**{field: value})
