"""Prometheus metrics of the scheduler: cache hits, token counters, pool gauges, FLOPs.
Names carry SGLang's suffixes so its dashboards port over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from radixserve.internal.v1 import engine_pb2
from services.scheduler.flops import batch_cost

if TYPE_CHECKING:
    from services.scheduler.batch import Item
    from services.scheduler.request import Req

TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
P = "radixserve:"


class _Declare:
    """Declares metrics in one registry, labelled with model name and engine."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels, self.names = registry, labels, list(labels)

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(P + name, doc, self.names + list(extra), registry=self.registry)

    def labelled_counter(self, name: str, doc: str) -> Counter:
        return self.counter(name, doc).labels(**self.labels)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(P + name, doc, self.names, registry=self.registry).labels(**self.labels)

    def hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        h = Histogram(P + name, doc, self.names, buckets=buckets, registry=self.registry)
        return h.labels(**self.labels)


FINISH_REASONS = ("stop", "length", "abort")


class SchedulerMetrics:
    """All scheduler metrics; a disabled instance accepts every call and records nothing."""

    def __init__(
        self,
        model_name: str,
        engine: str,
        mfu: bool = False,
        registry: CollectorRegistry | None = None,
        enabled: bool = True,
    ):
        self.enabled, self.mfu = enabled, mfu and enabled
        if not enabled:
            return
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        d = _Declare(self.registry, self.labels)
        self._declare_counters(d)
        self._declare_gauges(d)
        if self.mfu:
            self._declare_mfu(d)

    def _declare_counters(self, d: _Declare) -> None:
        self.prompt_tokens = d.labelled_counter("prompt_tokens", "Prompt tokens received")
        self.cached_tokens = d.labelled_counter(
            "cached_tokens", "Prompt tokens served from the radix cache"
        )
        self.generation_tokens = d.labelled_counter("generation_tokens", "Tokens generated")
        self.num_requests = d.counter("num_requests", "Finished requests", ("finish_reason",))
        for finish in FINISH_REASONS:  # each series reads 0, not "no data", from the start
            self.num_requests.labels(**self.labels, finish_reason=finish)
        self.num_retracted = d.labelled_counter(
            "num_retracted_requests", "Requests retracted to free KV"
        )
        self.prompt_hist = d.hist("prompt_tokens_histogram", "Prompt length", TOKEN_BUCKETS)
        self.uncached_hist = d.hist(
            "uncached_prompt_tokens_histogram", "Prompt tokens computed", TOKEN_BUCKETS
        )
        self.queue_time = d.hist("queue_time_seconds", "Arrival to first scheduled", TIME_BUCKETS)
        # Declared with both reasons, so a dashboard reads 0 before the first refusal.
        self.refused = d.counter(
            "refused_requests", "Requests refused by admission control", ("reason",)
        )
        for reason in ("overloaded", "queue_time"):
            self.refused.labels(**self.labels, reason=reason)
        # Speculative decoding, vLLM's names (acceptance rate = accepted / draft tokens).
        self.spec_drafts = d.labelled_counter(
            "spec_decode_num_drafts", "Request steps that verified drafts (speculative decoding)"
        )
        self.spec_draft_tokens = d.labelled_counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.spec_accepted_tokens = d.labelled_counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.spec_steps = d.labelled_counter(
            "spec_decode_num_verify_steps", "Forward batches that verified drafts"
        )
        self.spec_declined = d.labelled_counter(
            "spec_decode_num_declined_steps",
            "Decode steps run plain although requests were due to draft (--speculative-gate)",
        )

    def _declare_gauges(self, d: _Declare) -> None:
        self.running = d.gauge("num_running_reqs", "Requests in the running batch")
        self.queued = d.gauge("num_queue_reqs", "Requests waiting")
        self.token_usage = d.gauge(
            "token_usage", "Share of the KV pool in use (not free, not evictable)"
        )
        self.hit_rate = d.gauge(
            "cache_hit_rate", "Cached share of the prompt tokens of the last prefill batch"
        )
        self.available = d.gauge("kv_available_tokens", "Free KV slots (evictable not counted)")
        self.evictable = d.gauge("kv_evictable_tokens", "KV slots held by unlocked tree nodes")
        self.used = d.gauge("kv_used_tokens", "KV slots held by running requests")
        self.max_total = d.gauge("max_total_num_tokens", "KV pool size in tokens")
        self.page_size = d.gauge("page_size", "Radix cache page size")
        self.host_total = d.gauge("hicache_host_total_tokens", "Host tier size in tokens")
        self.host_used = d.gauge("hicache_host_used_tokens", "Host tier tokens holding KV")
        self.host_moved = d.counter(
            "hicache_tokens", "KV tokens moved between tiers", ("direction",)
        )
        self._host_seen = dict.fromkeys(
            ("device_to_host", "host_to_device", "dropped", "device_to_storage",
             "storage_to_host", "storage_miss"), 0
        )  # fmt: skip
        for direction in self._host_seen:
            self.host_moved.labels(**self.labels, direction=direction)
        self.load_failures = d.labelled_counter(
            "hicache_load_failures", "Storage loads lost with a failed batch (computed instead)"
        )
        self._failures_seen = 0

    def _declare_mfu(self, d: _Declare) -> None:
        self.flops = d.labelled_counter("estimated_flops", "Estimated FLOPs of forward batches")
        self.read_bytes = d.labelled_counter(
            "estimated_read_bytes", "Estimated bytes read (weights + KV)"
        )
        self.write_bytes = d.labelled_counter("estimated_write_bytes", "Estimated KV bytes written")

    @classmethod
    def disabled(cls) -> SchedulerMetrics:
        return cls("", "", enabled=False)

    def serve(self, host: str, port: int) -> int:
        """Starts /metrics on host:port (0: a free port); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    # -- events -----------------------------------------------------------------------
    def on_arrival(self, req: Req) -> None:
        if self.enabled:
            self.prompt_tokens.inc(len(req.input_ids))
            self.prompt_hist.observe(len(req.input_ids))

    def on_scheduled(self, req: Req) -> None:
        if self.enabled:
            self.cached_tokens.inc(req.cached_tokens)
            self.uncached_hist.observe(len(req.input_ids) - req.cached_tokens)
            self.queue_time.observe(max(0.0, req.first_scheduled - req.arrival_time))

    def on_refused(self, reason: str) -> None:
        """``reason``: "overloaded" (queue full, 429) or "queue_time" (waited too long)."""
        if self.enabled:
            self.refused.labels(**self.labels, reason=reason).inc()

    def on_verify(self, drafted: int, accepted: int) -> None:
        if self.enabled:
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted_tokens.inc(accepted)

    def on_declined_step(self) -> None:
        if self.enabled:
            self.spec_declined.inc()

    def on_retract(self) -> None:
        if self.enabled:
            self.num_retracted.inc()

    def on_finish(self, req: Req) -> None:
        if self.enabled:
            self.generation_tokens.inc(len(req.output_ids))
            self.num_requests.labels(**self.labels, finish_reason=req.finish_reason).inc()

    def on_prefill_batch(self, new_tokens: int, cached: int) -> None:
        if self.enabled:
            self.hit_rate.set(cached / max(1, cached + new_tokens))

    def on_batch(self, info: engine_pb2.WorkerInfo, items: list[Item]) -> None:
        if self.enabled and any(it.drafts for it in items):
            self.spec_steps.inc()
        if self.mfu:
            flops, read, write = batch_cost(info, [(it.start, it.n, it.sample) for it in items])
            self.flops.inc(flops)
            self.read_bytes.inc(read)
            self.write_bytes.inc(write)

    def update_gauges(self, s: engine_pb2.SchedulerStats) -> None:
        if not self.enabled:
            return
        self.running.set(s.num_running_reqs)
        self.queued.set(s.num_queue_reqs)
        self.token_usage.set(s.used_tokens / max(1, s.max_total_num_tokens))
        self.available.set(s.available_tokens)
        self.evictable.set(s.evictable_tokens)
        self.used.set(s.used_tokens)
        self.max_total.set(s.max_total_num_tokens)
        self.page_size.set(s.page_size)
        self.host_total.set(s.host_total_tokens)
        self.host_used.set(s.host_used_tokens)
        moved = {
            "device_to_host": s.host_demoted_tokens,
            "host_to_device": s.host_loaded_tokens,
            "dropped": s.host_dropped_tokens,
            "device_to_storage": s.storage_stored_tokens,
            "storage_to_host": s.storage_loaded_tokens,
            "storage_miss": s.storage_missed_tokens,
        }
        for direction, total in moved.items():
            # The tree keeps totals; a new tree (worker restart) starts them again at 0.
            new = (
                total - self._host_seen[direction] if total >= self._host_seen[direction] else total
            )
            if new:
                self.host_moved.labels(**self.labels, direction=direction).inc(new)
            self._host_seen[direction] = total
        failed, seen = s.storage_failed_loads, self._failures_seen
        if failed != seen:
            self.load_failures.inc(failed - seen if failed > seen else failed)
            self._failures_seen = failed
