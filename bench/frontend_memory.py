"""Frontend memory per request: is anything kept after a request ends? Not a test.

The real frontend (FrontendServer, gRPC only) runs in this process; a child process runs a
scripted scheduler (tests/fake_scheduler.py, no model) and the clients, so everything
measured here is the frontend's. The clients send streaming Generate requests of mixed
kinds (KINDS; ``--only`` picks some), 64 at a time: plain, stop strings (also inside
multi-token deltas), logprobs, n > 1, client cancels (after a few tokens, mid-stream of
one that never ends, and before the first token), client deadlines, engine refusals,
invalid requests and duplicate request ids, with FlushCache every 2 s. Prompts are 3-120
random words, so (as bench/soak.py's random ones) no two share a prefix.

After ``--warmup`` requests and then after each of ``--phases`` phases of ``--requests``
more, once the frontend is idle (no request in flight) and after a gc: a tracemalloc
snapshot of the frontend's blocks (this script's own are filtered out), glibc's malloc in
use (mallinfo2, less tracemalloc's own tables: the C allocations tracemalloc cannot see,
grpc core, ZeroMQ, protobuf's upb arenas), pymalloc's block count, RSS, gc-tracked objects
by type, the loop's asyncio tasks and the frontend's own per-request and routing tables.
It prints the growth per request of each phase, then from the first snapshot to the last:
the allocation sites that grew most, the types whose count grew, and the tables.
tracemalloc's tables grow while it runs (every distinct traceback is kept), so RSS means
something only with ``--frames 0`` (no tracemalloc; malloc and pymalloc blocks still
measured).

The engine's cache-event geometry is set by hand (``--block-tokens``; the fake scheduler
publishes no events) so the cache-aware routing tables fill as against a real scheduler,
and their bounds are made small so that they are full after the warm-up: the hot-prefix
table (hot_prefixes.py) holds at most 2 x ``--hot-max-keys`` keys (the frontend's 50k,
about 95 bytes a key, take ~35k requests of bench/soak.py's mix to fill: its ~9 MiB rise),
a sent prompt's keys stay pending for ``--pending-ttl`` s (the frontend's 5 s).

Exit status 1 when the frontend's Python heap (tracemalloc) grows more than
``--max-bytes-per-request`` per request from the first snapshot to the last. The default,
64 bytes, is under the smallest per-request leak (one 32-hex request id kept in a set: its
81-byte str and a slot: 117-187 bytes a request measured with such a leak planted, the set's
table doubling on top) and well over a leak-free run (1-5 bytes a request: a dict's table
resized, freelists).

    .venv/bin/python bench/frontend_memory.py                      # ~2.5 min on 2 cores
    .venv/bin/python bench/frontend_memory.py --only cancel,"cancel slow" --frames 12
    .venv/bin/python bench/frontend_memory.py --frames 0 --phases 8 --hot-max-keys 50000
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter, deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONCURRENCY = 64
# The kinds of request and their shares (percent).
KINDS = {
    "plain": 48, "stop": 15, "multi-token stop": 5, "logprobs": 5, "n>1": 5, "cancel": 5,
    "cancel slow": 5, "cancel at once": 2, "deadline": 3, "engine refusal": 3, "invalid": 2,
    "duplicate id": 2,
}  # fmt: skip


# ---- the child: fake scheduler and clients ------------------------------------------------


def _words() -> list[str]:
    from tests.fake_scheduler import CORPUS

    return sorted({w for line in CORPUS for w in line.replace(",", " ").split()})


async def _drive(
    stub, count: int, seed: int, max_tokens: int, kinds: list[str], words: list[str]
) -> dict[str, Any]:
    import grpc

    from radixserve.v1 import generation_pb2 as pb

    rng = random.Random(seed)
    names = [k for k in KINDS if k in kinds]
    weights = [KINDS[k] for k in names]
    outcomes: Counter = Counter()
    todo = iter(range(count))

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(3, 120)))

    async def stream(stub, req, cancel_after: int = 0, timeout: float = 30.0) -> str:
        """How the call ended: its finish_reason, its gRPC code, or the client's cancel."""
        call = stub.Generate(req, timeout=timeout)
        got, finish = 0, "none"
        try:
            if cancel_after < 0:  # before the first token
                await asyncio.sleep(0)
                call.cancel()
                return "cancelled"
            async for msg in call:
                got += len(msg.token_ids)
                finish = msg.finish_reason or finish
                if cancel_after and got >= cancel_after:
                    call.cancel()
                    return "cancelled"
            return finish
        except grpc.aio.AioRpcError as e:
            return e.code().name
        except asyncio.CancelledError:
            if call.cancelled():
                return "cancelled"
            raise

    async def one(stub, i: int) -> str:
        """One request of a random kind; returns "kind: how it ended"."""
        sp = pb.SamplingParams(
            max_tokens=rng.randint(1, max_tokens), temperature=rng.choice([0.0, 0.7, 1.0])
        )
        req = pb.GenerateRequest(text=text(), sampling=sp)
        sp = req.sampling  # the constructor copied it: change the request's own
        kind = rng.choices(names, weights)[0]
        cancel_after, timeout = 0, 30.0
        if kind == "stop":
            sp.stop.extend(rng.choice([["STOP"], ["wörld"], rng.sample(words, 2)]))
        elif kind == "multi-token stop":  # several tokens per delta, a stop inside one
            req.cache_salt, sp.max_tokens = "multi:3", 40
            sp.stop.append(rng.choice(["STOP", "wörld"]))
        elif kind == "logprobs":
            sp.logprobs, sp.top_logprobs = True, 2
        elif kind == "n>1":
            req.n = rng.randint(2, 3)
        elif kind == "cancel":
            cancel_after = rng.randint(1, 8)
        elif kind == "cancel slow":  # cancelled mid-stream of one that would never end
            req.cache_salt, cancel_after = "slow", rng.randint(1, 4)
        elif kind == "cancel at once":
            cancel_after = -1
        elif kind == "deadline":  # the client's deadline passes
            req.cache_salt, timeout = "slow", 0.15
        elif kind == "engine refusal":
            req.cache_salt = "error:RESOURCE_EXHAUSTED"
        elif kind == "invalid":
            sp.max_tokens = 10**6
        elif kind == "duplicate id":  # the same request_id twice at once: ALREADY_EXISTS
            req.request_id, req.cache_salt = f"dup-{seed}-{i}", "slow"
            first = asyncio.create_task(stream(stub, req, cancel_after=2))
            await asyncio.sleep(0.02)
            second = await stream(stub, req)
            return f"{kind}: {await first}+{second}"
        return f"{kind}: {await stream(stub, req, cancel_after, timeout)}"

    async def client(stub) -> None:
        for i in todo:
            outcomes[await one(stub, i)] += 1

    async def flusher(stub, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(2.0)
            await stub.FlushCache(pb.FlushCacheRequest(), timeout=5)
            outcomes["FlushCache"] += 1

    stop = asyncio.Event()
    flush = asyncio.create_task(flusher(stub, stop))
    t0 = time.monotonic()
    await asyncio.gather(*(client(stub) for _ in range(CONCURRENCY)))
    stop.set()
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)
    return {"outcomes": dict(sorted(outcomes.items())), "seconds": round(time.monotonic() - t0, 1)}


async def _serve_commands(target: str, words: list[str]) -> None:
    """``run COUNT SEED MAX_TOKENS KIND,KIND...`` lines on stdin, each answered with its
    outcomes; one loop and one channel for all of them (grpc.aio does not like a new loop
    per phase)."""
    import grpc

    from radixserve.v1 import generation_pb2_grpc

    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while cmd := (await loop.run_in_executor(None, sys.stdin.readline)).split():
            if cmd[0] != "run":
                break
            count, seed, max_tokens = map(int, cmd[1:4])
            kinds = cmd[4].replace("_", " ").split(",")
            out = await _drive(stub, count, seed, max_tokens, kinds, words)
            print(json.dumps(out), flush=True)


def child_main(tok_path: str) -> None:
    from services.frontend.tokenizer import Tokenizer
    from tests.fake_scheduler import SCRIPT_TEXT, FakeScheduler

    tok = Tokenizer(tok_path)
    fake = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size, max_model_len=1024)
    fake.requests, fake.aborts = deque(maxlen=16), deque(maxlen=16)  # not kept for ever
    fake.start()
    print(json.dumps({"addr": fake.addr, "control": fake.control_addr}), flush=True)
    target = sys.stdin.readline().split()[1]  # "target HOST:PORT", once the frontend runs
    try:
        asyncio.run(_serve_commands(target, _words()))
    finally:
        fake.stop()


# ---- the parent: the frontend, measured ---------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc), or -1."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return -1
    return info.uordblks + info.hblkhd


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def type_counts() -> Counter:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


class Child:
    def __init__(self, tok_path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", tok_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.hello = self._read()

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the child (fake scheduler and clients) died")
        return json.loads(line)

    def ask(self, *words: object) -> dict[str, Any]:
        self.send(*words)
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def frontend_tables(fe) -> dict[str, int]:
    """The frontend's per-request and routing tables, and the loop's tasks (on its loop)."""

    async def read() -> dict[str, int]:
        engines = fe.server.engines
        out = {
            "asyncio tasks": len(asyncio.all_tasks()),
            "engine requests": len(engines._requests),
            "engine closers": len(engines._closers),
            "hot prefix keys": len(engines._hot._new) + len(engines._hot._old),
            "key-limit keys": len(fe.server.key_limits._held),
        }
        for e in engines._engines.values():
            out[f"engine {e.name} rids"] = len(e.rids) + len(e.sent_since)
            out[f"engine {e.name} pending keys"] = len(e.index._pending)
            out[f"engine {e.name} sent batches"] = len(e.index._sent)
        return out

    return asyncio.run_coroutine_threadsafe(read(), fe.loop).result(10)


def wait_idle(fe, pending_ttl_s: float, timeout_s: float = 30.0) -> None:
    """Until no request is in flight, and the keys sent are no longer pending (their TTL)."""
    deadline = time.monotonic() + timeout_s
    while frontend_tables(fe)["engine requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(pending_ttl_s + 0.5)  # grpc's teardown of the last calls, too

    async def expire() -> None:
        for e in fe.server.engines._engines.values():
            assert e.index.pending == 0  # reading it drops the expired ones

    asyncio.run_coroutine_threadsafe(expire(), fe.loop).result(10)


def set_geometry(fe, block_tokens: int, hot_max_keys: int, pending_ttl_s: float) -> None:
    """What a real scheduler's cache events would tell (fake ones publish none), and the
    bounded tables' bounds made small, so that they are full after the warm-up."""

    async def go() -> None:
        engines = fe.server.engines
        engines._hot.max_keys = hot_max_keys
        for e in engines._engines.values():
            e.index.replace(block_tokens, b"bench-seed-0000", b"")
            e.index._ttl = pending_ttl_s

    asyncio.run_coroutine_threadsafe(go(), fe.loop).result(10)


def frontend_snapshot() -> tracemalloc.Snapshot:
    """The heap less this script's own blocks (its snapshots, counts, the tables' reads)."""
    mine = [
        tracemalloc.Filter(False, tracemalloc.__file__, all_frames=True),
        tracemalloc.Filter(False, __file__, all_frames=True),
    ]
    return tracemalloc.take_snapshot().filter_traces(mine)


def measure(fe, dump_to: Path | None, pending_ttl_s: float) -> dict[str, Any]:
    """The heap now; the snapshot goes to a file (kept alive, it would count in the next).
    malloc leaves out tracemalloc's own tables (they only grow while it runs)."""
    wait_idle(fe, pending_ttl_s)
    tables = frontend_tables(fe)
    gc.collect()
    types = type_counts()
    out = {
        "snapshot": dump_to,
        "traced": 0,
        "blocks": sys.getallocatedblocks(),
        "malloc": malloc_in_use() - tracemalloc.get_tracemalloc_memory(),
        "rss": rss(),
        "types": types,
        "tables": tables,
    }
    if dump_to is not None:
        snapshot = frontend_snapshot()
        snapshot.dump(str(dump_to))
        out["traced"] = sum(t.size for t in snapshot.traces)
    return out


def _site(stat, depth: int = 5) -> str:
    """Where a block was allocated, the most recent frame first."""
    frames = list(stat.traceback)[::-1][:depth]  # tracemalloc keeps them oldest first
    return " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in frames)


def _short(path: str) -> str:
    if path.startswith(str(REPO)):
        return os.path.relpath(path, REPO)
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return "/".join(parts[-2:])


def report(first: dict[str, Any], last: dict[str, Any], n: int, top: int) -> float:
    def per(key: str) -> float:
        return (last[key] - first[key]) / n

    print(f"\ngrowth over {n} requests after the warm-up:")
    for key, label in (("traced", "python heap (tracemalloc)"), ("malloc", "malloc in use"),
                       ("rss", "RSS")):  # fmt: skip
        if key == "traced" and first["snapshot"] is None:
            continue
        print(
            f"  {label:28s} {first[key] / 2**20:8.2f} -> {last[key] / 2**20:8.2f} MiB"
            f"  {per(key):+8.1f} B/request"
        )
    print(f"  {'pymalloc blocks':28s} {first['blocks']:8d} -> {last['blocks']:8d}"
          f"      {per('blocks'):+8.3f} /request")  # fmt: skip
    if first["snapshot"] is not None:
        print(f"\ntop {top} growing allocation sites (tracemalloc, most recent frame first):")
        before = tracemalloc.Snapshot.load(str(first["snapshot"]))
        stats = tracemalloc.Snapshot.load(str(last["snapshot"])).compare_to(before, "traceback")
        for stat in stats[:top]:
            print(
                f"  {stat.size_diff:+10d} B {stat.count_diff:+7d} blocks "
                f"({stat.size_diff / n:+7.1f} B/req)  {_site(stat)}"
            )
    grown = [(t, c - first["types"].get(t, 0)) for t, c in last["types"].items()]
    grown = sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:top]
    print("\ngc-tracked objects that grew, by type:")
    for name, diff in grown:
        print(f"  {diff:+8d}  ({diff / n:+.4f}/req)  {name}")
    if not grown:
        print("  none")
    print("\nfrontend tables (after the warm-up -> at the end):")
    for key, value in last["tables"].items():
        print(f"  {key:40s} {first['tables'].get(key, '-')!s:>8} -> {value}")
    return per("traced")


def parent_main(ns: argparse.Namespace) -> int:
    from services.common.config import FrontendConfig
    from tests.fake_scheduler import FrontendThread, build_tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="frontend-memory-")
    tok_path = build_tokenizer(Path(tmp.name))
    child = Child(str(tok_path))
    cfg = FrontendConfig(
        model_path=str(tok_path),
        served_model_name="tiny",
        port=0,
        http_port=-1,
        scheduler_addrs=[child.hello["addr"]],
        scheduler_control_addrs=[child.hello["control"]],
    )
    fe = FrontendThread(cfg).start()
    deadline = time.monotonic() + 20
    while not fe.server.engines.ready:
        assert time.monotonic() < deadline, "the frontend did not become ready"
        time.sleep(0.05)
    if ns.block_tokens:
        set_geometry(fe, ns.block_tokens, ns.hot_max_keys, ns.pending_ttl)
    child.send("target", fe.grpc_target)
    kinds = ",".join(ns.only or KINDS).replace(" ", "_")
    if ns.frames:
        tracemalloc.start(ns.frames)
    try:
        t0 = time.monotonic()
        out = child.ask("run", ns.warmup, 0, ns.max_tokens, kinds)
        print(f"warm-up: {ns.warmup} requests in {out['seconds']} s: {out['outcomes']}")

        def dump(i: int) -> Path | None:
            return Path(tmp.name) / f"snapshot-{i}" if ns.frames else None

        first = snap = measure(fe, dump(0), ns.pending_ttl)
        for phase in range(1, ns.phases + 1):
            out = child.ask("run", ns.requests, phase, ns.max_tokens, kinds)
            prev, snap = snap, measure(fe, dump(phase), ns.pending_ttl)
            heap = (snap["traced"] - prev["traced"]) / ns.requests
            print(
                f"phase {phase}: {ns.requests} requests in {out['seconds']} s, "
                + (f"python heap {heap:+.1f} B/req, " if ns.frames else "")
                + "pymalloc "
                f"{(snap['blocks'] - prev['blocks']) / ns.requests:+.3f} blocks/req, malloc "
                f"{(snap['malloc'] - prev['malloc']) / ns.requests:+.1f} B/req, RSS "
                f"{(snap['rss'] - prev['rss']) / ns.requests:+.1f} B/req, hot prefix keys "
                f"{snap['tables']['hot prefix keys']}: {out['outcomes']}"
            )
        growth = report(first, snap, ns.requests * ns.phases, ns.top)
        print(f"\nwall {time.monotonic() - t0:.0f} s")
    finally:
        tracemalloc.stop()
        fe.stop()
        child.close()
        tmp.cleanup()
    if not ns.frames:
        print("\nno verdict without tracemalloc (--frames 0)")
        return 0
    if growth > ns.max_bytes_per_request:
        print(
            f"\nFAIL: the python heap grows {growth:.1f} B per request after the warm-up "
            f"(limit {ns.max_bytes_per_request:g})"
        )
        return 1
    print(f"\nOK: {growth:.1f} B per request (limit {ns.max_bytes_per_request:g})")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=1500, help="requests before the first snapshot")
    p.add_argument("--requests", type=int, default=2000, help="requests per measured phase")
    p.add_argument("--phases", type=int, default=2)
    p.add_argument(
        "--frames",
        type=int,
        default=8,
        help="tracemalloc frames kept per block (0: no tracemalloc)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="each asks for 1 to this many")
    p.add_argument(
        "--only", type=lambda v: v.split(","), help=f"these kinds only, of: {', '.join(KINDS)}"
    )
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--block-tokens", type=int, default=16, help="0: no cache-aware geometry")
    p.add_argument("--hot-max-keys", type=int, default=256)
    p.add_argument("--pending-ttl", type=float, default=1.0, help="seconds a sent key counts")
    p.add_argument("--max-bytes-per-request", type=float, default=64.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.child:
        child_main(ns.child)
        return 0
    return parent_main(ns)


if __name__ == "__main__":
    sys.exit(main())
