"""Chaos soak: many concurrent streams for minutes, kill -9 of a random service every 30-90 s,
and every answer that completed checked against the answer known in advance. Not a test.

It starts the three services itself as separate processes (as Kubernetes runs them, on
private ipc sockets), so it can kill and restart each one, and drives the public gRPC API
from one asyncio loop:

- before any fault, a set of reference requests (greedy, and sampled with a seed) is run
  twice against the fresh server: their tokens are the right answers (the two runs must
  agree, the second from the cache);
- N client loops, each sending one streaming Generate after another until the time is up:
  half of them reference requests (checked token for token when they end OK), the rest
  of random shapes (mixed lengths, greedy and sampled, stop strings, client cancels);
- a flusher calling FlushCache every few seconds (refused while busy: counted apart);
- faults: every 30-90 s (--kill-every) kill -9 of a service, each of the three in a
  random order before any repeats; it is started again after --restart-delay (as
  `radixserve serve` or a kubelet would); recovery is measured twice: kill -> the frontend
  ready again, and kill -> the first token a client got afterwards;
- every 5 s the RSS and open file descriptors of each process; drift is the median of the
  last 30 s against that of the first 30 s after --warmup, per process lifetime that
  spans both.

At the end: requests by outcome (gRPC code; client cancels apart), the reference answers
(OK and token-exact, OK and wrong, failed by status), requests missing an outcome, TTFT
p50/p99, recovery times, RSS/fd drift, and the pool check: once idle, the engine must hold
nothing but evictable cache (used == protected == 0, free + evictable == total).
--report-md writes all of it as one page. Exit status 0 only when every OK reference
answer is exact, none is missing, every error is a clear status with a message, drift is
within --max-drift, the pool is whole and every process alive.

    .venv/bin/python bench/soak.py --streams 500 --minutes 5       # the issue's two sizes
    .venv/bin/python bench/soak.py --streams 64 --minutes 15
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
        self.started: dict[str, float] = {}  # monotonic start of each one's current process

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
        self.started[name] = time.monotonic()
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


# ---- the answers known in advance ---------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    request: pb.GenerateRequest
    tokens: tuple[int, ...]


def random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))


def reference_requests(rng: random.Random, count: int) -> list[pb.GenerateRequest]:
    """Greedy requests, and every third one sampled with a seed (the seed fixes its tokens)."""
    out = []
    for i in range(count):
        sampling = pb.SamplingParams(
            max_tokens=rng.choice([8, 32, 64, 128]), ignore_eos=rng.random() < 0.5
        )
        if i % 3 == 2:
            sampling.temperature, sampling.seed = 0.8, rng.randrange(2**32)
        else:
            sampling.temperature = 0.0
        if rng.random() < 0.2:
            sampling.stop.extend(rng.sample(WORDS, 2))
        out.append(pb.GenerateRequest(text=random_text(rng), sampling=sampling))
    return out


async def learn_references(
    stub, requests: list[pb.GenerateRequest], concurrency: int = 16
) -> tuple[list[Reference], list[int]]:
    """Runs every request twice on the fresh server, before any fault (the second run reads
    the cache); returns the references and the indices whose two runs differed."""
    gate = asyncio.Semaphore(concurrency)

    async def run(req: pb.GenerateRequest) -> tuple[int, ...]:
        async with gate:
            tokens: list[int] = []
            async for msg in stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
                tokens.extend(msg.token_ids)
            return tuple(tokens)

    first = await asyncio.gather(*(run(r) for r in requests))
    second = await asyncio.gather(*(run(r) for r in requests))
    unstable = [i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    return [Reference(r, t) for r, t in zip(requests, first, strict=True)], unstable


# ---- the clients --------------------------------------------------------------------------

REQUEST_TIMEOUT_S = 120.0  # a client deadline hit means the server left a stream hanging
# With a message, these say what happened; a random request may ask for more than the model
# allows (INVALID_ARGUMENT naming the field is the right answer to it).
CLEAR_CODES = {"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED", "CANCELLED", "INVALID_ARGUMENT"}
DRIFT_WINDOW_S = 30.0


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # gRPC code name, or client-cancel
    messages: dict[str, str] = field(default_factory=dict)  # one example message per code
    references: Counter = field(default_factory=Counter)  # exact / wrong / the error code
    wrong: list[dict] = field(default_factory=list)  # the first few wrong answers
    unclear: Counter = field(default_factory=Counter)  # errors without a clear status
    issued: int = 0
    ended: int = 0
    ttft: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)  # when (monotonic)
    tokens: int = 0
    flushes: Counter = field(default_factory=Counter)
    outage: str = ""  # the service killed and not serving again yet ("" when none)

    def error(self, code: str, message: str, reference: bool) -> None:
        key = f"{code} (during {self.outage} outage)" if self.outage else code
        self.outcomes[key] += 1
        self.messages.setdefault(key, message[:200])
        if reference:
            self.references[code] += 1
        if code not in CLEAR_CODES or not message:
            self.unclear[code] += 1

    def answered(self, ref: Reference | None, got: list[int]) -> None:
        self.outcomes["OK"] += 1
        if ref is None:
            return
        exact = tuple(got) == ref.tokens
        self.references["exact" if exact else "wrong"] += 1
        if not exact and len(self.wrong) < 5:
            at = next(
                (i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b), None
            )
            self.wrong.append(
                {"text": ref.request.text[:60], "expected": len(ref.tokens), "got": len(got),
                 "first_difference": at, "outage": self.outage}
            )  # fmt: skip


async def one_request(
    stub, req: pb.GenerateRequest, cancel_after: int, tally: Tally, ref: Reference | None = None
) -> None:
    tally.issued += 1
    start = time.monotonic()
    call = stub.Generate(req, timeout=REQUEST_TIMEOUT_S)
    got: list[int] = []
    try:
        async for msg in call:
            if not got and msg.token_ids:
                now = time.monotonic()
                tally.ttft.append(now - start)
                tally.first_tokens.append(now)
            got.extend(msg.token_ids)
            if cancel_after and len(got) >= cancel_after:
                call.cancel()
                tally.outcomes["client-cancel"] += 1
                tally.ended += 1
                return
        tally.answered(ref, got)
        tally.ended += 1
    except grpc.aio.AioRpcError as e:
        tally.error(e.code().name, e.details() or "", ref is not None)
        tally.ended += 1
        await asyncio.sleep(0.2)  # do not spin on a server that is down
    except asyncio.CancelledError:
        if not call.cancelled():
            raise
    finally:
        tally.tokens += len(got)


def random_request(rng: random.Random) -> tuple[pb.GenerateRequest, int]:
    """A request of a random shape; returns it and after how many tokens to cancel (0: never)."""
    sampling = pb.SamplingParams(
        max_tokens=rng.choice([4, 16, 64, 128, 256]),
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0]),
        ignore_eos=rng.random() < 0.5,
    )
    if rng.random() < 0.2:
        sampling.stop.extend(rng.sample(WORDS, 2))
    cancel_after = rng.randint(1, 8) if rng.random() < 0.1 else 0
    return pb.GenerateRequest(text=random_text(rng), sampling=sampling), cancel_after


async def client_loop(
    stub, rng: random.Random, end: float, tally: Tally, refs: list[Reference], share: float
) -> None:
    while time.monotonic() < end:
        if refs and rng.random() < share:
            ref = rng.choice(refs)
            await one_request(stub, ref.request, 0, tally, ref)
        else:
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
    svc: Services, stub, end: float, ns: argparse.Namespace, tally: Tally
) -> list[dict]:
    """A kill every --kill-every seconds (uniform in the range, from the previous kill), each
    service once in a random order before any repeats; none in the last stretch of the run,
    so the last one recovers under load."""
    rng, order, out = random.Random(ns.seed + 1), [], []
    low, high = ns.kill_every
    next_kill = time.monotonic() + rng.uniform(low, high)
    while next_kill < end - low:
        await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
        order = order or rng.sample(KILL_ORDER, len(KILL_ORDER))
        out.append(await kill_and_recover(svc, stub, order.pop(), ns.restart_delay, tally))
        next_kill = max(next_kill + rng.uniform(low, high), time.monotonic())
    return out


# ---- resources ----------------------------------------------------------------------------


@dataclass
class Lifetime:
    """One process (a restart is a new one): (monotonic time, RSS bytes, open fds) samples."""

    service: str
    started: float
    samples: list[tuple[float, int, int]] = field(default_factory=list)


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None  # it just died


async def sample_resources(
    svc: Services, end: float, every_s: float, lifetimes: dict[int, Lifetime]
) -> None:
    while time.monotonic() < end:
        now = time.monotonic()
        for name, proc in list(svc.procs.items()):
            got = rss_and_fds(proc.pid) if proc.poll() is None else None
            if got is not None:
                life = lifetimes.setdefault(proc.pid, Lifetime(name, svc.started[name]))
                life.samples.append((now, *got))
        await asyncio.sleep(every_s)


def drift(life: Lifetime, load_start: float, warmup: float, window: float) -> dict | None:
    """Median of the last window against the first window after warm-up (the load's start
    or the process's, whichever is later); None when the lifetime is too short for both."""
    t0 = max(life.started, load_start) + warmup
    if not life.samples or life.samples[-1][0] - t0 < 2 * window:
        return None
    last_t = life.samples[-1][0]
    base = [s for s in life.samples if t0 <= s[0] < t0 + window]
    tail = [s for s in life.samples if s[0] >= last_t - window]

    def rel(i: int) -> float:
        b = float(np.median([s[i] for s in base]))
        return round(100 * (float(np.median([s[i] for s in tail])) - b) / b, 2)

    minutes: dict[int, list[int]] = {}
    for t, rss, _ in life.samples:
        minutes.setdefault(int((t - life.started) // 60), []).append(rss)
    return {
        "service": life.service,
        "span_s": round(last_t - t0, 1),
        "rss_mib_by_minute": [round(float(np.median(v)) / 2**20, 1) for v in minutes.values()],
        "rss_mib": round(float(np.median([s[1] for s in tail])) / 2**20, 1),
        "rss_drift_pct": rel(1),
        "fds": int(np.median([s[2] for s in tail])),
        "fd_drift_pct": rel(2),
    }


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
    tally, lifetimes = Tally(), {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        rng = random.Random(ns.seed)
        refs, unstable = await learn_references(stub, reference_requests(rng, ns.references))
        print(f"soak: {len(refs)} reference answers ({len(unstable)} unstable)", flush=True)
        start = time.monotonic()
        end = start + ns.minutes * 60
        clients = [
            client_loop(stub, random.Random(rng.random()), end, tally, refs, ns.reference_share)
            for _ in range(ns.streams)
        ]
        tasks = [
            *clients,
            flusher(stub, end, ns.flush_every, tally),
            sample_resources(svc, end, 5.0, lifetimes),
        ]
        faults = fault_schedule(svc, stub, end, ns, tally) if ns.kills else asyncio.sleep(0)
        results = await asyncio.gather(faults, *tasks)
    wall = time.monotonic() - start
    drifts = [
        d for life in lifetimes.values() if (d := drift(life, start, ns.warmup, DRIFT_WINDOW_S))
    ]
    rep = report(ns, tally, wall, results[0] or [], await pool_check(svc.control), svc.dead())
    rep["references"] = {"count": len(refs), "unstable_before_faults": unstable}
    rep["references"].update(dict(tally.references), wrong_examples=tally.wrong)
    rep["resources"] = drifts
    return rep


def report(ns, tally: Tally, wall: float, recoveries, pool, dead) -> dict[str, Any]:
    ttft = np.array(tally.ttft) * 1000 if tally.ttft else np.array([float("nan")])
    return {
        "config": {
            "streams": ns.streams,
            "minutes": ns.minutes,
            "kills": ns.kills,
            "kill_every_s": list(ns.kill_every),
            "max_total_tokens": ns.max_total_tokens,
            "device": ns.device,
        },
        "wall_s": round(wall, 1),
        "requests": tally.issued,
        "missing": tally.issued - tally.ended,
        "outcomes": dict(tally.outcomes.most_common()),
        "error_examples": tally.messages,
        "unclear_errors": dict(tally.unclear),
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


def verdict(rep: dict[str, Any], max_drift: float) -> list[str]:
    """What failed; empty when the run holds."""
    refs, bad = rep["references"], []
    if refs.get("wrong", 0) or refs["unstable_before_faults"]:
        bad.append(
            f"{refs.get('wrong', 0)} wrong answers, {len(refs['unstable_before_faults'])} unstable"
        )
    if rep["missing"]:
        bad.append(f"{rep['missing']} requests without an outcome")
    if rep["unclear_errors"]:
        bad.append(f"errors without a clear status: {rep['unclear_errors']}")
    if not rep["pool_at_end"]["ok"] or rep["processes_dead_at_end"]:
        bad.append("pool not whole or a process dead at the end")
    if any(r["first_token_s"] is None for r in rep["recoveries"]):
        bad.append("a service did not recover")
    worst = max(
        (max(abs(d["rss_drift_pct"]), abs(d["fd_drift_pct"])) for d in rep["resources"]),
        default=0.0,
    )
    if worst > max_drift:
        bad.append(f"RSS/fd drift {worst} % > {max_drift} %")
    return bad


def markdown(rep: dict[str, Any], bad: list[str]) -> str:
    """The one-page report."""
    c, refs = rep["config"], rep["references"]
    checked = {k: v for k, v in refs.items() if isinstance(v, int) and k != "count"}
    lines = [
        f"# Chaos soak: {c['streams']} streams x {c['minutes']:g} min, "
        f"kill -9 every {c['kill_every_s'][0]:g}-{c['kill_every_s'][1]:g} s",
        "",
        f"Verdict: **{'holds' if not bad else 'FAILS: ' + '; '.join(bad)}**",
        "",
        "| measure | figure |",
        "|---|---|",
        f"| requests | {rep['requests']:,} ({rep['missing']} missing an outcome) |",
        f"| outcomes | {', '.join(f'{k}: {v:,}' for k, v in rep['outcomes'].items())} |",
        f"| reference answers ({refs['count']} known before the faults) | "
        f"{', '.join(f'{k}: {v:,}' for k, v in checked.items())} |",
        f"| errors without a clear status | {rep['unclear_errors'] or 'none'} |",
        f"| output tokens | {rep['output_tokens']:,} |",
        f"| TTFT p50 / p99 (ms) | {rep['ttft_ms']['p50']:,} / {rep['ttft_ms']['p99']:,} |",
        f"| FlushCache | {rep['flushes']} |",
        f"| pool at the end | {rep['pool_at_end']} |",
        "",
        "| kill -9 | ready again (s) | first token (s) |",
        "|---|---:|---:|",
        *(f"| {r['service']} | {r['ready_s']} | {r['first_token_s']} |" for r in rep["recoveries"]),
        "",
        "| process lifetime | span (s) | RSS (MiB) | RSS drift | fds | fd drift |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {d['service']} | {d['span_s']} | {d['rss_mib']} | {d['rss_drift_pct']} % | "
            f"{d['fds']} | {d['fd_drift_pct']} % |"
            for d in rep["resources"]
        ),
    ]
    return "\n".join(lines) + "\n"


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
    p.add_argument(
        "--kill-every", type=float, nargs=2, default=(30.0, 90.0), metavar=("LOW", "HIGH"),
        help="seconds between kills, uniform in [LOW, HIGH]",
    )  # fmt: skip
    p.add_argument("--no-kills", dest="kills", action="store_false", help="load only")
    p.add_argument("--references", type=int, default=48, help="requests with known answers")
    p.add_argument(
        "--reference-share", type=float, default=0.5, help="share of requests that are references"
    )
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before drift is measured")
    p.add_argument("--max-drift", type=float, default=5.0, help="RSS / fd drift allowed, percent")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="", help="also write the report here")
    p.add_argument("--report-md", default="", help="write the one-page report here")
    ns = p.parse_args(argv)
    if not 1 <= ns.streams <= MAX_STREAMS:
        p.error(f"--streams must be in [1, {MAX_STREAMS}], got {ns.streams}")
    if not 0 < ns.minutes <= MAX_MINUTES:
        p.error(f"--minutes must be in (0, {MAX_MINUTES:g}], got {ns.minutes}")
    if not 0 < ns.kill_every[0] <= ns.kill_every[1]:
        p.error(f"--kill-every needs 0 < LOW <= HIGH, got {ns.kill_every}")
    if not 0 <= ns.reference_share <= 1:
        p.error(f"--reference-share must be in [0, 1], got {ns.reference_share}")
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
    bad = verdict(rep, ns.max_drift)
    rep["verdict"] = bad or "holds"
    text = json.dumps(rep, indent=2)
    print(text)
    if ns.json_out:
        Path(ns.json_out).write_text(text + "\n")
    if ns.report_md:
        Path(ns.report_md).write_text(markdown(rep, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
