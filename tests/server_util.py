"""Starts a real `radixserve serve` (three OS processes on loopback) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.v1 import generation_pb2, generation_pb2_grpc
from services.common.config import DEFAULT_MODEL_PATH

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path(DEFAULT_MODEL_PATH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_block(n: int) -> tuple[int, list[socket.socket]]:
    """n consecutive free ports, held open (so free_port() cannot hand them out meanwhile)."""
    for _ in range(100):
        held: list[socket.socket] = []
        base = free_port()
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", p))
            return base, held
        except OSError:
            for sock in held:
                sock.close()
    raise OSError(f"no block of {n} free ports")


class Server:
    """`radixserve serve` in a subprocess; `stub` talks gRPC to its frontend.

    With metrics=True, /metrics is on: `metrics_port` is the frontend's, the scheduler's is
    `metrics_port + 1` (`sched_metrics`), the worker's `metrics_port + 2` (serve's convention).
    """

    def __init__(
        self,
        *flags: str,
        model: Path | str = DEFAULT_MODEL,
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        metrics: bool = False,
        ignore_sigint: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        """``credentials``: how ``stub`` dials a frontend given --ssl-* flags (TLS)."""
        held: list[socket.socket] = []
        if metrics:
            self.metrics_port, held = _port_block(3)
            self.sched_metrics = self.metrics_port + 1
            flags = ("--enable-metrics", "--metrics-port", str(self.metrics_port), *flags)
        self.port, self.http_port = free_port(), free_port()
        for sock in held:
            sock.close()
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="radixserve-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--model-path",
            str(model),
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            # What `radixserve serve &` in a non-interactive shell gets: SIGINT ignored.
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            if ignore_sigint
            else None,
        )
        self.addr = f"127.0.0.1:{self.port}"
        self.channel = (
            grpc.secure_channel(self.addr, credentials)
            if credentials
            else grpc.insecure_channel(self.addr)
        )
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        health = health_pb2_grpc.HealthStub(self.channel)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"radixserve serve exited ({self.proc.returncode}):\n{self.output()}"
                )
            try:
                r = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        self.close()
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def generate(
        self, timeout: float = 120.0, **kw
    ) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
        """Runs one Generate to the end: (token ids, text, last message)."""
        ids, text, last = [], "", None
        for msg in self.stub.Generate(generation_pb2.GenerateRequest(**kw), timeout=timeout):
            ids.extend(msg.token_ids)
            text += msg.text
            last = msg
        return ids, text, last

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def greedy(max_tokens: int, **extra) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def scrape_metrics(port: int) -> dict[str, float]:
    """A /metrics page as {sample name: value}, summed over labels (one model, one engine);
    histogram buckets and per-finish-reason counters are left out."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if "le" not in s.labels and "finish_reason" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def idle_pool_is_whole(server: Server, timeout_s: float = 10.0) -> None:
    """Once idle, every KV token is back in the pool: free or evictable, none in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(server.sched_metrics)
        whole = m["radixserve:kv_available_tokens"] + m["radixserve:kv_evictable_tokens"]
        if whole == m["radixserve:max_total_num_tokens"] and m["radixserve:kv_used_tokens"] == 0:
            return
        assert time.monotonic() < deadline, f"KV not returned: {m}"
        time.sleep(0.05)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token-id lists."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class BackgroundStream:
    """A long greedy Generate consumed on a thread, so a test can act while it runs."""

    def __init__(
        self, server: Server, text: str = "A long one.", max_tokens: int = 400, timeout: float = 120
    ):
        import threading

        self.started = threading.Event()
        self.call = server.stub.Generate(
            generation_pb2.GenerateRequest(text=text, sampling=greedy(max_tokens, ignore_eos=True)),
            timeout=timeout,
        )
        self._thread = threading.Thread(target=self._consume)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for _ in self.call:
                self.started.set()
        except grpc.RpcError:  # cancelled by stop()
            pass

    def stop(self, timeout: float = 30) -> None:
        self.call.cancel()
        self._thread.join(timeout)


def serve_children(pid: int) -> dict[str, int]:
    """`radixserve serve`'s children by service name."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
                out[cmd[3].decode()] = int(stat.parent.name)  # python -m services.cli NAME
        except (OSError, IndexError, ValueError):
            pass
    return out
