"""The frontend's side of the engines: a pool of replicas that follows discovery and health.

Per engine replica: one ZeroMQ DEALER to its scheduler (a background task hands every
TokenDelta to the asyncio queue of its request, by rid) and a gRPC control stub. Two loops
keep the pool true to the world:

- discovery (engine_discovery.py): a replica that appears is connected and probed; one that
  disappears drains (no new requests; it is closed once its requests end);
- health: every replica is asked GetStats every HEALTH_INTERVAL_S. One that refuses the
  connection (or misses MISSES_TO_DOWN answers in a row) is down at once: its requests that
  already streamed tokens fail fast with UNAVAILABLE, those still waiting for their first
  token are sent to another replica whole, and new requests go elsewhere. Its socket is
  replaced, so nothing queued for it is delivered late; when it answers again it serves again.

Routing (router.py, ``--routing-policy``) is cache-aware and load-aware. An engine's load is
the running + waiting requests it counted last (every frontend's: its cache events carry
the count, else GetStats) plus what this frontend sent it since, never less than this
frontend's own requests there. With cache_aware, each engine that reports a
``cache_events_port`` is followed (cache_events.py) into a CacheIndex of the blocks its tree
holds, so a prompt goes where most of it is already cached; the index also holds what this
frontend sent the engine in the last few seconds, until the events confirm it, and
hot_prefixes.py tells which prefixes count as held everywhere.

The frontend is ready while at least one replica serves (readiness); it stays alive
regardless (liveness is the process itself, see main.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
import zmq
import zmq.asyncio

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import transport
from services.common.bearer import aio_channel
from services.common.curve import InternalKeys, connect_securely
from services.common.grpc_util import DRAINING, MAX_MESSAGE_BYTES
from services.common.hostport import tcp_addr
from services.common.tls import ClientTls
from services.frontend.cache_events import (
    EVENTS_SILENT_S,
    SNAPSHOT_TIMEOUT_S,
    CacheSubscriber,
    host_of,
)
from services.frontend.cache_index import CacheIndex, PromptKeys
from services.frontend.engine_discovery import Endpoint, Resolver
from services.frontend.hot_prefixes import HotPrefixes
from services.frontend.metrics import RoutingMetrics
from services.frontend.router import Router, RoutingParams, prefix_key, ranking

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # while no engine serves
HEALTH_INTERVAL_S = 1.0  # once one does: how fast a dead engine is noticed
CONTROL_TIMEOUT_S = 2.0
MISSES_TO_DOWN = 3  # unanswered probes (timeouts) before a replica counts as down
# A cache snapshot holds 16 bytes per block the tree holds: allow one as large as the
# servers allow any message (1M blocks), not grpc's 4 MB client default.
CONTROL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class DuplicateRequestError(KeyError):
    """A request with this id is already in flight."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engines told us (the first serving replica's worker speaks for all of them)."""

    worker: engine_pb2.WorkerInfo
    page_size: int
    max_total_num_tokens: int
    max_model_len: int
    num_engines: int


def route(cache_salt: str, input_ids: Sequence[int], num_engines: int) -> int:
    """The replica (by index) a prefix prefers when no engine is loaded and none holds it:
    prefix_hash's first pick, and cache_aware's fallback."""
    names = [str(i) for i in range(num_engines)]
    return int(ranking(prefix_key(cache_salt, input_ids), names)[0])


class _Engine:
    """One replica as this frontend sees it."""

    def __init__(
        self, ep: Endpoint, control_token: str = "", control_tls: ClientTls | None = None
    ) -> None:
        self.ep = ep
        self.sock: zmq.asyncio.Socket | None = None
        self.receiver: asyncio.Task | None = None
        addr = ep.control_addr
        self.channel = None
        if addr:
            creds = control_tls.credentials if control_tls else None
            options = [*CONTROL_OPTIONS, *(control_tls.options if control_tls else ())]
            self.channel = aio_channel(addr, control_token, options, creds)
        self.stub = engine_pb2_grpc.SchedulerControlStub(self.channel) if self.channel else None
        self.serving = self.stub is None  # nothing to ask: trust the configuration
        self.draining = False  # gone from discovery: finishes its requests, takes no new ones
        self.stopping = False  # said it drains after SIGTERM: the same, until it answers again
        self.stats: engine_pb2.SchedulerStats | None = None
        self.misses = 0
        self.rids: set[str] = set()
        # The engine's own count of its requests (its cache events, else GetStats), and
        # ours sent to it since: those may not have reached it when it counted.
        self.reported = 0
        self.sent_since: set[str] = set()
        self.events_load_at = -math.inf
        self.index = CacheIndex()  # what its tree holds, by its CacheEvents
        self.events: CacheSubscriber | None = None
        self.events_port = 0  # the port ``events`` follows (0: none)

    @property
    def name(self) -> str:
        return self.ep.name

    @property
    def routable(self) -> bool:
        return self.serving and not (self.draining or self.stopping) and self.sock is not None

    @property
    def load(self) -> int:
        """Running + waiting requests, from every frontend (the engine's count) and ours."""
        return max(len(self.rids), self.reported + len(self.sent_since))

    def on_reported(self, load: int, from_events: bool) -> None:
        """The engine counted its requests; GetStats only counts while events are silent
        (a probe answers up to a second late, the events a step after a change)."""
        now = time.monotonic()
        if from_events:
            self.events_load_at = now
        elif now - self.events_load_at < EVENTS_SILENT_S:
            return
        self.reported = load
        self.sent_since.clear()

    def sent(self, rid: str) -> None:
        self.rids.add(rid)
        self.sent_since.add(rid)

    def done(self, rid: str) -> None:
        self.rids.discard(rid)
        self.sent_since.discard(rid)


@dataclass
class _Pending:
    """A request in flight, kept whole until its first token so it can move to another engine."""

    req: engine_pb2.TokenizedRequest
    key: bytes
    prompt: PromptKeys
    queue: asyncio.Queue[engine_pb2.TokenDelta]
    engine: _Engine | None = None
    answered: bool = False
    pin: str | None = None  # the replica it must go to while that one takes requests


class EngineClient:
    def __init__(
        self,
        resolver: Resolver,
        max_model_len: int = 0,
        on_health: Callable[[bool], Awaitable[None]] | None = None,
        routing: RoutingParams | None = None,
        keys: InternalKeys | None = None,
        metrics: RoutingMetrics | None = None,
        control_tls: ClientTls | None = None,
    ) -> None:
        """``keys``: the internal links' CURVE keys and control token (services/common/curve.py);
        ``control_tls``: TLS of the control gRPC (None: plaintext)."""
        self._resolver = resolver
        self._control_tls = control_tls
        self._zmq_setup = connect_securely(keys, "frontend", "scheduler")
        self._control_token = keys.control_token() if keys else ""
        self._max_model_len = max_model_len
        self._on_health = on_health
        self._router = Router(routing)
        self._hot = HotPrefixes(self._router.params.hot_prefix_forks)
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._name = f"frontend-{uuid.uuid4().hex[:12]}"
        self._sockets_made = 0
        self._engines: dict[str, _Engine] = {}  # by ZeroMQ address
        self._requests: dict[str, _Pending] = {}
        self._tasks: list[asyncio.Task] = []
        self._closers: set[asyncio.Task] = set()
        self._closing = False
        self.info: EngineInfo | None = None
        self.healthy = False

    @property
    def num_engines(self) -> int:
        """Replicas taking requests now."""
        return sum(e.routable for e in self._engines.values())

    @property
    def ready(self) -> bool:
        """At least one engine serves (new requests are refused otherwise)."""
        return self.healthy and self.info is not None

    def loads(self) -> dict[str, int]:
        """Load of every replica taking requests, by name."""
        return {e.name: e.load for e in self._engines.values() if e.routable}

    async def start(self) -> None:
        # Resolve once before serving, so a static list is connected at once.
        await self._reconcile(await self._resolver.resolve())
        self._tasks = [
            asyncio.create_task(self._discover()),
            asyncio.create_task(self._watch_engines()),
        ]

    async def close(self) -> None:
        self._closing = True  # what is in flight now fails; nothing moves to another engine
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in list(self._engines.values()):
            await self._remove(engine)
        self._ctx.term()

    # ---- requests ----------------------------------------------------------------

    def submit(
        self, req: engine_pb2.TokenizedRequest, input_ids: Sequence[int], pin: str | None = None
    ) -> asyncio.Queue[engine_pb2.TokenDelta]:
        """Sends the request to its engine; returns the queue its TokenDeltas arrive on.
        ``pin``: the replica (by name) to send it to, bypassing routing while that one takes
        requests (the samples of a prompt follow its prefill: parallel_sampling.py)."""
        if req.rid in self._requests:
            raise DuplicateRequestError(req.rid)
        queue: asyncio.Queue[engine_pb2.TokenDelta] = asyncio.Queue()
        # The ids as the scheduler gets them (its tree's keys hash exactly these).
        prompt = PromptKeys(req.cache_salt, transport.unpack_i32(req.input_ids))
        key = prefix_key(req.cache_salt, input_ids)
        pending = _Pending(req, key, prompt, queue, pin=pin)
        self._requests[req.rid] = pending
        self._dispatch(pending)
        return queue

    def abort(self, rid: str, reason: str) -> None:
        """Tells the request's scheduler to stop it now (no waiting: also called on cancel)."""
        pending = self._requests.get(rid)
        if pending is not None and pending.engine is not None:
            abort = engine_pb2.AbortRequest(rid=rid, reason=reason)
            self._send(pending.engine, engine_pb2.FrontendToScheduler(abort=abort))

    def engine_of(self, rid: str) -> str | None:
        """The replica a request in flight was sent to (None if unknown or not sent)."""
        pending = self._requests.get(rid)
        return pending.engine.name if pending is not None and pending.engine else None

    def in_flight(self) -> list[str]:
        """The rids submitted and not released yet (SGLang's /abort_request looks in them)."""
        return list(self._requests)

    def release(self, rid: str) -> None:
        """Forgets a finished request; later deltas for it are dropped."""
        pending = self._requests.pop(rid, None)
        if pending is not None and pending.engine is not None:
            engine = pending.engine
            engine.done(rid)
            if engine.draining and not engine.rids:  # its last request: close it now
                task = asyncio.get_running_loop().create_task(self._remove(engine))
                self._closers.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._closers.discard)

    def _dispatch(self, pending: _Pending) -> None:
        engines = {e.name: e for e in self._engines.values() if e.routable}
        if not engines:
            self._fail(pending, "no engine is serving; retry shortly")
            return
        if pending.pin in engines:
            self._send_to(engines[pending.pin], pending)
            return
        loads = {name: e.load for name, e in engines.items()}
        blocks = self._hot_blocks(engines.values(), pending.prompt)
        decision = self._router.choose(
            pending.key,
            loads,
            lambda name: engines[name].index.match_prompt(pending.prompt),
            blocks[0],
        )
        engine = engines[decision.engine]
        if self._router.params.cache_aware:
            engine.index.note_sent(pending.prompt)  # holds it soon: the next of a burst follows
            self._hot.note(blocks[1])
        if self._metrics is not None:
            self._metrics.on_decision(decision.branch)
        self._send_to(engine, pending)

    def _send_to(self, engine: _Engine, pending: _Pending) -> None:
        pending.engine = engine
        engine.sent(pending.req.rid)
        self._send(engine, engine_pb2.FrontendToScheduler(generate=pending.req))

    def _hot_blocks(
        self, engines: Iterable[_Engine], prompt: PromptKeys
    ) -> tuple[int, list[bytes]]:
        """Tokens of the prompt's hot prefix, and its block keys in the engines' geometry
        (that of the first with one: one model's engines share it)."""
        index = next((e.index for e in engines if e.index.block_tokens), None)
        if index is None or not self._router.params.cache_aware:
            return 0, []
        keys = prompt.keys(index.seed, index.block_tokens)
        return self._hot.hot_blocks(keys) * index.block_tokens, keys

    def _fail(self, pending: _Pending, message: str) -> None:
        pending.engine = None
        error = engine_pb2.TokenDelta(
            rid=pending.req.rid, finish_reason="abort", error_code="UNAVAILABLE"
        )
        error.finish_message = message
        pending.queue.put_nowait(error)

    def _send(self, engine: _Engine, msg: engine_pb2.FrontendToScheduler) -> None:
        if engine.sock is None:
            return
        # With unbounded HWM the send completes at once; the future only reports errors.
        fut = transport.send(engine.sock, msg)
        fut.add_done_callback(_log_send_error)

    async def _receive(self, engine: _Engine, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await transport.arecv(sock, engine_pb2.SchedulerToFrontend)
            for delta in msg.outputs:
                pending = self._requests.get(delta.rid)
                # Only the engine the request is on now: one it left may still be talking.
                if pending is not None and pending.engine is engine:
                    pending.answered = True
                    pending.queue.put_nowait(delta)

    # ---- the pool ------------------------------------------------------------------

    def _connect(self, engine: _Engine) -> None:
        """A fresh socket: whatever the old one still queued for a dead peer is dropped."""
        self._disconnect(engine)
        # A new identity each time: the scheduler may not have dropped the old connection yet,
        # and a ROUTER ignores a peer whose identity is still in use.
        self._sockets_made += 1
        identity = f"{self._name}-{self._sockets_made}".encode()
        sock = transport.dealer(
            self._ctx, engine.ep.zmq_addr, identity=identity, setup=self._zmq_setup
        )
        assert isinstance(sock, zmq.asyncio.Socket)  # an asyncio context makes asyncio sockets
        engine.sock = sock
        engine.receiver = asyncio.get_running_loop().create_task(self._receive(engine, sock))

    def _disconnect(self, engine: _Engine) -> None:
        if engine.receiver is not None:
            engine.receiver.cancel()
            engine.receiver = None
        if engine.sock is not None:
            engine.sock.close(linger=0)
            engine.sock = None

    async def _remove(self, engine: _Engine) -> None:
        if self._engines.get(engine.ep.zmq_addr) is not engine:
            return
        del self._engines[engine.ep.zmq_addr]
        self._lose(engine, f"engine {engine.name} left the pool")
        self._disconnect(engine)
        self._stop_events(engine)
        if self._metrics is not None:
            self._metrics.untrack_index(engine.name)
        if engine.channel is not None:
            await engine.channel.close()
        log.info("engine %s removed (%d serving)", engine.name, self.num_engines)

    def _lose(self, engine: _Engine, message: str) -> None:
        """The engine cannot finish its requests: move the unstarted ones, fail the others."""
        for rid in sorted(engine.rids):
            pending = self._requests.get(rid)
            if pending is None:
                continue
            if pending.answered or self._closing:
                self._fail(pending, message)
            else:
                pending.engine = None
                self._dispatch(pending)
        engine.rids.clear()
        engine.sent_since.clear()

    async def _reconcile(self, endpoints: list[Endpoint] | None) -> None:
        if endpoints is None:  # the lookup failed: keep what we have
            return
        wanted = {ep.zmq_addr: ep for ep in endpoints}
        for addr, ep in wanted.items():
            engine = self._engines.get(addr)
            if engine is None:
                engine = self._engines[addr] = _Engine(ep, self._control_token, self._control_tls)
                self._connect(engine)
                if self._metrics is not None:
                    self._metrics.track_index(engine.name, engine.index)
                log.info("engine %s joined (%s)", ep.name, ep.zmq_addr)
            elif engine.draining:
                engine.draining = False
                log.info("engine %s is back", ep.name)
        for addr, engine in list(self._engines.items()):
            if addr not in wanted and not engine.draining:
                engine.draining = True
                log.info(
                    "engine %s left discovery: draining %d requests", engine.name, len(engine.rids)
                )
                if not engine.rids:
                    await self._remove(engine)
        await self._refresh()

    async def _discover(self) -> None:
        interval = self._resolver.interval_s
        while interval is not None:
            await asyncio.sleep(interval)
            await self._reconcile(await self._resolver.resolve())

    # ---- health ------------------------------------------------------------------

    async def _probe(self) -> None:
        engines = [e for e in self._engines.values() if e.stub is not None]
        calls = [
            e.stub.GetStats(engine_pb2.StatsRequest(), timeout=CONTROL_TIMEOUT_S)
            for e in engines
            if e.stub is not None
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for engine, res in zip(engines, results, strict=True):
            if self._engines.get(engine.ep.zmq_addr) is not engine:
                continue  # removed while we asked
            if isinstance(res, BaseException):
                await self._on_probe_error(engine, res)
            else:
                self._on_stats(engine, res)

    def _on_stats(self, engine: _Engine, stats: engine_pb2.SchedulerStats) -> None:
        engine.stats, engine.misses, engine.stopping = stats, 0, False
        engine.on_reported(stats.num_running_reqs + stats.num_queue_reqs, from_events=False)
        if not engine.serving:
            engine.serving = True
            if engine.sock is None and not engine.draining:
                self._connect(engine)
            log.info("engine %s serving", engine.name)
        self._follow_events(engine)

    async def _on_probe_error(self, engine: _Engine, err: BaseException) -> None:
        if _is_draining(err):  # finishes what it runs there; new requests go elsewhere
            if not engine.stopping:
                engine.stopping = True
                log.info("engine %s is shutting down: no new requests", engine.name)
            return
        engine.misses += 1
        refused = (
            isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
        )
        if engine.serving and (refused or engine.misses >= MISSES_TO_DOWN):
            engine.serving = False
            message = f"engine {engine.name} is not answering ({_error_text(err)})"
            log.warning("%s: routing around it", message)
            self._lose(engine, message)
            self._connect(engine)  # fresh socket for when it is back; nothing stale delivered
            self._follow_events(engine)  # its tree is unknown until it is back
        if engine.draining and not engine.serving:
            await self._remove(engine)

    # ---- cache events ------------------------------------------------------------

    def _follow_events(self, engine: _Engine) -> None:
        """Follows the engine's CacheEvents while it serves and publishes them (cache_aware
        only); a new port is a new subscription (the scheduler restarted), and an index
        that nothing follows is empty."""
        stats, wanted = engine.stats, engine.serving and self._router.params.cache_aware
        port = max(stats.cache_events_port, 0) if wanted and stats is not None else 0
        if port == engine.events_port:
            return
        self._stop_events(engine)
        if not port or engine.stub is None:
            return
        stub, addr = engine.stub, tcp_addr(host_of(engine.ep.control_addr), port)

        def snapshot() -> Awaitable[engine_pb2.CacheEvents]:
            return stub.CacheSnapshot(engine_pb2.CacheSnapshotRequest(), timeout=SNAPSHOT_TIMEOUT_S)

        engine.events = CacheSubscriber(
            self._ctx,
            addr,
            engine.index,
            snapshot,
            setup=self._zmq_setup,
            name=engine.name,
            on_resync=self._metrics.on_resync if self._metrics is not None else None,
            on_load=lambda load: engine.on_reported(load, from_events=True),
        )
        engine.events_port = port
        log.info("engine %s: following its cache events at %s", engine.name, addr)

    def _stop_events(self, engine: _Engine) -> None:
        if engine.events is not None:
            engine.events.close()
            engine.events = None
        engine.events_port = 0
        engine.events_load_at = -math.inf  # GetStats tells the load again
        engine.index.clear()

    async def _refresh(self) -> None:
        """Recomputes what the engines say about themselves and whether we are ready."""
        serving = sorted((e for e in self._engines.values() if e.routable), key=lambda e: e.name)
        stats = [e.stats for e in serving if e.stats is not None]
        if stats:
            self.info = self._info_from(stats)
        elif serving:  # only engines with nothing to ask: trust the configuration
            worker = engine_pb2.WorkerInfo(max_model_len=self._max_model_len)
            self.info = EngineInfo(worker, 1, 0, self._max_model_len, len(serving))
        elif self.info is not None:
            self.info = EngineInfo(
                self.info.worker,
                self.info.page_size,
                self.info.max_total_num_tokens,
                self.info.max_model_len,
                0,
            )
        healthy = bool(serving)
        if healthy != self.healthy:
            self.healthy = healthy
            log.info("engines %s", "ready" if healthy else "none serving")
            if self._on_health is not None:
                await self._on_health(healthy)

    def _info_from(self, stats: list[engine_pb2.SchedulerStats]) -> EngineInfo:
        lens = [s.worker.max_model_len for s in stats if s.worker.max_model_len > 0]
        return EngineInfo(
            worker=stats[0].worker,
            page_size=stats[0].page_size or 1,
            max_total_num_tokens=stats[0].max_total_num_tokens,
            max_model_len=self._max_model_len or min(lens, default=0),
            num_engines=self.num_engines,
        )

    async def _watch_engines(self) -> None:
        while True:
            await self._probe()
            await self._refresh()
            await asyncio.sleep(HEALTH_INTERVAL_S if self.healthy else PROBE_INTERVAL_S)

    # ---- control -----------------------------------------------------------------

    def _controlled(self) -> list[_Engine]:
        return sorted(
            (e for e in self._engines.values() if e.routable and e.stub is not None),
            key=lambda e: e.name,
        )

    async def get_stats(self) -> list[engine_pb2.SchedulerStats]:
        calls = [
            e.stub.GetStats(engine_pb2.StatsRequest(), timeout=CONTROL_TIMEOUT_S)
            for e in self._controlled()
            if e.stub is not None
        ]
        return list(await asyncio.gather(*calls))

    async def flush_cache(self, storage: bool = False) -> engine_pb2.FlushReply:
        """Flushes every serving engine (``storage``: the storage tier's pages too); flushed
        only if all did, else their refusal reasons."""
        engines = self._controlled()
        if not engines:
            return engine_pb2.FlushReply(
                flushed=False, message="no engine with a control address is serving"
            )
        calls = [
            e.stub.FlushCache(engine_pb2.FlushRequest(storage=storage), timeout=CONTROL_TIMEOUT_S)
            for e in engines
            if e.stub is not None
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        reasons = []
        for engine, res in zip(engines, results, strict=True):
            if isinstance(res, BaseException):
                reasons.append(f"engine {engine.name}: {_error_text(res)}")
            elif not res.flushed:
                many = len(results) > 1
                reasons.append(f"engine {engine.name}: {res.message}" if many else res.message)
        if reasons:
            return engine_pb2.FlushReply(flushed=False, message="; ".join(reasons))
        return engine_pb2.FlushReply(flushed=True, message="Cache flushed.")


def _is_draining(e: BaseException) -> bool:
    """The scheduler's answer while it drains after SIGTERM (services/scheduler/main.py)."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.FAILED_PRECONDITION
        and (e.details() or "").startswith(DRAINING)
    )


def _error_text(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("send to scheduler failed: %r", fut.exception())
