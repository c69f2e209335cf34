"""The scheduler's connection to its worker, and how it knows the worker is gone.

Two libzmq signals: the socket monitor's DISCONNECTED (the kernel closed a dead process's
socket) and ZMTP heartbeats (a frozen process or lost node; libzmq's I/O thread answers
them even during a long forward). Then a fresh socket says hello again.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve.internal.v1 import engine_pb2
from services.common import transport

log = logging.getLogger("radixserve.scheduler")

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RECONNECT_IVL_MS = 200  # a restarted worker is found within this much of its bind


class WorkerConn:
    """One DEALER to the worker at a time, with its monitor; ``renew`` replaces both."""

    def __init__(
        self, ctx: zmq.Context, addr: str, setup: Callable[[zmq.Socket], None] | None = None
    ):
        self.addr = addr
        self.ctx = ctx
        self.setup = setup  # run on each new socket before it connects (CURVE keys)
        # Heartbeat options only apply to connections made after they are set.
        ctx.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        ctx.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        ctx.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self._ids = itertools.count(1)
        self.sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self.renew()

    def renew(self) -> None:
        """A fresh socket and identity: nothing queued for a dead worker reaches the next."""
        self.close()
        identity = f"scheduler-{os.getpid()}-{next(self._ids)}".encode()
        self.sock = transport.dealer(self.ctx, self.addr, identity=identity, setup=self.setup)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.sock.close(linger=0)
            self.sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def lost(self) -> str:
        """Why the worker is gone ("" while it is not known to be); never waits."""
        assert self._monitor is not None
        reason = ""
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                reason = (
                    f"the connection to the worker at {self.addr} closed (the process died, "
                    f"or missed heartbeats for {HEARTBEAT_TIMEOUT_MS / 1000:g} s)"
                )
        return reason

    def say_hello(self) -> None:
        """Asks for the worker's info; the worker also resets its per-request state."""
        assert self.sock is not None
        transport.send(self.sock, engine_pb2.SchedulerToWorker(info=engine_pb2.WorkerInfoRequest()))

    def hello_reply(self, timeout_ms: int = 0) -> engine_pb2.WorkerInfo | None:
        """The answer to say_hello within ``timeout_ms``, or None (a lost connection gets a
        new socket and hello)."""
        assert self.sock is not None
        if self.sock.poll(timeout_ms):
            try:
                reply = transport.recv(self.sock, engine_pb2.WorkerToScheduler)
            except transport.BadFrame as e:
                log.warning("worker at %s: unreadable hello reply dropped (%s)", self.addr, e)
                return None
            return reply.info if reply.HasField("info") else None
        if self.lost():
            self.renew()
            self.say_hello()
        return None
