"""The control service's requests parsed by us, not by grpc, so bad bytes get a clear
INVALID_ARGUMENT rather than grpc's INTERNAL (the twin of services/frontend/grpc_parse.py).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError


def _unary(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse, inner = handler.request_deserializer, handler.unary_unary
    kind = getattr(getattr(parse, "__self__", None), "__name__", "request")

    def call(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = parse(raw)
        except (DecodeError, UnicodeDecodeError, ValueError, RuntimeError) as e:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request is not a well-formed {kind}: {e}",
            )
        return inner(request, context)

    return grpc.unary_unary_rpc_method_handler(call, None, handler.response_serializer)


class ParseControlRequests(grpc.ServerInterceptor):
    """Parses unary requests itself (see the module's docstring); health included."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if (
            handler is None
            or handler.request_streaming
            or handler.response_streaming
            or handler.request_deserializer is None
        ):
            return handler
        return _unary(handler, handler_call_details.method)
