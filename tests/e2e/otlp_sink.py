"""An in-process OTLP/gRPC trace collector (the receiver side of TraceService) for tests."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    links: list[str]  # span ids this span links to
    attributes: dict


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                service = attrs.get("service.name", "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            ReceivedSpan(
                                service=service,
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                links=[ln.span_id.hex() for ln in s.links],
                                attributes={a.key: _value(a.value) for a in s.attributes},
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.stop(grace=None)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None
