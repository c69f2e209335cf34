"""Bearer keys on gRPC servers: the public API (grpc.aio) and the control service (grpc.server).

Every method but the health service needs ``authorization: Bearer <key>``; a missing or wrong
key (compared in constant time) ends the call UNAUTHENTICATED before its request is parsed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def bearer_matches(header: str | bytes | None, key: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <key>`` (constant time in the key)."""
    if not header:
        return False
    raw = header.encode("utf-8", "replace") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key.encode())


@dataclass(frozen=True)
class MethodKeys:
    """Which key each RPC needs: ``admin_key`` for ``admin_methods`` (``key`` when empty),
    ``key`` for the rest, nothing for the health service or when the key is empty."""

    key: str
    admin_key: str = field(default="", repr=False)
    admin_methods: frozenset[str] = frozenset()

    def __repr__(self) -> str:  # never a key in a log line
        return f"MethodKeys(admin_methods={sorted(self.admin_methods)})"

    def key_for(self, method: str) -> str:
        if method.startswith(HEALTH_PREFIX):
            return ""
        if method in self.admin_methods:
            return self.admin_key or self.key
        return self.key

    def refusal(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """Why the call may not run (None: it may)."""
        key = self.key_for(method)
        if not key:
            return None
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            return f"{method}: missing API key: send metadata 'authorization: Bearer <key>'"
        if not bearer_matches(header, key):
            return f"{method}: invalid API key"
        return None


def _deny_handler(
    handler: grpc.RpcMethodHandler, behaviour: Callable[..., Any]
) -> grpc.RpcMethodHandler:
    """``handler``'s kind running ``behaviour``, requests left as raw bytes (never parsed)."""
    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, None, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, None, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, None, serializer)
    return grpc.unary_unary_rpc_method_handler(behaviour, None, serializer)


class BearerInterceptor(grpc.ServerInterceptor):
    """For ``grpc.server`` (threads): the scheduler's control service."""

    def __init__(self, keys: MethodKeys) -> None:
        self._keys = keys

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        why = self._keys.refusal(
            handler_call_details.method, handler_call_details.invocation_metadata
        )
        if handler is None or why is None:
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return _deny_handler(handler, deny)


class AioBearerInterceptor(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server``: the frontend's public API."""

    def __init__(self, keys: MethodKeys) -> None:
        self._keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        why = self._keys.refusal(
            handler_call_details.method, handler_call_details.invocation_metadata
        )
        if handler is None or why is None:
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return _deny_handler(handler, deny)


class _SendToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = [*(client_call_details.metadata or ()), self._pair]
        return await continuation(client_call_details._replace(metadata=metadata), request)


def aio_channel(
    target: str,
    token: str = "",
    options: Sequence[tuple[str, Any]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel whose unary calls carry ``token`` (if any) as bearer metadata;
    plaintext unless ``credentials`` (TLS, which keeps the token off the wire)."""
    interceptors = [_SendToken(token)] if token else None
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
