"""The scheduler's PUB socket of CacheEvents: a message per step that changed the tree or
the load, and a heartbeat every HEARTBEAT_S so a router notices a lost message as a gap."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.hostport import tcp_addr
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
        addr = transport.endpoint(self.sock, tcp_addr(host, port or "*"))
        try:
            self.sock.bind(addr)
        except zmq.ZMQError as e:
            self.sock.close()
            raise SystemExit(f"scheduler: cannot bind --cache-events-port {port}: {e}") from e
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._last_sent = 0.0
        self._load = -1

    def publish(self, load: int) -> None:
        """The step's changes, else a changed load or a due heartbeat (same seq)."""
        msg = self.events.take()
        now = time.monotonic()
        if msg is None:
            if load == self._load and now - self._last_sent < HEARTBEAT_S:
                return
            msg = self.events.heartbeat()
        self._send(msg, load)
        self._last_sent = now

    def snapshot(self, root: TreeNode, load: int) -> engine_pb2.CacheEvents:
        """Publishes what is pending first, so the snapshot's seq covers everything sent."""
        msg = self.events.take()
        if msg is not None:
            self._send(msg, load)
        snap = self.events.snapshot(root)
        snap.num_requests = load
        return snap

    def _send(self, msg: engine_pb2.CacheEvents, load: int) -> None:
        msg.num_requests = self._load = load
        try:
            transport.send(self.sock, msg, flags=zmq.NOBLOCK)
        except zmq.Again:  # no room for some subscriber: it sees the gap and resyncs
            pass

    def close(self) -> None:
        self.sock.close(linger=0)
