"""Faults (issue 15): services killed with SIGKILL mid-stream, restarted, and stopped with SIGTERM.

The three services run as separate processes, as in Kubernetes (one per container), on
private ipc sockets; each test kills or stops one of them and checks what clients and health
checks see: streams of a dead worker end UNAVAILABLE within 5 s, readiness goes NOT_SERVING
while liveness stays SERVING, a worker restarted at the same address is found again (the
scheduler starts over on its pool) and answers token for token as before, a worker outlives
its scheduler and serves the next one, SIGTERM drains. Then `radixserve serve` restarting a
killed child, and giving up on a crash loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.common.transport import new_ipc_addr
from tests.server_util import DEFAULT_MODEL, REPO, Server, free_port, greedy
from tests.server_util import serve_children as _children

pytestmark = pytest.mark.slow

PROMPT = "Beautiful is better than"
FAIL_FAST_S = 5.0  # what the issue asks of a dead worker's streams
BOOT_S = 180.0
DRAIN_S = 4.0  # the replacement scheduler's --shutdown-grace-period


def _status(addr: str, service: str = "") -> str:
    """The health status name of ``service`` at ``addr`` ("DOWN" when nothing answers)."""
    try:
        with grpc.insecure_channel(addr) as ch:
            req = health_pb2.HealthCheckRequest(service=service)
            reply = health_pb2_grpc.HealthStub(ch).Check(req, timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "DOWN"


def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Waits for ``cond``; returns how long it took."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, (
            f"timed out ({timeout_s:g} s) waiting for {what}"
        )
        time.sleep(0.1)
    return time.monotonic() - start


class Stream:
    """A greedy Generate consumed on a thread: how it ended, and when."""

    def __init__(self, stub, max_tokens: int = 480, text: str = "A long one."):
        self.tokens = 0
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.finish_reason = ""
        self.ended_at = 0.0
        self.started = threading.Event()
        self.done = threading.Event()
        sampling = greedy(max_tokens, ignore_eos=True)
        self._call = stub.Generate(pb.GenerateRequest(text=text, sampling=sampling), timeout=120)
        threading.Thread(target=self._consume, daemon=True).start()

    def _consume(self) -> None:
        try:
            for msg in self._call:
                self.tokens += len(msg.token_ids)
                self.finish_reason = msg.finish_reason or self.finish_reason
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""
        self.ended_at = time.monotonic()
        self.started.set()
        self.done.set()


class Stack:
    """Worker, scheduler and frontend as separate processes (as in the chart's pods)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.worker_addr, self.sched_addr = new_ipc_addr("w"), new_ipc_addr("s")
        self.worker_grpc, self.control, self.port = free_port(), free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.sched_flags: tuple[str, ...] = ()
        for name in ("worker", "scheduler", "frontend"):
            self.start(name)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.wait_ready(BOOT_S)

    def argv(self, name: str) -> list[str]:
        if name == "worker":
            return [
                f"--model-path={DEFAULT_MODEL}",
                "--device=cpu",
                f"--worker-addr={self.worker_addr}",
                f"--worker-grpc-port={self.worker_grpc}",
                "--max-total-tokens=4096",
                "--max-running-requests=16",
                "--cpu-threads=1",
            ]
        if name == "scheduler":
            return [
                f"--scheduler-addr={self.sched_addr}",
                f"--worker-addr={self.worker_addr}",
                f"--control-port={self.control}",
                "--max-running-requests=16",
                *self.sched_flags,
            ]
        return [
            f"--model-path={DEFAULT_MODEL}",
            f"--port={self.port}",
            "--http-port=-1",
            f"--scheduler-addrs={self.sched_addr}",
            f"--scheduler-control-addrs=127.0.0.1:{self.control}",
        ]

    def start(self, name: str) -> None:
        log = open(self.log_dir / f"{name}.log", "a")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", name, *self.argv(name)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[name].pid, sig)

    def health(self, name: str, service: str = "") -> str:
        port = {"worker": self.worker_grpc, "scheduler": self.control, "frontend": self.port}
        return _status(f"127.0.0.1:{port[name]}", service)

    def wait_ready(self, timeout_s: float) -> float:
        return _until(lambda: self.health("frontend") == "SERVING", timeout_s, "frontend ready")

    def generate(self, max_tokens: int = 16) -> list[int]:
        req = pb.GenerateRequest(text=PROMPT, sampling=greedy(max_tokens))
        return [t for msg in self.stub.Generate(req, timeout=60) for t in msg.token_ids]

    def stats(self) -> engine_pb2.SchedulerStats:
        with grpc.insecure_channel(f"127.0.0.1:{self.control}") as ch:
            stub = engine_pb2_grpc.SchedulerControlStub(ch)
            return stub.GetStats(engine_pb2.StatsRequest(), timeout=5)

    def output(self) -> str:
        return "\n".join(
            f"----- {p.name} -----\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def close(self) -> None:
        self.channel.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for addr in (self.worker_addr, self.sched_addr):  # kill -9 leaves the socket files
            Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("faults"))
    try:
        yield s
    finally:
        s.close()


def _idle_pool_holds_only_cache(stack: Stack) -> engine_pb2.SchedulerStats:
    _until(lambda: stack.stats().num_running_reqs == 0, 10, "the engine to go idle")
    st = stack.stats()
    assert st.used_tokens == 0 and st.protected_tokens == 0, st
    assert st.available_tokens + st.evictable_tokens == st.max_total_num_tokens, st
    return st


def test_a_killed_worker_fails_its_streams_fast_and_a_restarted_one_serves(stack: Stack):
    before = stack.generate()
    stream = Stream(stack.stub)
    assert stream.started.wait(60), stack.output()
    stack.kill("worker")
    killed = time.monotonic()
    assert stream.done.wait(FAIL_FAST_S + 5), f"stream still open\n{stack.output()}"
    assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.code, stream.details)
    assert stream.ended_at - killed < FAIL_FAST_S, stream.ended_at - killed
    assert "worker" in stream.details or "engine" in stream.details, stream.details
    # Readiness follows the worker; liveness does not (nothing should restart the others).
    _until(lambda: stack.health("scheduler") == "NOT_SERVING", FAIL_FAST_S, "scheduler unready")
    _until(lambda: stack.health("frontend") == "NOT_SERVING", FAIL_FAST_S, "frontend unready")
    assert stack.health("scheduler", "liveness") == "SERVING"
    assert stack.health("frontend", "liveness") == "SERVING"
    # A new request fails at once instead of waiting for a worker.
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stack.generate()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5
    # The same worker address comes back: found again, the cache starts over on its pool.
    stack.start("worker")
    _until(lambda: stack.health("worker") == "SERVING", BOOT_S, "worker restarted")
    assert stack.wait_ready(30) < 30, stack.output()
    assert stack.generate() == before
    _idle_pool_holds_only_cache(stack)
    assert "serving again" in (stack.log_dir / "scheduler.log").read_text()


def test_a_killed_scheduler_leaves_the_worker_serving_its_replacement(stack: Stack):
    before = stack.generate()
    worker = stack.procs["worker"]
    stream = Stream(stack.stub)
    assert stream.started.wait(60), stack.output()
    stack.kill("scheduler")
    killed = time.monotonic()
    assert stream.done.wait(FAIL_FAST_S + 5), stack.output()
    assert stream.code == grpc.StatusCode.UNAVAILABLE and stream.ended_at - killed < FAIL_FAST_S
    _until(lambda: stack.health("frontend") == "NOT_SERVING", FAIL_FAST_S, "frontend unready")
    time.sleep(1.0)  # the worker's replies to the dead scheduler fail meanwhile
    assert worker.poll() is None, f"the worker died with its scheduler\n{stack.output()}"
    # The next scheduler (short drain, for the SIGTERM test below) drives the same worker.
    stack.sched_flags = (f"--shutdown-grace-period={DRAIN_S:g}",)
    stack.start("scheduler")
    stack.wait_ready(60)
    assert stack.generate() == before
    assert stack.procs["worker"] is worker and worker.poll() is None  # no model reload
    _idle_pool_holds_only_cache(stack)


def test_sigterm_drains_running_streams_and_refuses_new_ones(stack: Stack):
    short = Stream(stack.stub, max_tokens=24, text="Simple is better")
    long = Stream(stack.stub, max_tokens=480)
    assert short.started.wait(60) and long.started.wait(60), stack.output()
    # As Kubernetes deletes a pod: both engine containers get SIGTERM at once.
    stack.kill("scheduler", signal.SIGTERM)
    stack.kill("worker", signal.SIGTERM)
    signalled = time.monotonic()
    _until(lambda: stack.health("scheduler") != "SERVING", 3, "scheduler NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:  # new work is refused at once
        stack.generate()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert short.done.wait(30) and short.code == grpc.StatusCode.OK, short.details
    assert short.finish_reason == "length" and short.tokens == 24
    # A stream that needs longer than the grace period ends UNAVAILABLE.
    assert long.done.wait(30), stack.output()
    if long.code != grpc.StatusCode.OK:  # it may finish within the grace on a fast machine
        # Failed by the scheduler at the end of its grace, not by a frontend that took the
        # draining engine for a dead one.
        assert long.code == grpc.StatusCode.UNAVAILABLE, (long.code, long.details)
        assert "shut down" in long.details, long.details
    for name in ("scheduler", "worker"):
        stack.procs[name].wait(15)
    assert time.monotonic() - signalled < DRAIN_S + 10, "SIGTERM not honoured within the grace"
    assert stack.procs["scheduler"].returncode == 0, stack.output()


def _generate_when_back(s: Server, timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return s.generate(text=PROMPT, sampling=greedy(16), timeout=30)[0]
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert time.monotonic() < deadline, f"not serving again\n{s.output()}"
            time.sleep(0.3)


def test_serve_restarts_a_killed_child_then_gives_up_on_a_crash_loop():
    with Server("--max-restarts=1", "--restart-backoff=0.2", "--max-total-tokens=4096") as s:
        before, _, _ = s.generate(text=PROMPT, sampling=greedy(16))
        first = _children(s.proc.pid)["worker"]
        os.kill(first, signal.SIGKILL)
        _until(lambda: _children(s.proc.pid).get("worker", first) != first, 30, "worker restarted")
        assert _generate_when_back(s) == before
        assert "restarting it in 0.2 s" in s.output()
        # A second death within the window is over --max-restarts 1: everything stops.
        os.kill(_children(s.proc.pid)["worker"], signal.SIGKILL)
        s.proc.wait(60)
        assert s.proc.returncode == 1
        assert "crash loop" in s.output(), s.output()
