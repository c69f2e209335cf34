"""One engine replica as a frontend sees it: its ZeroMQ socket, control stub, health state,
the load it counts for routing, and the index of what its tree holds."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
import zmq.asyncio

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import transport
from services.common.bearer import aio_channel
from services.common.grpc_util import DRAINING, MAX_MESSAGE_BYTES
from services.common.tls import ClientTls
from services.frontend.cache_events import EVENTS_SILENT_S, CacheSubscriber
from services.frontend.cache_index import CacheIndex
from services.frontend.engine_discovery import Endpoint

log = logging.getLogger(__name__)

# A cache snapshot may be as large as any server message, past grpc's 4 MB client default.
CONTROL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class Replica:
    """One engine replica: where to send, whether it takes requests, and its load."""

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
        # The engine's own count of its requests, and ours sent since it counted.
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
        """The engine counted its requests; GetStats only counts while events are silent,
        being up to a second late."""
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

    def send(self, msg: engine_pb2.FrontendToScheduler) -> None:
        if self.sock is None:
            return
        # With unbounded HWM the send completes at once; the future only reports errors.
        fut = transport.send(self.sock, msg)
        fut.add_done_callback(_log_send_error)


def is_draining(e: BaseException) -> bool:
    """The scheduler's answer while it drains after SIGTERM (services/scheduler/main.py)."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.FAILED_PRECONDITION
        and (e.details() or "").startswith(DRAINING)
    )


def error_text(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("send to scheduler failed: %r", fut.exception())
