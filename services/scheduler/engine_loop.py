"""The scheduler's main loop and its three states: serving, waiting for a worker (requests
fail UNAVAILABLE, state rebuilt on the new pool), draining (SIGTERM: running requests get
--shutdown-grace-period). Liveness stays SERVING throughout: a scheduler whose worker
died is not itself broken, and restarting it would only lose the frontends' links.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.config import SchedulerConfig
from services.common.grpc_util import HealthServicer, set_serving
from services.scheduler.event_publisher import EventPublisher
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_conn import WorkerConn
from services.scheduler.worker_link import WorkerLost

log = logging.getLogger("radixserve.scheduler")
IDLE_POLL_MS = 5
# Idle this long before the whole-tree recount, so it never lands inside a burst.
FULL_CHECK_IDLE_S = 1.0
FRONTEND_DROPS = transport.DropLog("scheduler frontend socket")


class EngineLoop:
    def __init__(
        self,
        cfg: SchedulerConfig,
        conn: WorkerConn,
        info: engine_pb2.WorkerInfo,
        metrics: SchedulerMetrics,
        stop: threading.Event,
    ):
        self.cfg, self.conn, self.stop = cfg, conn, stop
        assert conn.sock is not None
        self.sched = Scheduler(cfg, conn.sock, info, metrics, worker_lost=self._stop_waiting)
        self.worker_down = ""  # why no worker answers ("" while one does)
        self.drain_deadline: float | None = None  # set by SIGTERM
        self.health: HealthServicer | None = None
        self.health_names: list[str] = []
        self.publisher: EventPublisher | None = None

    # ---- what the outside sees ----------------------------------------------------------
    def attach_health(self, health: HealthServicer, names: list[str]) -> None:
        self.health, self.health_names = health, names
        self._publish_health()

    def _publish_health(self) -> None:
        if self.health is not None:
            ready = not self.worker_down and self.drain_deadline is None
            set_serving(self.health, self.health_names, ready)

    def _refusal(self) -> str:
        if self.drain_deadline is not None:
            return "the engine is shutting down; retry on another engine"
        if self.worker_down:
            return f"the engine has no worker ({self.worker_down}); retry shortly"
        return ""

    # ---- the loop -----------------------------------------------------------------------
    def run(self, frontends: zmq.Socket) -> None:
        last_work = time.monotonic()
        while not self._finished():
            if self.stop.is_set() and self.drain_deadline is None:
                self._begin_drain()
            busy = self.sched.has_requests() and not self.worker_down
            drain_frontends(self.sched, frontends, 0 if busy else IDLE_POLL_MS, self._refusal())
            self.sched.run_commands()
            worked = self._await_worker() if self.worker_down else self._step()
            self.sched.flush_outbox(frontends)
            if self.publisher is not None:
                self.publisher.publish(self.sched.num_requests())
            if worked:
                last_work = time.monotonic()
            else:
                self.sched.check_idle(full=time.monotonic() - last_work >= FULL_CHECK_IDLE_S)
        self.sched.flush_outbox(frontends)

    def _step(self) -> bool:
        try:
            worked = self.sched.step()
        except WorkerLost as e:
            self._on_lost(str(e))
            return False
        if not worked and (why := self.conn.lost()):  # gone while idle: readiness follows
            self._on_lost(why)
        return worked

    def _finished(self) -> bool:
        if self.drain_deadline is None:
            return False
        if not self.sched.has_requests() or self.worker_down:
            return True
        if time.monotonic() >= self.drain_deadline:
            self._fail_expired()
            return True
        return False

    # ---- the worker going and coming back --------------------------------------------------
    def _stop_waiting(self) -> str:
        """Why WorkerLink should stop waiting for a result ("": keep waiting)."""
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            return "shutdown grace period over"
        return self.conn.lost()

    def _on_lost(self, why: str) -> None:
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            self._fail_expired()
            return
        n = self.sched.fail_all(f"the engine lost its worker ({why}); retry shortly")
        self.worker_down = why
        self._publish_health()
        log.error("worker lost: %s; %d request(s) failed UNAVAILABLE; waiting for it", why, n)
        self.conn.renew()  # nothing queued for the dead worker reaches the next one
        self.conn.say_hello()

    def _await_worker(self) -> bool:
        info = self.conn.hello_reply(0)
        if info is None:
            return False
        assert self.conn.sock is not None
        self.sched.attach_worker(self.conn.sock, info)
        self.worker_down = ""
        self._publish_health()
        log.info(
            "worker at %s answered (instance %s, pool %d tokens, vocab %d): cache reset, "
            "serving again",
            self.conn.addr,
            info.instance_id or "?",
            self.sched.kv.total,
            info.vocab_size,
        )
        return True

    # ---- SIGTERM -----------------------------------------------------------------------
    def _begin_drain(self) -> None:
        grace = self.cfg.shutdown_grace_period
        self.drain_deadline = time.monotonic() + grace
        self._publish_health()
        running = len(self.sched.queues.running) + len(self.sched.queues.waiting)
        log.info("SIGTERM: NOT_SERVING; draining %d request(s) for up to %g s", running, grace)

    def _fail_expired(self) -> None:
        n = self.sched.fail_all(
            "the engine shut down before this request finished (--shutdown-grace-period)"
        )
        log.warning("shutdown grace period over: %d request(s) failed UNAVAILABLE", n)


def drain_frontends(sched: Scheduler, sock: zmq.Socket, timeout_ms: int, refuse: str = "") -> None:
    """Takes every waiting frontend message (up to timeout_ms for the first). With
    ``refuse``, new requests are answered UNAVAILABLE with it at once."""
    if not sock.poll(timeout_ms):
        return
    while True:
        try:
            identity, msg = transport.recv_routed(sock, engine_pb2.FrontendToScheduler, zmq.NOBLOCK)
        except zmq.Again:
            sched.publish_stats()  # control calls see new and aborted requests at once
            return
        except transport.BadFrame as e:  # garbage never ends the loop
            FRONTEND_DROPS.note(e)
            continue
        if msg.HasField("generate"):
            if refuse:
                sched.refuse(identity, msg.generate, refuse)
            else:
                sched.add_request(identity, msg.generate)
        elif msg.HasField("abort"):
            sched.abort(msg.abort.rid, msg.abort.reason)
        else:
            FRONTEND_DROPS.note("a FrontendToScheduler with no message set")
