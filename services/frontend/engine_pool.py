"""The frontend's pool of engine replicas, kept true to discovery and health.

Discovery: a replica that appears is connected and probed; one that disappears drains (no
new requests, closed once its requests end). Health: GetStats every HEALTH_INTERVAL_S; a
replica that refuses the connection or misses MISSES_TO_DOWN answers is down at once and its
socket is replaced, so nothing queued for it is delivered late. The pool is ready while at
least one replica serves.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import zmq
import zmq.asyncio

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.curve import InternalKeys, connect_securely
from services.common.hostport import tcp_addr
from services.common.tls import ClientTls
from services.frontend.cache_events import SNAPSHOT_TIMEOUT_S, CacheSubscriber, host_of
from services.frontend.engine_discovery import Endpoint, Resolver
from services.frontend.engine_replica import Replica, error_text, is_draining
from services.frontend.metrics import RoutingMetrics

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # while no engine serves
HEALTH_INTERVAL_S = 1.0  # once one does: how fast a dead engine is noticed
CONTROL_TIMEOUT_S = 2.0
MISSES_TO_DOWN = 3  # unanswered probes (timeouts) before a replica counts as down


@dataclass(frozen=True)
class EngineInfo:
    """What the engines told us (the first serving replica's worker speaks for all of them)."""

    worker: engine_pb2.WorkerInfo
    page_size: int
    max_total_num_tokens: int
    max_model_len: int
    num_engines: int


OnOutputs = Callable[[Replica, engine_pb2.SchedulerToFrontend], None]
OnLost = Callable[[Replica, str], None]


class EnginePool:
    def __init__(
        self,
        resolver: Resolver,
        on_outputs: OnOutputs,
        on_lost: OnLost,
        max_model_len: int = 0,
        on_health: Callable[[bool], Awaitable[None]] | None = None,
        cache_aware: bool = False,
        keys: InternalKeys | None = None,
        metrics: RoutingMetrics | None = None,
        control_tls: ClientTls | None = None,
    ) -> None:
        self._resolver = resolver
        self._on_outputs, self._on_lost = on_outputs, on_lost
        self._control_tls = control_tls
        self._zmq_setup = connect_securely(keys, "frontend", "scheduler")
        self._control_token = keys.control_token() if keys else ""
        self._max_model_len = max_model_len
        self._on_health = on_health
        self._cache_aware = cache_aware
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._name = f"frontend-{uuid.uuid4().hex[:12]}"
        self._sockets_made = 0
        self.engines: dict[str, Replica] = {}  # by ZeroMQ address
        self._tasks: list[asyncio.Task] = []
        self._closers: set[asyncio.Task] = set()
        self.info: EngineInfo | None = None
        self.healthy = False

    def routable(self) -> dict[str, Replica]:
        return {e.name: e for e in self.engines.values() if e.routable}

    async def start(self) -> None:
        await self._reconcile(await self._resolver.resolve())
        self._tasks = [
            asyncio.create_task(self._discover()),
            asyncio.create_task(self._watch()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in list(self.engines.values()):
            await self._remove(engine)
        self._ctx.term()

    def retire_if_idle(self, engine: Replica) -> None:
        """A draining replica's last request ended: close it now."""
        if engine.draining and not engine.rids:
            task = asyncio.get_running_loop().create_task(self._remove(engine))
            self._closers.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._closers.discard)

    def _connect(self, engine: Replica) -> None:
        """A fresh socket: whatever the old one still queued for a dead peer is dropped."""
        self._disconnect(engine)
        # A new identity each time: a ROUTER ignores a peer whose identity is still in use.
        self._sockets_made += 1
        identity = f"{self._name}-{self._sockets_made}".encode()
        sock = transport.dealer(
            self._ctx, engine.ep.zmq_addr, identity=identity, setup=self._zmq_setup
        )
        assert isinstance(sock, zmq.asyncio.Socket)  # an asyncio context makes asyncio sockets
        engine.sock = sock
        engine.receiver = asyncio.get_running_loop().create_task(self._receive(engine, sock))

    async def _receive(self, engine: Replica, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._on_outputs(engine, await transport.arecv(sock, engine_pb2.SchedulerToFrontend))

    def _disconnect(self, engine: Replica) -> None:
        if engine.receiver is not None:
            engine.receiver.cancel()
            engine.receiver = None
        if engine.sock is not None:
            engine.sock.close(linger=0)
            engine.sock = None

    async def _remove(self, engine: Replica) -> None:
        if self.engines.get(engine.ep.zmq_addr) is not engine:
            return
        del self.engines[engine.ep.zmq_addr]
        self._lose(engine, f"engine {engine.name} left the pool")
        self._disconnect(engine)
        self._stop_events(engine)
        if self._metrics is not None:
            self._metrics.untrack_index(engine.name)
        if engine.channel is not None:
            await engine.channel.close()
        log.info("engine %s removed (%d serving)", engine.name, len(self.routable()))

    def _lose(self, engine: Replica, message: str) -> None:
        self._on_lost(engine, message)
        engine.rids.clear()
        engine.sent_since.clear()

    async def _reconcile(self, endpoints: list[Endpoint] | None) -> None:
        if endpoints is None:  # the lookup failed: keep what we have
            return
        wanted = {ep.zmq_addr: ep for ep in endpoints}
        for addr, ep in wanted.items():
            engine = self.engines.get(addr)
            if engine is None:
                engine = self.engines[addr] = Replica(ep, self._control_token, self._control_tls)
                self._connect(engine)
                if self._metrics is not None:
                    self._metrics.track_index(engine.name, engine.index)
                log.info("engine %s joined (%s)", ep.name, ep.zmq_addr)
            elif engine.draining:
                engine.draining = False
                log.info("engine %s is back", ep.name)
        for addr, engine in list(self.engines.items()):
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

    async def _probe(self) -> None:
        engines = [e for e in self.engines.values() if e.stub is not None]
        calls = [
            e.stub.GetStats(engine_pb2.StatsRequest(), timeout=CONTROL_TIMEOUT_S)
            for e in engines
            if e.stub is not None
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for engine, res in zip(engines, results, strict=True):
            if self.engines.get(engine.ep.zmq_addr) is not engine:
                continue  # removed while we asked
            if isinstance(res, BaseException):
                await self._on_probe_error(engine, res)
            else:
                self._on_stats(engine, res)

    def _on_stats(self, engine: Replica, stats: engine_pb2.SchedulerStats) -> None:
        engine.stats, engine.misses, engine.stopping = stats, 0, False
        engine.on_reported(stats.num_running_reqs + stats.num_queue_reqs, from_events=False)
        if not engine.serving:
            engine.serving = True
            if engine.sock is None and not engine.draining:
                self._connect(engine)
            log.info("engine %s serving", engine.name)
        self._follow_events(engine)

    async def _on_probe_error(self, engine: Replica, err: BaseException) -> None:
        if is_draining(err):  # finishes what it runs there; new requests go elsewhere
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
            message = f"engine {engine.name} is not answering ({error_text(err)})"
            log.warning("%s: routing around it", message)
            self._lose(engine, message)
            self._connect(engine)  # fresh socket for when it is back; nothing stale delivered
            self._follow_events(engine)  # its tree is unknown until it is back
        if engine.draining and not engine.serving:
            await self._remove(engine)

    async def _watch(self) -> None:
        while True:
            await self._probe()
            await self._refresh()
            await asyncio.sleep(HEALTH_INTERVAL_S if self.healthy else PROBE_INTERVAL_S)

    async def _refresh(self) -> None:
        serving = sorted(self.routable().values(), key=lambda e: e.name)
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
            num_engines=len(self.routable()),
        )

    def _follow_events(self, engine: Replica) -> None:
        """Follows the engine's CacheEvents while it serves (cache_aware only); a new port is
        a new subscription, and an index that nothing follows is empty."""
        stats, wanted = engine.stats, engine.serving and self._cache_aware
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

    def _stop_events(self, engine: Replica) -> None:
        if engine.events is not None:
            engine.events.close()
            engine.events = None
        engine.events_port = 0
        engine.events_load_at = -math.inf  # GetStats tells the load again
        engine.index.clear()

    def _controlled(self) -> list[Replica]:
        return sorted(
            (e for e in self.engines.values() if e.routable and e.stub is not None),
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
        """Flushes every serving engine; flushed only if all did, else their refusal reasons."""
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
                reasons.append(f"engine {engine.name}: {error_text(res)}")
            elif not res.flushed:
                many = len(results) > 1
                reasons.append(f"engine {engine.name}: {res.message}" if many else res.message)
        if reasons:
            return engine_pb2.FlushReply(flushed=False, message="; ".join(reasons))
        return engine_pb2.FlushReply(flushed=True, message="Cache flushed.")
