"""The frontend's request streams over a pool of engine replicas (engine_pool.py).

A submitted request is routed (router.py, docs/routing.md) to a replica, and the TokenDeltas
that come back go to its request's asyncio queue, by rid. A request is kept whole until its
first token: when its replica goes away, one that has not streamed yet moves to another
replica, one that has fails fast with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.curve import InternalKeys
from services.common.tls import ClientTls
from services.frontend.cache_index import PromptKeys
from services.frontend.engine_discovery import Resolver
from services.frontend.engine_pool import EngineInfo, EnginePool
from services.frontend.engine_replica import Replica
from services.frontend.hot_prefixes import HotPrefixes
from services.frontend.metrics import RoutingMetrics
from services.frontend.router import Router, RoutingParams, prefix_key, ranking

__all__ = ["DuplicateRequestError", "EngineClient", "EngineInfo", "route"]


class DuplicateRequestError(KeyError):
    """A request with this id is already in flight."""


def route(cache_salt: str, input_ids: Sequence[int], num_engines: int) -> int:
    """The replica (by index) a prefix prefers when no engine is loaded and none holds it."""
    names = [str(i) for i in range(num_engines)]
    return int(ranking(prefix_key(cache_salt, input_ids), names)[0])


@dataclass
class _Pending:
    """A request in flight, kept whole until its first token so it can move to another engine."""

    req: engine_pb2.TokenizedRequest
    key: bytes
    prompt: PromptKeys
    queue: asyncio.Queue[engine_pb2.TokenDelta]
    engine: Replica | None = None
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
        """``keys``: the internal links' CURVE keys; ``control_tls`` None: plaintext control."""
        self._router = Router(routing)
        self._hot = HotPrefixes(self._router.params.hot_prefix_forks)
        self._metrics = metrics
        self._requests: dict[str, _Pending] = {}
        self._closing = False
        self.pool = EnginePool(
            resolver,
            self._on_outputs,
            self._on_lost,
            max_model_len=max_model_len,
            on_health=on_health,
            cache_aware=self._router.params.cache_aware,
            keys=keys,
            metrics=metrics,
            control_tls=control_tls,
        )

    @property
    def info(self) -> EngineInfo | None:
        return self.pool.info

    @property
    def healthy(self) -> bool:
        return self.pool.healthy

    @property
    def num_engines(self) -> int:
        return len(self.pool.routable())

    @property
    def ready(self) -> bool:
        """At least one engine serves (new requests are refused otherwise)."""
        return self.healthy and self.info is not None

    def loads(self) -> dict[str, int]:
        return {name: e.load for name, e in self.pool.routable().items()}

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        self._closing = True  # what is in flight now fails; nothing moves to another engine
        await self.pool.close()

    async def get_stats(self) -> list[engine_pb2.SchedulerStats]:
        return await self.pool.get_stats()

    async def flush_cache(self, storage: bool = False) -> engine_pb2.FlushReply:
        return await self.pool.flush_cache(storage)

    def submit(
        self, req: engine_pb2.TokenizedRequest, input_ids: Sequence[int], pin: str | None = None
    ) -> asyncio.Queue[engine_pb2.TokenDelta]:
        """Sends the request to its engine; returns the queue its TokenDeltas arrive on.
        ``pin``: the replica to send it to, bypassing routing, while that one takes requests."""
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
        """Tells the request's scheduler to stop it now, without waiting."""
        pending = self._requests.get(rid)
        if pending is not None and pending.engine is not None:
            abort = engine_pb2.AbortRequest(rid=rid, reason=reason)
            pending.engine.send(engine_pb2.FrontendToScheduler(abort=abort))

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
            pending.engine.done(rid)
            self.pool.retire_if_idle(pending.engine)

    def _dispatch(self, pending: _Pending) -> None:
        engines = self.pool.routable()
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

    def _send_to(self, engine: Replica, pending: _Pending) -> None:
        pending.engine = engine
        engine.sent(pending.req.rid)
        engine.send(engine_pb2.FrontendToScheduler(generate=pending.req))

    def _hot_blocks(
        self, engines: Iterable[Replica], prompt: PromptKeys
    ) -> tuple[int, list[bytes]]:
        """Tokens of the prompt's hot prefix, and its block keys in the engines' geometry."""
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

    def _on_outputs(self, engine: Replica, msg: engine_pb2.SchedulerToFrontend) -> None:
        for delta in msg.outputs:
            pending = self._requests.get(delta.rid)
            # Only the engine the request is on now: one it left may still be talking.
            if pending is not None and pending.engine is engine:
                pending.answered = True
                pending.queue.put_nowait(delta)

    def _on_lost(self, engine: Replica, message: str) -> None:
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
