"""Several engines and frontends on loopback, wired the way the Helm chart wires them.

Each engine (a scheduler + worker pair, as in one engine pod) gets its own loopback address
(127.0.0.2, .3, .4 ...) and the same fixed ports there, as pods do; the frontends find them
through the A records of one DNS name, which a stub DNS server answers (standing in for the
cluster DNS and the engines' headless Service). Used by tests/e2e/test_scaling.py,
tests/e2e/test_fleet_cache.py and bench/bench_fleet.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.curve import generate_keys
from tests.dns_stub import DnsStub
from tests.server_util import DEFAULT_MODEL, REPO, free_port

DNS_NAME = "rs-radixserve-engine-headless.ns.svc.cluster.local"
LOAD_FACTOR = 1.25


def spawn(log_dir: Path, name: str, *args: str) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    # Every process on CURVE keys, as in the chart (tcp:// links need them).
    keys = log_dir / "keys"
    if not keys.exists():
        generate_keys(str(keys))
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args, f"--internal-keys-dir={keys}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )


def healthy(addr: str, service: str = "") -> bool:
    try:
        with grpc.insecure_channel(addr) as ch:
            req = health_pb2.HealthCheckRequest(service=service)
            status = health_pb2_grpc.HealthStub(ch).Check(req, timeout=1).status
            return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Cluster:
    """Engines on 127.0.0.<n>, all on the same ports; frontends that discover them by DNS."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.dns = DnsStub().start()
        # The ports every engine pod uses (the chart fixes 30100/30101/30102/30200/30201).
        self.zmq, self.control, self.metrics = free_port(), free_port(), free_port()
        self.events = free_port()
        self.worker_zmq, self.worker_grpc = free_port(), free_port()
        self.engines: dict[str, list[subprocess.Popen]] = {}
        self.frontends: list[tuple[subprocess.Popen, str]] = []
        self.http_ports: list[int] = []  # of each frontend (-1: none)

    def start_engine(
        self,
        ip: str,
        worker_flags: tuple[str, ...] = (),
        scheduler_flags: tuple[str, ...] = (),
        model: Path = DEFAULT_MODEL,
    ) -> None:
        worker = spawn(
            self.log_dir,
            f"worker-{ip}",
            "worker",
            f"--model-path={model}",
            "--device=cpu",
            f"--host={ip}",
            f"--worker-addr=tcp://{ip}:{self.worker_zmq}",
            f"--worker-grpc-port={self.worker_grpc}",
            "--max-total-tokens=8192",
            "--max-running-requests=32",
            "--cpu-threads=1",
            *worker_flags,
        )
        scheduler = spawn(
            self.log_dir,
            f"scheduler-{ip}",
            "scheduler",
            f"--host={ip}",
            f"--scheduler-addr=tcp://{ip}:{self.zmq}",
            f"--control-port={self.control}",
            f"--worker-addr=tcp://{ip}:{self.worker_zmq}",
            "--enable-metrics",
            f"--metrics-port={self.metrics}",
            f"--engine-replica={ip}",
            "--max-running-requests=32",
            f"--cache-events-port={self.events}",
            *scheduler_flags,
        )
        self.engines[ip] = [scheduler, worker]

    def wait_engine(self, ip: str) -> None:
        until(lambda: healthy(f"{ip}:{self.control}"), 180, f"engine {ip}")

    def start_frontend(self, *flags: str, model: Path = DEFAULT_MODEL, http: bool = False) -> str:
        port, http_port = free_port(), free_port() if http else -1
        self.http_ports.append(http_port)
        proc = spawn(
            self.log_dir,
            f"frontend-{len(self.frontends)}",
            "frontend",
            f"--model-path={model}",
            f"--port={port}",
            f"--http-port={http_port}",
            f"--engine-dns-name={DNS_NAME}",
            f"--engine-dns-server={self.dns.address}",
            f"--engine-zmq-port={self.zmq}",
            f"--engine-control-port={self.control}",
            "--engine-resolve-interval=0.5",
            f"--routing-load-factor={LOAD_FACTOR}",
            *flags,
        )
        addr = f"127.0.0.1:{port}"
        self.frontends.append((proc, addr))
        until(lambda: healthy(addr, "liveness"), 60, f"frontend {addr}")
        return addr

    def publish(self, ips: list[str]) -> None:
        """What the headless Service's DNS name resolves to (kubectl scale)."""
        self.dns.set(DNS_NAME, ips)

    def kill(self, ip: str) -> None:
        for proc in self.engines.pop(ip):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def metric(self, ip: str, name: str) -> float:
        """A metric of the engine's scheduler, summed over its labels."""
        url = f"http://{ip}:{self.metrics}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(
            s.value
            for fam in text_string_to_metric_families(body)
            for s in fam.samples
            if s.name == name
        )

    def requests_done(self, ip: str) -> float:
        """Finished requests on the engine (all finish reasons)."""
        return self.metric(ip, "radixserve:num_requests_total")

    def running(self, ip: str) -> int:
        return int(self.metric(ip, "radixserve:num_running_reqs"))

    def settle(self, ips: list[str]) -> None:
        """Waits until the engines are idle and the frontends' probes have seen it, so that
        routing starts from equal loads."""
        until(lambda: all(self.running(ip) == 0 for ip in ips), 30, "engines idle")
        time.sleep(1.5)  # a probe round (1 s) of every frontend

    def close(self) -> None:
        procs = [p for p, _ in self.frontends] + [p for ps in self.engines.values() for p in ps]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.dns.stop()

    def logs(self) -> str:
        logs = sorted(self.log_dir.glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
