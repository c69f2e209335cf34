"""Prometheus metrics of the worker: how long forward batches take and how big they are."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from radixserve.internal.v1 import engine_pb2
from services.worker.host_pool import D2H, D2S, H2D, S2H, HostPool

TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
P = "radixserve:"
MODES = ("prefill", "decode", "verify")  # verify: a batch with drafts (speculative decoding)


class WorkerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name", "mode"]
        r = self.registry
        self.model_name = model_name
        self.forward_time = Histogram(
            P + "forward_time_seconds",
            "Model forward + sampling per batch",
            labels,
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            P + "forward_batch_size",
            "Requests per forward batch",
            labels,
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            P + "forward_tokens", "Tokens computed by forward batches", labels, registry=r
        )
        self.cuda_graph = Counter(
            P + "cuda_graph_replays",
            "Decode batches replayed from a CUDA graph",
            ["model_name"],
            registry=r,
        )
        self.failures = Counter(
            P + "forward_failures", "Forward batches that failed", ["model_name"], registry=r
        )
        # Every series exists from the start at 0, so a dashboard panel reads zero, not
        # "no data", until the first batch of its kind.
        for mode in MODES:
            for family in (self.forward_time, self.batch_size, self.tokens):
                family.labels(model_name, mode)
        self.cuda_graph.labels(model_name)
        self.failures.labels(model_name)

        self.cpu_threads = Gauge(
            P + "worker_cpu_threads",
            "Torch threads a CPU worker runs now (--cpu-wait adaptive lowers it while other "
            "processes wait for the cores)",
            ["model_name"],
            registry=r,
        )

    def watch_tiers(self, host_pool: HostPool | None) -> None:
        """The hierarchical cache's copies and storage I/O, read at each scrape."""
        if host_pool is not None:
            self.registry.register(_TierCollector(self.model_name, host_pool))

    def serve(self, host: str, port: int) -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def observe(self, batch: engine_pb2.ForwardBatch, result: engine_pb2.ForwardResult) -> None:
        if result.error:
            self.failures.labels(self.model_name).inc()
            return
        drafts = sum(len(r.draft_tokens) // 4 for r in batch.reqs)
        mode = "decode" if batch.is_decode else "verify" if drafts else "prefill"
        self.forward_time.labels(self.model_name, mode).observe(result.forward_time)
        self.batch_size.labels(self.model_name, mode).observe(len(batch.reqs))
        self.tokens.labels(self.model_name, mode).inc(
            sum(len(r.input_ids) // 4 for r in batch.reqs) + drafts
        )
        if result.cuda_graph:
            self.cuda_graph.labels(self.model_name).inc()


DIRECTIONS = {D2H: "device_to_host", H2D: "host_to_device", D2S: "device_to_storage",
              S2H: "storage_to_host"}  # fmt: skip


class _TierCollector(Collector):
    """Totals the host pool and its page store keep; nothing is counted on the copy path."""

    def __init__(self, model_name: str, pool: HostPool):
        self.model_name, self.pool = model_name, pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["model_name", "direction"]
        moved = CounterMetricFamily(
            P + "hicache_copy_bytes", "Bytes copied between the KV tiers", labels=labels
        )
        seconds = CounterMetricFamily(
            P + "hicache_copy_seconds",
            "Seconds the worker spent issuing copies between the KV tiers (on CUDA, the "
            "host <-> device copies run on a stream of their own after that)",
            labels=labels,
        )
        for d, name in DIRECTIONS.items():
            moved.add_metric([self.model_name, name], self.pool.bytes_moved[d])
            seconds.add_metric([self.model_name, name], self.pool.seconds_moving[d])
        yield moved
        yield seconds
        if self.pool.store is not None:
            store = CounterMetricFamily(
                P + "hicache_storage_events",
                "The storage tier's pages written, read, missed, failed to write and found "
                "corrupt (deleted), bytes and seconds of its I/O",
                labels=["model_name", "event"],
            )
            for event, value in asdict(self.pool.store.counters).items():
                store.add_metric([self.model_name, event], value)
            yield store
