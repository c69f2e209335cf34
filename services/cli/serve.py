"""`radixserve serve`: the three services as three OS processes, started in order and supervised.

Internal addresses default to per-instance ipc paths and free ports, so two servers given
different --port values run side by side. If one process dies, the others are stopped
with a message naming which and why; Ctrl-C or SIGTERM stops all of them; children get
SIGTERM from the kernel should this process die without cleaning up (no orphans).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import (
    FrontendConfig,
    SchedulerConfig,
    WorkerConfig,
    from_args,
    to_argv,
)
from services.common.transport import new_ipc_addr

STOP_GRACE_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: the kernel sends SIGTERM when `radixserve serve` goes away."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    health_addr: str


def plan(ns: argparse.Namespace) -> tuple[WorkerConfig, SchedulerConfig, FrontendConfig]:
    """The three configs, with every internal address filled in for this instance."""
    host = ns.host
    metrics = ns.metrics_port
    worker = from_args(
        WorkerConfig,
        ns,
        worker_addr=ns.worker_addr or new_ipc_addr("worker"),
        worker_grpc_port=ns.worker_grpc_port or free_port(host),
        metrics_port=metrics + 2 if metrics else 0,
    )
    sched = from_args(
        SchedulerConfig,
        ns,
        worker_addr=worker.worker_addr,
        scheduler_addr=ns.scheduler_addr or new_ipc_addr("scheduler"),
        control_port=ns.control_port or free_port(host),
        metrics_port=metrics + 1 if metrics else 0,
    )
    front = from_args(
        FrontendConfig,
        ns,
        scheduler_addrs=[sched.scheduler_addr],
        scheduler_control_addrs=[f"{host}:{sched.control_port}"],
    )
    return worker, sched, front


def spawn(name: str, cfg) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", name, *to_argv(cfg)]
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent)


def healthy(addr: str, timeout: float = 1.0) -> bool:
    """What the kubelet's gRPC probe asks: grpc.health.v1 Check of service "" is SERVING."""
    try:
        with grpc.insecure_channel(addr) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def stop_all(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def first_dead(children: list[Child]) -> Child | None:
    return next((c for c in children if c.proc.poll() is not None), None)


def _describe(c: Child) -> str:
    rc = c.proc.returncode
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    return f"radixserve: the {c.name} process {how}; its log is above. Stopping the others."


def wait_healthy(children: list[Child], timeout: float) -> Child | None:
    """Waits until each child answers SERVING, in order; returns a child that died instead."""
    deadline = time.monotonic() + timeout
    for c in children:
        while not healthy(c.health_addr):
            dead = first_dead(children)
            if dead:
                return dead
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {c.name} did not become healthy within {timeout:.0f} s")
            time.sleep(0.2)
    return None


def _interrupt(signum, frame) -> None:
    """SIGTERM behaves as Ctrl-C: stop everything cleanly."""
    raise KeyboardInterrupt


def serve(ns: argparse.Namespace) -> int:
    worker, sched, front = plan(ns)
    host = ns.host
    children: list[Child] = []
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        children.append(
            Child("worker", spawn("worker", worker), f"{host}:{worker.worker_grpc_port}")
        )
        children.append(
            Child("scheduler", spawn("scheduler", sched), f"{host}:{sched.control_port}")
        )
        children.append(Child("frontend", spawn("frontend", front), f"{host}:{front.port}"))
        dead = wait_healthy(children, ns.startup_timeout)
        if dead is None:
            http = (
                f", HTTP (OpenAI API) on http://{host}:{front.http_port}"
                if front.http_port > 0
                else ""
            )
            print(
                f"radixserve: serving {front.served_model_name or front.model_path} - gRPC on "
                f"{host}:{front.port}{http}. Ctrl-C stops.",
                flush=True,
            )
            while (dead := first_dead(children)) is None:
                time.sleep(0.2)
        print(_describe(dead), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("radixserve: stopping.", file=sys.stderr, flush=True)
        return 0
    except TimeoutError as e:
        print(f"radixserve: {e}. Stopping.", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)
