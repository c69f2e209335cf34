"""The scheduler process: connects to its worker, serves frontends over ZeroMQ and control
over gRPC."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
import zmq

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import tracing, transport
from services.common.config import SchedulerConfig
from services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind, set_serving
from services.common.logs import setup_logging
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Scheduler

log = logging.getLogger("radixserve.scheduler")
IDLE_POLL_MS = 5
# The idle engine recounts its whole tree (tens of ms per 10k cached tokens) only after
# this long without work: a burst's requests arrive over a few hundred ms, and a recount
# between two of them would delay the rest.
FULL_CHECK_IDLE_S = 1.0
WORKER_START_TIMEOUT_S = 900.0
CONTROL_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["SchedulerControl"].full_name


class ControlServicer(engine_pb2_grpc.SchedulerControlServicer):
    """gRPC control calls, run on the scheduler loop's thread between batches."""

    def __init__(self, sched: Scheduler):
        self.sched = sched

    def FlushCache(self, request, context):
        busy = self.sched.snapshot
        if busy.num_running_reqs or busy.num_queue_reqs:
            # Refused at once, not after the batch in flight (which may take seconds).
            return self.sched.busy_flush_reply(busy.num_running_reqs, busy.num_queue_reqs)
        return self.sched.call(self.sched.flush_cache)

    def GetStats(self, request, context):
        # The snapshot of the last step: answers even while a long batch runs, so the
        # frontend's health check never mistakes a busy engine for a dead one.
        return self.sched.snapshot


def wait_for_worker(sock: zmq.Socket, addr: str) -> engine_pb2.WorkerInfo:
    """Asks the worker for its info until it answers (it may still be loading weights)."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    transport.send(sock, engine_pb2.SchedulerToWorker(info=engine_pb2.WorkerInfoRequest()))
    while not sock.poll(1000):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker at {addr} did not answer in {WORKER_START_TIMEOUT_S:.0f} s")
    reply = transport.recv(sock, engine_pb2.WorkerToScheduler)
    if not reply.HasField("info"):
        raise RuntimeError(f"worker at {addr} answered the info request with something else")
    return reply.info


def start_control_server(sched: Scheduler, host: str, port: int) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    engine_pb2_grpc.add_SchedulerControlServicer_to_server(ControlServicer(sched), server)
    health = add_health_and_reflection(server, [CONTROL_SERVICE])
    set_serving(health, [CONTROL_SERVICE], True)
    bound = bind(server, host, port, "scheduler control gRPC (--control-port)")
    server.start()
    return server, bound


FRONTEND_DROPS = transport.DropLog("scheduler frontend socket")


def drain_frontends(sched: Scheduler, sock: zmq.Socket, timeout_ms: int) -> None:
    """Takes every message waiting on the frontend socket (waits up to timeout_ms for the first)."""
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
            sched.add_request(identity, msg.generate)
        elif msg.HasField("abort"):
            sched.abort(msg.abort.rid, msg.abort.reason)
        else:
            FRONTEND_DROPS.note("a FrontendToScheduler with no message set")


def main(cfg: SchedulerConfig) -> None:
    setup_logging(cfg.log_level, "scheduler")
    if not cfg.worker_addr or not cfg.scheduler_addr:
        raise SystemExit("scheduler: --worker-addr and --scheduler-addr are required")
    tracing.setup_tracing("radixserve-scheduler", cfg.otlp_traces_endpoint)
    ctx = zmq.Context()
    worker = transport.dealer(ctx, cfg.worker_addr)
    info = wait_for_worker(worker, cfg.worker_addr)
    metrics = SchedulerMetrics(
        info.model_id, cfg.engine_replica, cfg.enable_mfu_metrics, enabled=cfg.enable_metrics
    )
    sched = Scheduler(cfg, worker, info, metrics)
    sched.publish_stats()
    frontends = transport.router(ctx, cfg.scheduler_addr)
    server, port = start_control_server(sched, cfg.host, cfg.control_port)
    extra = ""
    if cfg.enable_metrics:
        extra = f", metrics on {cfg.host}:{metrics.serve(cfg.host, cfg.metrics_port)}"
    log.info(
        "scheduler: ZeroMQ on %s, control gRPC on %s:%d%s; model %s, pool %d tokens, page size %d",
        cfg.scheduler_addr,
        cfg.host,
        port,
        extra,
        info.model_id,
        sched.kv.total,
        cfg.page_size,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last_work = time.monotonic()
    try:
        while not stop.is_set():
            drain_frontends(sched, frontends, 0 if sched.has_requests() else IDLE_POLL_MS)
            sched.run_commands()
            worked = sched.step()
            sched.flush_outbox(frontends)
            if worked:
                last_work = time.monotonic()
            else:
                sched.check_idle(full=time.monotonic() - last_work >= FULL_CHECK_IDLE_S)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=None)
        ctx.destroy(linger=0)
        tracing.shutdown()
