"""Prometheus metrics of the frontend: requests, token counts, latency as clients see it.

Names carry SGLang's suffixes so its dashboards port over. Each frontend owns its registry,
so two frontends in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Sized

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from radixserve.v1 import generation_pb2 as pb
from services.frontend.cache_events import RESYNC_REASONS
from services.frontend.router import CACHE_AWARE_BRANCHES

TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TOKEN_GAP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
P = "radixserve:"


FINISH_REASONS = ("stop", "length", "abort")
REFUSAL_REASONS = ("key_concurrency",)
ERROR_CODES = (
    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED",
    "INTERNAL", "UNAUTHENTICATED", "PERMISSION_DENIED", "ALREADY_EXISTS",
)  # fmt: skip


class FrontendMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        names = list(labels)
        self.requests = Counter(
            P + "frontend_requests", "Finished requests", [*names, "finish_reason"], registry=r
        )
        self.errors = Counter(
            P + "frontend_errors",
            "Requests that ended with a gRPC error",
            [*names, "code"],
            registry=r,
        )
        self.refused = Counter(
            P + "frontend_refused_requests",
            "Requests the frontend refused before routing them, by why: key_concurrency "
            "(--max-concurrent-requests-per-key)",
            [*names, "reason"],
            registry=r,
        )
        self.labels = labels
        # Every series exists from the start, so dashboards read zero rather than "no data".
        for reason in FINISH_REASONS:
            self.requests.labels(**labels, finish_reason=reason)
        for code in ERROR_CODES:
            self.errors.labels(**labels, code=code)
        for reason in REFUSAL_REASONS:
            self.refused.labels(**labels, reason=reason)

        def counter(name: str, doc: str):
            return Counter(P + name, doc, names, registry=r).labels(**labels)

        def hist(name: str, doc: str, buckets):
            return Histogram(P + name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self.prompt_tokens = counter("frontend_prompt_tokens", "Prompt tokens of finished requests")
        self.cached_tokens = counter(
            "frontend_cached_tokens", "Prompt tokens reused from the radix cache"
        )
        self.completion_tokens = counter("frontend_completion_tokens", "Tokens streamed to clients")
        self.ttft = hist(
            "time_to_first_token_seconds",
            "Arrival at the frontend to the first token",
            TIME_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Gap between streamed messages, per token",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Arrival at the frontend to the last message",
            TIME_BUCKETS,
        )
        self.routing = RoutingMetrics(r, labels)

    def serve(self, host: str, port: int) -> int:
        """Starts /metrics on host:port (0: a free port); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def on_tokens(self, n_tokens: int, since_arrival: float, gap: float | None) -> None:
        """A message with ``n_tokens`` new tokens; ``gap`` is the time since the previous one."""
        if gap is None:
            self.ttft.observe(since_arrival)
        elif n_tokens:
            self.itl.observe(gap / n_tokens)

    def on_finish(self, final: pb.GenerateResponse) -> None:
        self.requests.labels(**self.labels, finish_reason=final.finish_reason).inc()
        self.prompt_tokens.inc(final.prompt_tokens)
        self.cached_tokens.inc(final.cached_tokens)
        self.completion_tokens.inc(final.completion_tokens)
        self.e2e.observe(final.timings.total_time)

    def on_error(self, code_name: str) -> None:
        self.errors.labels(**self.labels, code=code_name).inc()

    def on_refused(self, reason: str) -> None:
        self.refused.labels(**self.labels, reason=reason).inc()


class RoutingMetrics:
    """Routing decisions and the engines' cache indexes as one frontend sees them."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        r, names, self.labels = registry, list(labels), labels
        self.decisions = Counter(
            P + "frontend_routing_decisions",
            "Requests routed, by what decided: cache_hit, balance, fallback (cache_aware), "
            "or the policy's name",
            [*names, "branch"],
            registry=r,
        )
        self.indexed_keys = Gauge(
            P + "frontend_cache_index_keys",
            "Block keys of an engine's radix tree known from its cache events",
            [*names, "engine"],
            registry=r,
        )
        self.resyncs = Counter(
            P + "frontend_cache_resyncs",
            "Cache snapshots taken of an engine, by why: connect, restart, gap",
            [*names, "reason"],
            registry=r,
        )
        for branch in CACHE_AWARE_BRANCHES:
            self.decisions.labels(**labels, branch=branch)
        for reason in RESYNC_REASONS:
            self.resyncs.labels(**labels, reason=reason)

    def on_decision(self, branch: str) -> None:
        self.decisions.labels(**self.labels, branch=branch).inc()

    def on_resync(self, reason: str) -> None:
        self.resyncs.labels(**self.labels, reason=reason).inc()

    def track_index(self, engine: str, index: Sized) -> None:
        """The engine's key count, read at each scrape."""
        self.indexed_keys.labels(**self.labels, engine=engine).set_function(lambda: len(index))

    def untrack_index(self, engine: str) -> None:
        try:
            self.indexed_keys.remove(*self.labels.values(), engine)
        except KeyError:  # never tracked
            pass
