"""The worker process: loads the model, then serves forward batches to its scheduler over ZeroMQ."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from concurrent import futures

import grpc
import torch
import zmq
from opentelemetry import trace

from radixserve.internal.v1 import engine_pb2
from services.common import tracing, transport
from services.common.config import WorkerConfig, secret_env, to_argv
from services.common.curve import (
    InsecureLink,
    InternalKeys,
    check_link,
    load_keys,
    serve_securely,
)
from services.common.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind
from services.common.logs import setup_logging
from services.common.tls import server_credentials
from services.worker import wire
from services.worker.batch import RunnerInfo
from services.worker.cpu_threads import ThreadGovernor, default_threads
from services.worker.metrics import WorkerMetrics
from services.worker.model_loader import load_config
from services.worker.model_runner import ModelRunner, check_tensor_parallel, resolve_device
from services.worker.parallel.launch import Ranks

log = logging.getLogger("radixserve.worker")
POLL_MS = 100
# After SIGTERM, the worker leaves once its scheduler sent nothing for this long: a draining
# scheduler sends batches back to back; an idle or stopped one sends none.
DRAIN_IDLE_S = 1.0
_tracer = tracing.tracer("radixserve.worker")


def set_cpu_threads(requested: int, tp_size: int = 1) -> int:
    """Sets torch's thread count (default: one per usable core, split between TP ranks)."""
    threads = default_threads(requested, tp_size)
    torch.set_num_threads(threads)
    return threads


def start_ranks(cfg: WorkerConfig) -> Ranks:
    """Under --tp-size N: ranks 1..N-1 as child processes on this one's flags."""
    device = resolve_device(cfg.device)
    try:
        check_tensor_parallel(cfg, load_config(cfg.model_path), device)
    except ValueError as e:
        raise SystemExit(f"worker: {e}") from None

    def commands(store: str) -> list[list[str]]:
        ranks = (dataclasses.replace(cfg, tp_rank=r, tp_store=store) for r in range(1, cfg.tp_size))
        return [[sys.executable, "-m", "services.cli", "worker", *to_argv(c)] for c in ranks]

    log.info("tensor parallelism: starting ranks 1..%d", cfg.tp_size - 1)
    return Ranks.start(commands, {**os.environ, **secret_env(cfg)}, device, cfg.tp_timeout)


def thread_governor(cfg: WorkerConfig, runner: ModelRunner, threads: int) -> ThreadGovernor | None:
    if cfg.cpu_wait != "adaptive" or runner.device.type != "cpu":
        return None
    governor = ThreadGovernor(threads, torch.set_num_threads)
    return governor if governor.enabled else None


def start_health_server(
    host: str, port: int, tls: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, int]:
    """grpc.health.v1 + reflection (``tls`` None: plaintext)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    add_health_and_reflection(server, [])
    bound = bind(server, host, port, "worker gRPC (--worker-grpc-port)", tls)
    server.start()
    return server, bound


def forward_span(batch: engine_pb2.ForwardBatch) -> trace.Span | None:
    """One span per batch: child of its first request's phase span, linked to all of them."""
    if not tracing.enabled() or not batch.trace_context:
        return None
    links = [link for tp in batch.trace_links if (link := tracing.link_to({"traceparent": tp}))]
    new_tokens = sum(len(r.input_ids) // 4 for r in batch.reqs)
    return _tracer.start_span(
        "forward",
        context=tracing.context_from(batch.trace_context),
        links=links,
        attributes={
            "radixserve.batch_size": len(batch.reqs),
            "radixserve.new_tokens": new_tokens,
            "radixserve.is_decode": batch.is_decode,
        },
    )


def handle(
    runner: ModelRunner, msg: engine_pb2.SchedulerToWorker, instance: str
) -> engine_pb2.WorkerToScheduler:
    if msg.HasField("info"):
        return engine_pb2.WorkerToScheduler(info=wire.encode_info(runner.info(), instance))
    batch = msg.forward
    t0 = time.perf_counter()
    span = forward_span(batch)
    try:
        result = wire.forward(runner, batch)
    except Exception as e:  # a bad batch fails its requests, not the worker
        log.error("forward batch %d failed: %s\n%s", batch.batch_id, e, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        result = engine_pb2.ForwardResult(batch_id=batch.batch_id, error=error)
    if not result.forward_time:
        result.forward_time = time.perf_counter() - t0
    result.worker_instance = instance
    if span is not None:
        span.set_attribute("radixserve.cuda_graph", result.cuda_graph)
        span.end()
    return engine_pb2.WorkerToScheduler(result=result)


def main(cfg: WorkerConfig) -> None:
    if cfg.tp_rank:  # ranks 1..N-1, started by rank 0 below
        from services.worker.parallel.follower import follow

        setup_logging(cfg.log_level, f"worker rank {cfg.tp_rank}")
        return follow(cfg)
    setup_logging(cfg.log_level, "worker")
    tracing.setup_tracing("radixserve-worker", cfg.otlp_traces_endpoint)
    if not cfg.worker_addr:
        raise SystemExit("worker: --worker-addr is required")
    keys = load_keys(cfg.internal_keys_dir)
    try:
        check_link(cfg.worker_addr, keys, cfg.insecure_internal, "--worker-addr")
    except InsecureLink as e:
        raise SystemExit(f"worker: {e}") from None
    ranks = start_ranks(cfg) if cfg.tp_size > 1 else None  # before this rank's threads
    try:
        run(cfg, keys, ranks)
    finally:
        if ranks is not None:
            ranks.stop()


def run(cfg: WorkerConfig, keys: InternalKeys | None, ranks: Ranks | None) -> None:
    threads = set_cpu_threads(cfg.cpu_threads, cfg.tp_size)
    runner = ModelRunner(cfg, ranks.group if ranks else None)
    governor = thread_governor(cfg, runner, threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ctx = zmq.Context()
    admit_scheduler, _ = serve_securely(ctx, keys, "worker", ["scheduler"])
    sock = transport.router(ctx, cfg.worker_addr, setup=admit_scheduler)
    tls = server_credentials(cfg.control_ssl_certfile, cfg.control_ssl_keyfile)
    server, port = start_health_server(cfg.host, cfg.worker_grpc_port, tls)
    metrics = WorkerMetrics(runner.info().model_id) if cfg.enable_metrics else None
    if metrics is not None:
        metrics.watch_tiers(runner.host_pool)
    if metrics and runner.device.type == "cpu":
        metrics.cpu_threads.labels(metrics.model_name).set(threads)
    where = f"gRPC health on {cfg.host}:{port}"
    if metrics:
        where += f", metrics on {cfg.host}:{metrics.serve(cfg.host, cfg.metrics_port)}"
    _log_ready(cfg, runner.info(), where)
    try:
        serve(sock, runner, metrics, stop, cfg.shutdown_grace_period, governor)
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop_ranks()
        server.stop(grace=None)
        ctx.destroy(linger=0)
        tracing.shutdown()


class Session:
    """Whose batches the worker runs: the scheduler that said hello last. Frames still
    queued from an older one are dropped, so they cannot write KV slots the new one owns."""

    def __init__(self, runner: ModelRunner, drops: transport.DropLog):
        self.runner, self.drops = runner, drops
        self.scheduler: bytes | None = None

    def admits(self, identity: bytes, msg: engine_pb2.SchedulerToWorker) -> bool:
        if msg.HasField("info"):
            if identity != self.scheduler:
                if self.scheduler is not None:
                    log.info("worker: a new scheduler said hello; request state reset")
                self.scheduler = identity
                self.runner.forget_requests()
            return True
        if identity != self.scheduler:
            self.drops.note("a batch from a peer that is not the current scheduler")
            return False
        return True


def serve(
    sock: zmq.Socket,
    runner: ModelRunner,
    metrics: WorkerMetrics | None,
    stop: threading.Event,
    grace_s: float = 30.0,
    governor: ThreadGovernor | None = None,
) -> None:
    """Answers the scheduler until SIGTERM, then while it drains (DRAIN_IDLE_S, ``grace_s``)."""
    # The scheduler notices a restarted worker (an empty KV pool) by its instance id.
    instance = uuid.uuid4().hex
    drops = transport.DropLog("worker socket")
    session = Session(runner, drops)
    last_msg = time.monotonic()
    stop_at = 0.0
    while not _drained(stop, last_msg, stop_at):
        if stop.is_set() and not stop_at:
            stop_at = time.monotonic() + grace_s
            last_msg = time.monotonic()
            log.info("worker: SIGTERM; serving the scheduler's drain for up to %g s", grace_s)
        if not sock.poll(POLL_MS):
            runner.ping_ranks()
            continue
        try:
            identity, msg = transport.recv_routed(sock, engine_pb2.SchedulerToWorker)
        except transport.BadFrame as e:
            drops.note(e)
            continue
        if not (msg.HasField("info") or msg.HasField("forward")):
            drops.note("a SchedulerToWorker with no message set")
            continue
        if not session.admits(identity, msg):
            continue
        last_msg = time.monotonic()
        if governor and msg.HasField("forward"):
            governor.before(batch_rows(msg.forward))
        reply = handle(runner, msg, instance)
        if governor and reply.HasField("result"):
            governor.after()
            if metrics:
                metrics.cpu_threads.labels(metrics.model_name).set(governor.threads)
        if metrics and reply.HasField("result"):
            metrics.observe(msg.forward, reply.result)
        try:
            transport.send(sock, reply, identity)
        except zmq.ZMQError as e:  # the scheduler went away (kill -9): serve the next one
            log.warning("worker: reply to a scheduler that is gone dropped (%s)", e)


def batch_rows(batch: engine_pb2.ForwardBatch) -> int:
    """Query rows the forward runs: one KV slot each (int32 each), drafts included."""
    return sum(len(r.out_slots) for r in batch.reqs) // 4


def _drained(stop: threading.Event, last_msg: float, stop_at: float) -> bool:
    if not stop_at:
        return False
    now = time.monotonic()
    return now >= stop_at or now - last_msg >= DRAIN_IDLE_S


def _log_ready(cfg: WorkerConfig, info: RunnerInfo, where: str) -> None:
    log.info(
        "worker: ZeroMQ on %s, %s; %s (%s, %s, %s attention), pool %d tokens",
        cfg.worker_addr,
        where,
        info.model_id,
        info.device,
        info.dtype,
        info.attention_backend,
        info.max_total_num_tokens,
    )
