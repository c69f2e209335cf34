"""Per-request spans in the scheduler: queue -> prefill -> decode, children of the frontend's span.
Live spans, so the worker's ``forward`` spans can name them as parent or link.
"""

from __future__ import annotations

import time

from services.common import tracing
from services.scheduler.request import Req

_tracer = tracing.tracer("radixserve.scheduler")


def _ns(t: float) -> int:
    return int(t * 1e9)


def _start(req: Req, name: str, start: float | None = None) -> None:
    parent = tracing.context_from(req.trace_context)
    attrs = {"radixserve.request_id": req.rid}
    span = _tracer.start_span(
        name, context=parent, start_time=_ns(start or time.time()), attributes=attrs
    )
    req.spans["phase"] = span


def _end(req: Req, **attrs) -> None:
    span = req.spans.pop("phase", None)
    if span is not None:
        span.set_attributes(attrs)
        span.end()


def on_arrival(req: Req) -> None:
    if tracing.enabled():
        _start(req, "queue", req.arrival_time)


def on_scheduled(req: Req) -> None:
    if tracing.enabled():
        _end(req, **{"gen_ai.usage.input_tokens": len(req.input_ids)})
        _start(req, "prefill", req.first_scheduled)
        req.spans["chunks"] = 0


def on_prefill_chunk(req: Req, new_tokens: int) -> None:
    span = req.spans.get("phase") if tracing.enabled() else None
    if span is not None:
        index = req.spans["chunks"] = req.spans.get("chunks", 0) + 1
        span.add_event(
            "chunk", {"radixserve.chunk_index": index - 1, "radixserve.new_tokens": new_tokens}
        )


def on_first_token(req: Req) -> None:
    if tracing.enabled():
        _end(
            req,
            **{
                "radixserve.cached_tokens": max(req.cached_tokens, 0),
                "radixserve.new_tokens": len(req.input_ids) - max(req.cached_tokens, 0),
                "radixserve.chunks": req.spans.get("chunks", 0),
            },
        )
        _start(req, "decode", req.first_token_time)


def on_finish(req: Req) -> None:
    if tracing.enabled():
        _end(
            req,
            **{
                "gen_ai.usage.output_tokens": len(req.output_ids),
                "gen_ai.response.finish_reasons": [req.finish_reason],
            },
        )


def traceparent(req: Req) -> str:
    """The W3C traceparent of the request's current phase span ('' when none)."""
    span = req.spans.get("phase")
    return tracing.carrier_of(span).get("traceparent", "") if span is not None else ""


def batch_context(reqs: list[Req]) -> tuple[dict[str, str], list[str]]:
    """(parent carrier, link traceparents) for a forward batch serving ``reqs``."""
    if not tracing.enabled():
        return {}, []
    links = [tp for tp in (traceparent(r) for r in reqs) if tp]
    return ({"traceparent": links[0]} if links else {}), links
