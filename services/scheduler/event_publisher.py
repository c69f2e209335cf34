"""The scheduler's PUB socket of CacheEvents (cache_events.py): one message per step that
changed the tree, a heartbeat with the current seq every HEARTBEAT_S, so a router notices a
lost last message as a gap and asks for CacheSnapshot."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.scheduler.cache_events import TreeEvents
from services.scheduler.radix_cache import TreeNode

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# Messages queued per subscriber before PUB drops them (a slow router then resyncs).
SEND_HWM = 1000


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        events: TreeEvents,
        setup: Callable[[zmq.Socket], None] | None = None,
    ):
        self.events = events
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if setup is not None:
            setup(self.sock)  # CURVE: only the frontends' key may subscribe
        addr = f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
        try:
            self.sock.bind(addr)
        except zmq.ZMQError as e:
            self.sock.close()
            raise SystemExit(f"scheduler: cannot bind --cache-events-port {port}: {e}") from e
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._last_sent = 0.0

    def publish(self) -> None:
        """The step's changes, or a heartbeat when none were sent for HEARTBEAT_S."""
        msg = self.events.take()
        now = time.monotonic()
        if msg is None:
            if now - self._last_sent < HEARTBEAT_S:
                return
            msg = self.events.heartbeat()
        self._send(msg)
        self._last_sent = now

    def snapshot(self, root: TreeNode) -> engine_pb2.CacheEvents:
        """Publishes what is pending first, so the snapshot's seq covers everything sent."""
        msg = self.events.take()
        if msg is not None:
            self._send(msg)
        return self.events.snapshot(root)

    def _send(self, msg: engine_pb2.CacheEvents) -> None:
        try:
            transport.send(self.sock, msg, flags=zmq.NOBLOCK)
        except zmq.Again:  # no room for some subscriber: it sees the gap and resyncs
            pass

    def close(self) -> None:
        self.sock.close(linger=0)
