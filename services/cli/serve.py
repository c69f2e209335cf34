"""`radixserve serve`: the three services as three OS processes, started in order and supervised.

Internal addresses default to per-instance ipc paths and free ports, so servers on different
--port values run side by side. A child that dies after start-up is restarted (same flags,
backoff; over --max-restarts in --restart-window, or `--on-child-exit stop`, stops all); one
dying during start-up stops all. Ctrl-C or SIGTERM stops all (each drains); children get
SIGTERM from the kernel should this process die (no orphans).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import shutil
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
    ServeConfig,
    WorkerConfig,
    exit_usage,
    from_args,
    secret_env,
    to_argv,
)
from services.common.curve import ephemeral_keys
from services.common.hostport import host_port
from services.common.tls import ClientTls
from services.common.transport import new_ipc_addr

STOP_GRACE_S = 10.0  # beyond the children's own --shutdown-grace-period (their drain)
MAX_BACKOFF_S = 30.0


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A port the kernel calls free now, other than the ports in `avoid`: those named on the
    command line are not bound yet (the frontend binds them later), so the kernel may hand
    one of them out again, and two services would then race for it."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def _named_ports(ns: argparse.Namespace) -> set[int]:
    """Every port the command line gives a service (metrics: the three of serve's block)."""
    named = {getattr(ns, name, 0) or 0 for name in ("port", "http_port", "worker_grpc_port",
                                                    "control_port")}  # fmt: skip
    if getattr(ns, "metrics_port", 0):
        named |= {ns.metrics_port + i for i in range(3)}
    return {p for p in named if p > 0}


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
    restarts: list[float] = dataclasses.field(default_factory=list)  # when (monotonic)
    restart_at: float | None = None  # dead, to be started again at this time
    tls: ClientTls | None = None  # its health port speaks TLS (the control link's)
    listening_only: bool = False  # TLS this process cannot check: ready once it listens

    def ready(self) -> bool:
        if self.listening_only:
            return listening(self.health_addr)
        return healthy(self.health_addr, tls=self.tls)


def plan(ns: argparse.Namespace) -> tuple[WorkerConfig, SchedulerConfig, FrontendConfig]:
    """The three configs, with every internal address filled in for this instance."""
    host = ns.host
    metrics = ns.metrics_port
    taken = _named_ports(ns)
    worker_port = ns.worker_grpc_port or free_port(host, frozenset(taken))
    taken.add(worker_port)
    worker = from_args(
        WorkerConfig,
        ns,
        worker_addr=ns.worker_addr or new_ipc_addr("worker"),
        worker_grpc_port=worker_port,
        metrics_port=metrics + 2 if metrics else 0,
    )
    sched = from_args(
        SchedulerConfig,
        ns,
        worker_addr=worker.worker_addr,
        scheduler_addr=ns.scheduler_addr or new_ipc_addr("scheduler"),
        control_port=ns.control_port or free_port(host, frozenset(taken)),
        metrics_port=metrics + 1 if metrics else 0,
    )
    front = from_args(
        FrontendConfig,
        ns,
        scheduler_addrs=[sched.scheduler_addr],
        scheduler_control_addrs=[host_port(host, sched.control_port)],
    )
    return worker, sched, front


def spawn(name: str, cfg) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", name, *to_argv(cfg)]
    env = {**os.environ, **secret_env(cfg)}  # API keys by environment, never in argv
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=env)


def healthy(addr: str, timeout: float = 1.0, tls: ClientTls | None = None) -> bool:
    """What the kubelet's gRPC probe asks: grpc.health.v1 Check of service "" is SERVING
    (over TLS with ``tls``)."""
    try:
        with _channel(addr, tls) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _channel(addr: str, tls: ClientTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(addr)
    return grpc.secure_channel(addr, tls.credentials, options=list(tls.options))


def listening(addr: str, timeout: float = 1.0) -> bool:
    """A TCP connect succeeds: the frontend over TLS, whose certificate's CA (and, with
    --ssl-ca-certs, a client certificate) serve does not have. It binds after its engines
    answer, so this follows the other two being SERVING."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout):
            return True
    except OSError:
        return False


def stop_all(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def first_dead(children: list[Child]) -> Child | None:
    return next((c for c in children if c.proc.poll() is not None), None)


def _how(c: Child) -> str:
    rc = c.proc.returncode
    return f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"


def _describe(c: Child) -> str:
    return f"radixserve: the {c.name} process {_how(c)}; its log is above. Stopping the others."


def _say(text: str) -> None:
    print(f"radixserve: {text}", file=sys.stderr, flush=True)


def supervise(children: list[Child], configs: dict[str, object], policy: ServeConfig) -> int:
    """Restarts a dead child (same flags and addresses) after a doubling backoff; a crash loop
    (policy) or --on-child-exit stop stops everything. Returns the exit code (on failure only)."""
    while True:
        now = time.monotonic()
        for c in children:
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.restart_at = None
                    c.proc = spawn(c.name, configs[c.name])
                    _say(f"the {c.name} process restarted (pid {c.proc.pid})")
                continue
            if c.proc.poll() is None:
                continue
            if policy.on_child_exit == "stop":
                print(_describe(c), file=sys.stderr, flush=True)
                return 1
            c.restarts = [t for t in c.restarts if now - t < policy.restart_window]
            if len(c.restarts) >= policy.max_restarts:
                _say(
                    f"the {c.name} process {_how(c)} again: {len(c.restarts)} restarts within "
                    f"{policy.restart_window:g} s (--max-restarts {policy.max_restarts}) is a "
                    "crash loop; its log is above. Stopping the others."
                )
                return 1
            delay = min(MAX_BACKOFF_S, policy.restart_backoff * 2 ** len(c.restarts))
            c.restarts.append(now)
            c.restart_at = now + delay
            _say(
                f"the {c.name} process {_how(c)}; restarting it in {delay:g} s (restart "
                f"{len(c.restarts)} of at most {policy.max_restarts} within "
                f"{policy.restart_window:g} s)"
            )
        time.sleep(0.2)


def wait_healthy(children: list[Child], timeout: float) -> Child | None:
    """Waits until each child answers SERVING, in order; returns a child that died instead."""
    deadline = time.monotonic() + timeout
    for c in children:
        while not c.ready():
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
    try:
        policy = from_args(ServeConfig, ns)
    except ValueError as e:  # a flag or RADIXSERVE_* variable out of its range
        exit_usage("radixserve serve", e)
    # tcp:// links between the children get fresh CURVE keys unless keys were given, and so
    # does a public API behind a key: the scheduler's control port (FlushCache) would
    # otherwise answer any local user without one.
    own_keys = ephemeral_keys(
        [ns.worker_addr, ns.scheduler_addr],
        ns.internal_keys_dir,
        ns.insecure_internal,
        guard_control=_public_key_set(ns),
    )
    if own_keys:
        ns.internal_keys_dir = own_keys
    try:
        worker, sched, front = plan(ns)
        control_tls = _control_tls(sched, front)
    except ValueError as e:
        exit_usage("radixserve serve", e)
    host = ns.host
    children: list[Child] = []
    # SIGINT too: a shell starting `radixserve serve &` from a script makes SIGINT ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        worker_addr, sched_addr = (
            host_port(host, p) for p in (worker.worker_grpc_port, sched.control_port)
        )
        children.append(Child("worker", spawn("worker", worker), worker_addr, tls=control_tls))
        children.append(Child("scheduler", spawn("scheduler", sched), sched_addr, tls=control_tls))
        front_addr = host_port(host, front.port)
        tls_front = bool(front.ssl_certfile)
        children.append(
            Child("frontend", spawn("frontend", front), front_addr, listening_only=tls_front)
        )
        dead = wait_healthy(children, ns.startup_timeout)
        if dead is None:
            scheme = "https" if tls_front else "http"
            http = (
                f", HTTP (OpenAI API) on {scheme}://{host_port(host, front.http_port)}"
                if front.http_port > 0
                else ""
            )
            print(
                f"radixserve: serving {front.served_model_name or front.model_path} - gRPC on "
                f"{host_port(host, front.port)}{http}. Ctrl-C stops.",
                flush=True,
            )
            configs = {"worker": worker, "scheduler": sched, "frontend": front}
            return supervise(children, configs, policy)
        print(_describe(dead), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("radixserve: stopping.", file=sys.stderr, flush=True)
        return 0
    except TimeoutError as e:
        print(f"radixserve: {e}. Stopping.", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children, ns.shutdown_grace_period + STOP_GRACE_S)
        if own_keys:
            shutil.rmtree(own_keys, ignore_errors=True)
        _remove_own_sockets(ns, worker.worker_addr, sched.scheduler_addr)


def _control_tls(sched: SchedulerConfig, front: FrontendConfig) -> ClientTls | None:
    """How serve and the frontend dial the control ports: TLS when the scheduler and the
    worker have a certificate, checked by --control-ssl-ca-certs."""
    if bool(sched.control_ssl_certfile) != bool(front.control_ssl_ca_certs):
        raise ValueError(
            "--control-ssl-certfile and --control-ssl-ca-certs go together (the control "
            "ports' certificate and the CA their clients check it by)"
        )
    return ClientTls.of(front.control_ssl_ca_certs, front.control_ssl_server_name)


def _public_key_set(ns: argparse.Namespace) -> bool:
    keys = (getattr(ns, "api_key", ""), getattr(ns, "admin_api_key", ""))
    env = (os.environ.get("RADIXSERVE_API_KEY"), os.environ.get("RADIXSERVE_ADMIN_API_KEY"))
    return any(keys) or any(env)


def _remove_own_sockets(ns: argparse.Namespace, *addrs: str) -> None:
    """The ipc socket files serve named for its children (libzmq leaves them behind when a
    child is killed); addresses given on the command line are the caller's."""
    given = {ns.worker_addr, ns.scheduler_addr}
    for addr in addrs:
        if addr.startswith("ipc://") and addr not in given:
            with contextlib.suppress(OSError):
                os.unlink(addr.removeprefix("ipc://"))
