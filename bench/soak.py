"""Soak: many concurrent streams for minutes, with one kill -9 of each service in turn. Not a test.

It starts the three services itself as separate processes (as Kubernetes runs them, on
private ipc sockets), so it can kill and restart each one, and drives the public gRPC API
from one asyncio loop:

- N client loops, each sending one streaming Generate after another until the time is up:
  mixed prompt lengths and max_tokens, some greedy and some sampled, some with stop
  strings, some cancelled by the client after a few tokens;
- a flusher calling FlushCache every few seconds (refused while busy: counted apart);
- a fault schedule: kill -9 of the worker at 1/4 of the run, the scheduler at 1/2, the
  frontend at 3/4; each is started again after --restart-delay (as `radixserve serve` or a
  kubelet would); recovery is measured twice: kill -> the frontend ready again, and
  kill -> the first token a client got afterwards.

At the end: requests by outcome (gRPC code; client cancels apart), TTFT p50/p99 of the
requests that streamed, recovery times, and the pool check: once idle, the engine must hold
nothing but evictable cache (used == protected == 0, free + evictable == total).

    .venv/bin/python bench/soak.py                       # 500 streams x 5 min (the issue's size)
    .venv/bin/python bench/soak.py --streams 50 --minutes 1 --json-out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from radixserve.v1 import generation_pb2 as pb  # noqa: E402
from radixserve.v1 import generation_pb2_grpc  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH  # noqa: E402
from services.common.transport import new_ipc_addr  # noqa: E402

MAX_STREAMS, MAX_MINUTES = 2000, 60.0
WORDS = (
    "beautiful ugly explicit implicit simple complex flat nested sparse dense readability "
    "counts special cases errors silence practicality purity namespaces honking great idea"
).split()
KILL_ORDER = ("worker", "scheduler", "frontend")
_PROBES: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the services -------------------------------------------------------------------------


class Services:
    """Worker, scheduler and frontend as separate processes, each restartable in place."""

    def __init__(self, ns: argparse.Namespace, log_dir: Path):
        self.ns, self.log_dir = ns, log_dir
        self.worker_addr, self.sched_addr = new_ipc_addr("soak-w"), new_ipc_addr("soak-s")
        self.worker_grpc, self.control, self.port = free_port(), free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}

    def argv(self, name: str) -> list[str]:
        ns = self.ns
        if name == "worker":
            return [
                f"--model-path={ns.model_path}",
                f"--device={ns.device}",
                f"--worker-addr={self.worker_addr}",
                f"--worker-grpc-port={self.worker_grpc}",
                f"--max-total-tokens={ns.max_total_tokens}",
                f"--max-running-requests={ns.max_running_requests}",
            ]
        if name == "scheduler":
            return [
                f"--scheduler-addr={self.sched_addr}",
                f"--worker-addr={self.worker_addr}",
                f"--control-port={self.control}",
                f"--max-running-requests={ns.max_running_requests}",
            ]
        return [
            f"--model-path={ns.model_path}",
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

    def start_all(self) -> None:
        for name in KILL_ORDER:
            self.start(name)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()

    def remove_sockets(self) -> None:
        """kill -9 leaves ipc socket files behind."""
        for addr in (self.worker_addr, self.sched_addr):
            Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]


# ---- the clients --------------------------------------------------------------------------


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # gRPC code name, or client-cancel
    messages: dict[str, str] = field(default_factory=dict)  # one example message per code
    ttft: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)  # when (monotonic)
    tokens: int = 0
    flushes: Counter = field(default_factory=Counter)
    outage: str = ""  # the service killed and not serving again yet ("" when none)

    def error(self, code: str, message: str) -> None:
        key = f"{code} (during {self.outage} outage)" if self.outage else code
        self.outcomes[key] += 1
        self.messages.setdefault(key, message[:200])


def random_request(rng: random.Random) -> tuple[pb.GenerateRequest, int]:
    """A request of a random shape; returns it and after how many tokens to cancel (0: never)."""
    words = rng.randint(3, 120)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    sampling = pb.SamplingParams(
        max_tokens=rng.choice([4, 16, 64, 128, 256]),
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0]),
        ignore_eos=rng.random() < 0.5,
    )
    if rng.random() < 0.2:
        sampling.stop.extend(rng.sample(WORDS, 2))
    cancel_after = rng.randint(1, 8) if rng.random() < 0.1 else 0
    return pb.GenerateRequest(text=text, sampling=sampling), cancel_after


async def one_request(stub, req: pb.GenerateRequest, cancel_after: int, tally: Tally) -> None:
    start = time.monotonic()
    call = stub.Generate(req, timeout=120)
    got = 0
    try:
        async for msg in call:
            if got == 0 and msg.token_ids:
                now = time.monotonic()
                tally.ttft.append(now - start)
                tally.first_tokens.append(now)
            got += len(msg.token_ids)
            if cancel_after and got >= cancel_after:
                call.cancel()
                tally.outcomes["client-cancel"] += 1
                return
        tally.outcomes["OK"] += 1
    except grpc.aio.AioRpcError as e:
        tally.error(e.code().name, e.details() or "")
        await asyncio.sleep(0.2)  # do not spin on a server that is down
    except asyncio.CancelledError:
        if not call.cancelled():
            raise
    finally:
        tally.tokens += got


async def client_loop(stub, rng: random.Random, end: float, tally: Tally) -> None:
    while time.monotonic() < end:
        req, cancel_after = random_request(rng)
        await one_request(stub, req, cancel_after, tally)


async def flusher(stub, end: float, every_s: float, tally: Tally) -> None:
    while time.monotonic() < end:
        await asyncio.sleep(every_s)
        try:
            reply = await stub.FlushCache(pb.FlushCacheRequest(), timeout=5)
            tally.flushes["flushed" if reply.flushed else "refused (busy)"] += 1
        except grpc.aio.AioRpcError as e:
            tally.flushes[e.code().name] += 1


# ---- faults -------------------------------------------------------------------------------


async def health_status(port: int) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            req = health_pb2.HealthCheckRequest(service="")
            reply = await health_pb2_grpc.HealthStub(ch).Check(req, timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError:
            return "DOWN"


async def kill_and_recover(
    svc: Services, stub, name: str, restart_delay: float, tally: Tally
) -> dict:
    """kill -9, start again after restart_delay; measures kill -> the frontend ready again
    (after it was seen not ready) and kill -> the first token a client got afterwards (the
    soak's clients, or once the frontend is ready a probe request of max_tokens=1, so the
    figure exists after the load has ended too)."""
    killed = time.monotonic()
    tally.outage = name
    svc.kill(name)
    print(f"soak: kill -9 {name} at {time.strftime('%H:%M:%S')}", flush=True)
    seen_down = False
    restart_at = killed + restart_delay
    ready_s = first_token_s = None
    probe: asyncio.Task | None = None
    while first_token_s is None and time.monotonic() - killed < 300:
        await asyncio.sleep(0.1)
        if restart_at and time.monotonic() >= restart_at:
            svc.start(name)
            restart_at = 0.0
        if ready_s is None:
            status = await health_status(svc.port)
            seen_down = seen_down or status != "SERVING"
            if seen_down and status == "SERVING":
                ready_s = round(time.monotonic() - killed, 2)
        elif probe is None or probe.done():
            req = pb.GenerateRequest(text="Simple is", sampling=pb.SamplingParams(max_tokens=1))
            probe = asyncio.create_task(one_request(stub, req, 0, tally))
        after = [t for t in tally.first_tokens if t > killed + 0.5]
        if after and ready_s is not None:
            first_token_s = round(min(after) - killed, 2)
    if probe is not None and not probe.done():
        _PROBES.add(probe)  # finishes on its own; the next kill need not wait for it
        probe.add_done_callback(_PROBES.discard)
    tally.outage = ""
    print(f"soak: {name} back: ready {ready_s} s, first token {first_token_s} s", flush=True)
    return {"service": name, "ready_s": ready_s, "first_token_s": first_token_s}


async def fault_schedule(
    svc: Services, stub, start: float, total: float, ns, tally: Tally
) -> list[dict]:
    out = []
    for i, name in enumerate(KILL_ORDER):
        await asyncio.sleep(max(0.0, start + total * (i + 1) / 4 - time.monotonic()))
        out.append(await kill_and_recover(svc, stub, name, ns.restart_delay, tally))
    return out


# ---- the run ------------------------------------------------------------------------------


async def wait_serving(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not serving within {timeout_s:g} s")


async def pool_check(control: int) -> dict[str, Any]:
    """Once idle, the pool holds nothing but evictable cache."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{control}") as ch:
        stub = engine_pb2_grpc.SchedulerControlStub(ch)
        for _ in range(100):
            st = await stub.GetStats(engine_pb2.StatsRequest(), timeout=5)
            if st.num_running_reqs == 0 and st.num_queue_reqs == 0:
                break
            await asyncio.sleep(0.2)
    ok = (
        st.used_tokens == 0
        and st.protected_tokens == 0
        and st.available_tokens + st.evictable_tokens == st.max_total_num_tokens
    )
    return {
        "ok": ok,
        "total": st.max_total_num_tokens,
        "free": st.available_tokens,
        "evictable": st.evictable_tokens,
        "used": st.used_tokens,
        "protected": st.protected_tokens,
    }


async def soak(ns: argparse.Namespace, svc: Services) -> dict[str, Any]:
    await wait_serving(svc.port, ns.startup_timeout)
    tally = Tally()
    total = ns.minutes * 60
    start = time.monotonic()
    end = start + total
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        rng = random.Random(ns.seed)
        clients = [
            client_loop(stub, random.Random(rng.random()), end, tally) for _ in range(ns.streams)
        ]
        tasks = [*clients, flusher(stub, end, ns.flush_every, tally)]
        faults = (
            fault_schedule(svc, stub, start, total, ns, tally) if ns.kills else asyncio.sleep(0)
        )
        results = await asyncio.gather(faults, *tasks)
    wall = time.monotonic() - start
    return report(ns, tally, wall, results[0] or [], await pool_check(svc.control), svc.dead())


def report(ns, tally: Tally, wall: float, recoveries, pool, dead) -> dict[str, Any]:
    ttft = np.array(tally.ttft) * 1000 if tally.ttft else np.array([float("nan")])
    return {
        "config": {
            "streams": ns.streams,
            "minutes": ns.minutes,
            "kills": ns.kills,
            "max_total_tokens": ns.max_total_tokens,
            "device": ns.device,
        },
        "wall_s": round(wall, 1),
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(tally.outcomes.most_common()),
        "error_examples": tally.messages,
        "output_tokens": tally.tokens,
        "ttft_ms": {
            "p50": round(float(np.percentile(ttft, 50)), 1),
            "p99": round(float(np.percentile(ttft, 99)), 1),
        },
        "flushes": dict(tally.flushes),
        "recoveries": recoveries,
        "pool_at_end": pool,
        "processes_dead_at_end": dead,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--streams", type=int, default=500, help=f"concurrent streams (<= {MAX_STREAMS})"
    )
    p.add_argument("--minutes", type=float, default=5.0, help=f"duration (<= {MAX_MINUTES:g})")
    p.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--flush-every", type=float, default=5.0, help="seconds between FlushCache")
    p.add_argument("--restart-delay", type=float, default=1.0, help="kill -> restart, seconds")
    p.add_argument("--no-kills", dest="kills", action="store_false", help="load only")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="", help="also write the report here")
    ns = p.parse_args(argv)
    if not 1 <= ns.streams <= MAX_STREAMS:
        p.error(f"--streams must be in [1, {MAX_STREAMS}], got {ns.streams}")
    if not 0 < ns.minutes <= MAX_MINUTES:
        p.error(f"--minutes must be in (0, {MAX_MINUTES:g}], got {ns.minutes}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-soak-"))
    svc = Services(ns, log_dir)
    print(f"soak: {ns.streams} streams x {ns.minutes:g} min; service logs in {log_dir}", flush=True)
    svc.start_all()
    try:
        rep = asyncio.run(soak(ns, svc))
    finally:
        svc.stop_all()
        svc.remove_sockets()
    text = json.dumps(rep, indent=2)
    print(text)
    if ns.json_out:
        Path(ns.json_out).write_text(text + "\n")
    healthy = rep["pool_at_end"]["ok"] and not rep["processes_dead_at_end"]
    recovered = all(r["first_token_s"] is not None for r in rep["recoveries"])
    return 0 if healthy and recovered else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
