"""The frontend's spans of one request: ``generate`` and its children.

``generate`` is a child of the caller's W3C context, if any; its context rides in
TokenizedRequest.trace_context so the engine's spans join the trace. No-ops when tracing is off.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from radixserve.v1 import generation_pb2 as pb
from services.common import tracing

_tracer = tracing.tracer("radixserve.frontend")
TRACE_KEYS = ("traceparent", "tracestate")


def carrier_from(pairs) -> dict[str, str]:
    """The W3C keys among (key, value) pairs: gRPC metadata or HTTP headers."""
    return {k.lower(): v for k, v in pairs if k.lower() in TRACE_KEYS}


class RequestSpan:
    def __init__(self, model_id: str, caller: Mapping[str, str] | None = None) -> None:
        self._span: trace.Span | None = None
        if tracing.enabled():
            self._span = _tracer.start_span(
                "generate",
                context=tracing.context_from(caller or {}),
                kind=SpanKind.SERVER,
                attributes={
                    "gen_ai.request.model": model_id,
                    "gen_ai.system": "radixserve",
                    "gen_ai.operation.name": "text_completion",
                },
            )

    @contextmanager
    def child(self, name: str) -> Iterator[None]:
        if self._span is None:
            yield
            return
        span = _tracer.start_span(name, context=trace.set_span_in_context(self._span))
        try:
            yield
        finally:
            span.end()

    def carrier(self) -> dict[str, str]:
        """What the scheduler needs to parent its spans under ``generate``."""
        return tracing.carrier_of(self._span) if self._span is not None else {}

    def finish(self, rid: str, final: pb.GenerateResponse | None, error: str = "") -> None:
        if self._span is None:
            return
        self._span.set_attribute("radixserve.request_id", rid)
        if final is not None:
            self._span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": final.prompt_tokens,
                    "gen_ai.usage.output_tokens": final.completion_tokens,
                    "radixserve.cached_tokens": final.cached_tokens,
                    "gen_ai.response.finish_reasons": [final.finish_reason],
                }
            )
        if error:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()
        self._span = None
