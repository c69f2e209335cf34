"""OpenTelemetry set-up shared by the three services, and W3C context propagation.

Off unless ``--otlp-traces-endpoint`` is given. The context crosses processes in a map of the
internal messages, so a request's spans share one trace id; ``enabled()`` is the one check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

_enabled = False


def setup_tracing(service_name: str, endpoint: str) -> bool:
    """Installs an OTLP/gRPC exporter when ``endpoint`` is set; returns whether tracing is on."""
    global _enabled
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint.removeprefix("http://"), insecure=insecure)
    # Short delay: a request's spans reach Jaeger within a fraction of a second.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def shutdown() -> None:
    """Flushes spans still buffered (called on a clean exit)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from(carrier: Mapping[str, str]) -> otel_context.Context:
    """The remote parent context carried in a protobuf map (traceparent, tracestate)."""
    return extract(dict(carrier))


def carrier_of(span: trace.Span | None = None) -> dict[str, str]:
    """A W3C carrier for ``span`` (or the current span) to put into a protobuf map."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    inject(carrier, context=ctx)
    return carrier


def link_to(carrier: Mapping[str, str]) -> trace.Link | None:
    """A span link to the span a carrier names (None when the carrier is empty)."""
    span_ctx = trace.get_current_span(context_from(carrier)).get_span_context()
    return trace.Link(span_ctx) if span_ctx.is_valid else None
