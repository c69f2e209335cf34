"""One request through the three real processes makes one trace with spans from all three."""

from __future__ import annotations

import time

import pytest

from tests.e2e.otlp_sink import OtlpSink
from tests.server_util import Server, greedy

pytestmark = pytest.mark.slow


def test_one_trace_spans_all_three_services():
    sink = OtlpSink()
    try:
        with Server("--otlp-traces-endpoint", sink.endpoint) as s:
            _, _, last = s.generate(
                text="Beautiful is better than", sampling=greedy(4), request_id="traced-1"
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                names = {(sp.service, sp.name) for sp in sink.snapshot()}
                if {
                    ("radixserve-worker", "forward"),
                    ("radixserve-scheduler", "decode"),
                    ("radixserve-frontend", "generate"),
                } <= names:
                    break
                time.sleep(0.2)
        spans = sink.snapshot()
    finally:
        sink.close()
    root = next(sp for sp in spans if sp.name == "generate" and sp.service == "radixserve-frontend")
    mine = [sp for sp in spans if sp.trace_id == root.trace_id]
    by_id = {sp.span_id: sp for sp in mine}
    assert {sp.service for sp in mine} == {
        "radixserve-frontend",
        "radixserve-scheduler",
        "radixserve-worker",
    }
    assert root.parent_id == ""  # no caller context: the frontend's span is the root
    for name in ("tokenize", "stream", "queue", "prefill", "decode"):
        assert any(sp.name == name for sp in mine), f"no {name} span"
    for sp in mine:
        if sp.name in ("tokenize", "stream", "queue", "prefill", "decode"):
            assert by_id[sp.parent_id] is root, f"{sp.name} is not a child of generate"
    forwards = [sp for sp in mine if sp.name == "forward"]
    assert len(forwards) >= 4  # one prefill batch + decode steps
    for sp in forwards:
        parent = by_id[sp.parent_id]
        assert parent.name in ("prefill", "decode") and sp.links == [parent.span_id]
    assert root.attributes["gen_ai.request.model"]
    assert root.attributes["gen_ai.usage.output_tokens"] == last.completion_tokens
    assert root.attributes["gen_ai.usage.input_tokens"] == last.prompt_tokens


def test_caller_trace_context_is_the_parent():
    """A client that sends W3C traceparent metadata gets radixserve's spans inside its trace."""
    from radixserve.v1 import generation_pb2

    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    sink = OtlpSink()
    try:
        with Server("--otlp-traces-endpoint", sink.endpoint) as s:
            req = generation_pb2.GenerateRequest(text="Flat is better", sampling=greedy(2))
            list(
                s.stub.Generate(
                    req, metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60
                )
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                sp.name == "decode" for sp in sink.snapshot()
            ):
                time.sleep(0.2)
        spans = sink.snapshot()
    finally:
        sink.close()
    root = next(sp for sp in spans if sp.name == "generate")
    assert (root.trace_id, root.parent_id) == (trace_id, parent)
    assert {sp.service for sp in spans if sp.trace_id == trace_id} == {
        "radixserve-frontend",
        "radixserve-scheduler",
        "radixserve-worker",
    }
