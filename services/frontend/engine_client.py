"""The frontend's side of the engines: one ZeroMQ DEALER per scheduler, plus gRPC control.

Each scheduler socket has a background task that reads SchedulerToFrontend messages and
hands every TokenDelta to the asyncio queue of its request (by rid). Requests are routed
across engine replicas by *rendezvous hashing* of (cache_salt, first ROUTING_PREFIX_TOKENS
prompt ids): requests that share a prefix (a system prompt, a few-shot header) land on the
same replica, whose radix tree already holds that prefix's KV; adding or removing a
replica moves only the prefixes that hashed to it. Load is not considered (simple, stable).

Readiness: until every scheduler answers GetStats the client is not ready (engines may start
after the frontend under Kubernetes); a background task keeps asking, then keeps polling so
that health follows the engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import zmq
import zmq.asyncio

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import transport

log = logging.getLogger(__name__)

ROUTING_PREFIX_TOKENS = 32
PROBE_INTERVAL_S = 0.5  # while the engines are not ready yet
HEALTH_INTERVAL_S = 5.0  # once they are
CONTROL_TIMEOUT_S = 5.0


class DuplicateRequestError(KeyError):
    """A request with this id is already in flight."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engines told us (the first replica's worker speaks for all of them)."""

    worker: engine_pb2.WorkerInfo
    page_size: int
    max_total_num_tokens: int
    max_model_len: int
    num_engines: int


def route(cache_salt: str, input_ids: Sequence[int], num_engines: int) -> int:
    """Rendezvous hash: the engine whose hash with the request's prefix key is highest."""
    if num_engines == 1:
        return 0
    key = cache_salt.encode() + b"\0" + transport.pack_i32(list(input_ids[:ROUTING_PREFIX_TOKENS]))

    def score(i: int) -> bytes:
        return hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=8).digest()

    return max(range(num_engines), key=score)


class EngineClient:
    def __init__(
        self,
        scheduler_addrs: Sequence[str],
        control_addrs: Sequence[str],
        max_model_len: int = 0,
        on_health: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        if not scheduler_addrs:
            raise ValueError("no scheduler address given (--scheduler-addrs)")
        if control_addrs and len(control_addrs) != len(scheduler_addrs):
            raise ValueError("--scheduler-control-addrs must list one address per scheduler")
        self._addrs = list(scheduler_addrs)
        self._control_addrs = list(control_addrs)
        self._max_model_len = max_model_len
        self._on_health = on_health
        self._ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket] = []
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[engine_pb2_grpc.SchedulerControlStub] = []
        self._tasks: list[asyncio.Task] = []
        self._queues: dict[str, asyncio.Queue[engine_pb2.TokenDelta]] = {}
        self._engine_of: dict[str, int] = {}
        self.info: EngineInfo | None = None
        self.healthy = False

    @property
    def num_engines(self) -> int:
        return len(self._addrs)

    @property
    def ready(self) -> bool:
        """Every engine answered the last probe (new requests are refused otherwise)."""
        return self.healthy and self.info is not None

    async def start(self) -> None:
        identity = f"frontend-{uuid.uuid4().hex[:12]}".encode()
        for addr in self._addrs:
            sock = transport.dealer(self._ctx, addr, identity=identity)
            assert isinstance(sock, zmq.asyncio.Socket)  # an asyncio context makes asyncio sockets
            self._socks.append(sock)
        for addr in self._control_addrs:
            channel = grpc.aio.insecure_channel(addr)
            self._channels.append(channel)
            self._stubs.append(engine_pb2_grpc.SchedulerControlStub(channel))
        self._tasks = [asyncio.create_task(self._receive(s)) for s in self._socks]
        self._tasks.append(asyncio.create_task(self._watch_engines()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()

    # ---- requests ----------------------------------------------------------------

    def submit(
        self, req: engine_pb2.TokenizedRequest, input_ids: Sequence[int]
    ) -> asyncio.Queue[engine_pb2.TokenDelta]:
        """Sends the request to its engine; returns the queue its TokenDeltas arrive on."""
        if req.rid in self._queues:
            raise DuplicateRequestError(req.rid)
        engine = route(req.cache_salt, input_ids, self.num_engines)
        queue: asyncio.Queue[engine_pb2.TokenDelta] = asyncio.Queue()
        self._queues[req.rid] = queue
        self._engine_of[req.rid] = engine
        self._send(engine, engine_pb2.FrontendToScheduler(generate=req))
        return queue

    def abort(self, rid: str, reason: str) -> None:
        """Tells the request's scheduler to stop it now (no waiting: also called on cancel)."""
        engine = self._engine_of.get(rid)
        if engine is not None:
            abort = engine_pb2.AbortRequest(rid=rid, reason=reason)
            self._send(engine, engine_pb2.FrontendToScheduler(abort=abort))

    def release(self, rid: str) -> None:
        """Forgets a finished request; later deltas for it are dropped."""
        self._queues.pop(rid, None)
        self._engine_of.pop(rid, None)

    def _send(self, engine: int, msg: engine_pb2.FrontendToScheduler) -> None:
        # With unbounded HWM the send completes at once; the future only reports errors.
        fut = transport.send(self._socks[engine], msg)
        fut.add_done_callback(_log_send_error)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await transport.arecv(sock, engine_pb2.SchedulerToFrontend)
            for delta in msg.outputs:
                queue = self._queues.get(delta.rid)
                if queue is not None:
                    queue.put_nowait(delta)

    # ---- control -----------------------------------------------------------------

    async def get_stats(self) -> list[engine_pb2.SchedulerStats]:
        calls = [
            s.GetStats(engine_pb2.StatsRequest(), timeout=CONTROL_TIMEOUT_S) for s in self._stubs
        ]
        return list(await asyncio.gather(*calls))

    async def flush_cache(self) -> engine_pb2.FlushReply:
        """Flushes every engine; flushed only if all did, else their refusal reasons."""
        if not self._stubs:
            return engine_pb2.FlushReply(
                flushed=False, message="no scheduler control address configured"
            )
        calls = [
            s.FlushCache(engine_pb2.FlushRequest(), timeout=CONTROL_TIMEOUT_S) for s in self._stubs
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        reasons = []
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                reasons.append(f"engine {i}: {_error_text(res)}")
            elif not res.flushed:
                reasons.append(f"engine {i}: {res.message}" if len(results) > 1 else res.message)
        if reasons:
            return engine_pb2.FlushReply(flushed=False, message="; ".join(reasons))
        return engine_pb2.FlushReply(flushed=True, message="Cache flushed.")

    def _info_from(self, stats: list[engine_pb2.SchedulerStats]) -> EngineInfo:
        lens = [s.worker.max_model_len for s in stats if s.worker.max_model_len > 0]
        return EngineInfo(
            worker=stats[0].worker,
            page_size=stats[0].page_size or 1,
            max_total_num_tokens=stats[0].max_total_num_tokens,
            max_model_len=self._max_model_len or min(lens, default=0),
            num_engines=self.num_engines,
        )

    async def _probe(self) -> bool:
        if not self._stubs:
            # Nothing to ask: trust the configuration.
            if self.info is None:
                worker = engine_pb2.WorkerInfo(max_model_len=self._max_model_len)
                self.info = EngineInfo(worker, 1, 0, self._max_model_len, self.num_engines)
            return True
        calls = [
            s.GetStats(engine_pb2.StatsRequest(), timeout=CONTROL_TIMEOUT_S) for s in self._stubs
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        stats = [r for r in results if not isinstance(r, BaseException)]
        down = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        if down:
            first = next(iter(down))
            log.debug("engines %s not answering: %s", list(down), _error_text(down[first]))
            for i, err in down.items():
                self._fail_requests(i, f"engine {i} is not answering ({_error_text(err)})")
            return False
        self.info = self._info_from(stats)
        return True

    def _fail_requests(self, engine: int, message: str) -> None:
        """Ends the requests of an engine that went away, instead of letting them hang."""
        for rid, e in list(self._engine_of.items()):
            if e == engine:
                self._queues[rid].put_nowait(
                    engine_pb2.TokenDelta(
                        rid=rid,
                        finish_reason="abort",
                        error_code="UNAVAILABLE",
                        finish_message=message,
                    )
                )

    async def _watch_engines(self) -> None:
        while True:
            healthy = await self._probe()
            if healthy != self.healthy:
                self.healthy = healthy
                log.info("engines %s", "ready" if healthy else "not answering")
                if self._on_health is not None:
                    await self._on_health(healthy)
            await asyncio.sleep(HEALTH_INTERVAL_S if healthy else PROBE_INTERVAL_S)


def _error_text(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("send to scheduler failed: %r", fut.exception())
