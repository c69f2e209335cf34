"""The scheduler process: connects to its worker, serves frontends over ZeroMQ and control
over gRPC (the loop: engine_loop.py)."""

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
from services.common.bearer import BearerInterceptor, MethodKeys
from services.common.config import SchedulerConfig
from services.common.curve import (
    InsecureLink,
    InternalKeys,
    check_link,
    connect_securely,
    load_keys,
    serve_securely,
)
from services.common.grpc_util import DRAINING, SERVER_OPTIONS, add_health_and_reflection, bind
from services.common.logs import setup_logging
from services.common.tls import server_credentials
from services.scheduler.control_parse import ParseControlRequests
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.event_publisher import EventPublisher
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.worker_conn import WorkerConn

log = logging.getLogger("radixserve.scheduler")
WORKER_START_TIMEOUT_S = 900.0
CONTROL_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["SchedulerControl"].full_name


class ControlServicer(engine_pb2_grpc.SchedulerControlServicer):
    """gRPC control calls, run on the scheduler loop's thread between batches."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.sched = loop.sched

    def FlushCache(self, request, context):
        busy = self.sched.snapshot
        if busy.num_running_reqs or busy.num_queue_reqs:
            # Refused at once, not after the batch in flight (which may take seconds).
            return self.sched.busy_flush_reply(busy.num_running_reqs, busy.num_queue_reqs)
        return self.sched.call(lambda: self.sched.flush_cache(request.storage))

    def GetStats(self, request, context):
        # The frontends' health check; engine_replica.py reads the DRAINING prefix.
        if why := self.loop.worker_down:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has no worker ({why})")
        if self.loop.drain_deadline is not None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{DRAINING}: the engine is shutting down"
            )
        # The last step's snapshot: a long batch never makes a busy engine look dead.
        return self.sched.snapshot

    def CacheSnapshot(self, request, context):
        pub = self.loop.publisher
        if pub is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "cache events are off (--cache-events-port -1)"
            )
            return None
        return self.sched.call(
            lambda: pub.snapshot(self.sched.kv.cache.root, self.sched.num_requests())
        )


def wait_for_worker(conn: WorkerConn, stop: threading.Event) -> engine_pb2.WorkerInfo | None:
    """Asks the worker for its info until it answers (it may still be loading weights);
    None when SIGTERM comes first."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    conn.say_hello()
    while not stop.is_set():
        info = conn.hello_reply(500)
        if info is not None:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"worker at {conn.addr} did not answer in {WORKER_START_TIMEOUT_S:.0f} s"
            )
    return None


def start_control_server(
    loop: EngineLoop,
    host: str,
    port: int,
    token: str = "",
    tls: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """``token``: the Bearer every control call but health must carry (empty: none).
    ``tls``: None for plaintext."""
    # The token is checked first: nothing from a caller without it is parsed.
    bearer = [BearerInterceptor(MethodKeys(token))] if token else []
    interceptors = [*bearer, ParseControlRequests()]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS, interceptors=interceptors
    )
    engine_pb2_grpc.add_SchedulerControlServicer_to_server(ControlServicer(loop), server)
    loop.attach_health(add_health_and_reflection(server, [CONTROL_SERVICE]), [CONTROL_SERVICE])
    bound = bind(server, host, port, "scheduler control gRPC (--control-port)", tls)
    server.start()
    return server, bound


def main(cfg: SchedulerConfig) -> None:
    setup_logging(cfg.log_level, "scheduler")
    if not cfg.worker_addr or not cfg.scheduler_addr:
        raise SystemExit("scheduler: --worker-addr and --scheduler-addr are required")
    tracing.setup_tracing("radixserve-scheduler", cfg.otlp_traces_endpoint)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # honoured while waiting, too
    keys = load_keys(cfg.internal_keys_dir)
    try:
        check_link(cfg.scheduler_addr, keys, cfg.insecure_internal, "--scheduler-addr")
        check_link(cfg.worker_addr, keys, cfg.insecure_internal, "--worker-addr")
    except InsecureLink as e:
        raise SystemExit(f"scheduler: {e}") from None
    ctx, worker_ctx = zmq.Context(), zmq.Context()  # the worker's: heartbeat defaults
    # CURVE (with keys): this scheduler proves its key to the worker.
    conn = WorkerConn(worker_ctx, cfg.worker_addr, connect_securely(keys, "scheduler", "worker"))
    try:
        info = wait_for_worker(conn, stop)
        if info is None:
            return
        _serve(cfg, ctx, conn, info, stop, keys)
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
        worker_ctx.destroy(linger=0)
        ctx.destroy(linger=0)
        tracing.shutdown()


def _serve(
    cfg: SchedulerConfig,
    ctx: zmq.Context,
    conn: WorkerConn,
    info: engine_pb2.WorkerInfo,
    stop: threading.Event,
    keys: InternalKeys | None = None,
) -> None:
    metrics = SchedulerMetrics(
        info.model_id, cfg.engine_replica, cfg.enable_mfu_metrics, enabled=cfg.enable_metrics
    )
    loop = EngineLoop(cfg, conn, info, metrics, stop)
    # CURVE (with keys): only the frontends' key gets a frame through; control needs the token.
    admit_frontends, _ = serve_securely(ctx, keys, "scheduler", ["frontend"])
    frontends = transport.router(ctx, cfg.scheduler_addr, setup=admit_frontends)
    if loop.sched.events is not None:
        loop.publisher = EventPublisher(
            ctx, cfg.host, cfg.cache_events_port, loop.sched.events, admit_frontends
        )
        loop.sched.events_port = loop.publisher.port
        loop.sched.publish_stats()  # GetStats tells the frontends where to subscribe
    token = keys.control_token() if keys else ""
    tls = server_credentials(cfg.control_ssl_certfile, cfg.control_ssl_keyfile)
    server, port = start_control_server(loop, cfg.host, cfg.control_port, token, tls)
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
        loop.sched.kv.total,
        cfg.page_size,
    )
    try:
        loop.run(frontends)
    finally:
        server.stop(grace=None)
        if loop.publisher is not None:
            loop.publisher.close()
