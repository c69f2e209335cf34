"""Requests of the public gRPC service parsed by us, not by grpc, so bad bytes get a clear
INVALID_ARGUMENT naming the method and message type (grpc's own parse failure, e.g. invalid
UTF-8 in a string, is a bare error naming a Python exception).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.frontend.server import SERVICE_NAME

_PREFIX = f"/{SERVICE_NAME}/"


async def _parse_or_abort(
    parse: Callable[[bytes], Any], raw: bytes, method: str, context: grpc.aio.ServicerContext
) -> Any:
    try:
        return parse(raw)
    except (DecodeError, UnicodeDecodeError, ValueError, RuntimeError) as e:
        kind = getattr(getattr(parse, "__self__", None), "__name__", "request")
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a well-formed {kind} (every string field must be "
            f"valid UTF-8): {e}",
        )


def _unary(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse, inner = handler.request_deserializer, handler.unary_unary

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await inner(await _parse_or_abort(parse, raw, method, context), context)

    return grpc.unary_unary_rpc_method_handler(call, None, handler.response_serializer)


def _stream(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse, inner = handler.request_deserializer, handler.unary_stream

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        responses = inner(await _parse_or_abort(parse, raw, method, context), context)
        assert inspect.isasyncgen(responses)  # the Generation servicer yields its answers
        try:
            async for response in responses:
                yield response
        finally:  # a cancelled call closes the servicer's stream now (its abort runs)
            await responses.aclose()

    return grpc.unary_stream_rpc_method_handler(call, None, handler.response_serializer)


class ParseRequests(grpc.aio.ServerInterceptor):
    """Parses the Generation service's requests itself (see the module's docstring)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (
            handler is None
            or not method.startswith(_PREFIX)
            or handler.request_streaming
            or handler.request_deserializer is None
        ):
            return handler
        if handler.response_streaming:
            return _stream(handler, method)
        return _unary(handler, method)
