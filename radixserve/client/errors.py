"""The client's exceptions: one per gRPC status a caller may want to catch, plus
StructuredOutputError for an answer that does not parse as the requested structure."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from radixserve.client.types import Completion


class RadixServeError(Exception):
    """A failed call. ``code`` is the gRPC status (None for errors raised by the client
    itself), ``message`` the server's text, unchanged."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{code.name}: {message}" if code is not None else message)
        self.message = message
        self.code = code


class InvalidArgument(RadixServeError):
    """The server refused the request: a field out of range, a bad schema, regex or
    grammar (the message is the validator's or the grammar compiler's)."""


class Unauthenticated(RadixServeError):
    """No API key, or a wrong one."""


class PermissionDenied(RadixServeError):
    """The key is valid but not allowed to do this."""


class NotFound(RadixServeError):
    """The server does not know what was asked for."""


class AlreadyExists(RadixServeError):
    """A request with the same request_id is already in flight."""


class ResourceExhausted(RadixServeError):
    """The server is full (queue, KV pool or rate limit); try again later."""


class FailedPrecondition(RadixServeError):
    """The server is not in a state to do this now."""


class Unavailable(RadixServeError):
    """The server (or a service behind it) cannot be reached."""


class DeadlineExceeded(RadixServeError):
    """The call's timeout passed before the answer was complete."""


class Cancelled(RadixServeError):
    """The call was cancelled."""


class InternalError(RadixServeError):
    """The server failed; the message says where."""


class StructuredOutputError(RadixServeError):
    """The generated text does not parse as the requested structure.

    With constrained decoding this happens when the generation stopped early: ``finish_reason``
    "length" (max_tokens or the context ran out) or "abort". The client never retries; the
    whole answer is in ``completion``.
    """

    def __init__(self, message: str, completion: Completion[None]) -> None:
        super().__init__(message)
        self.completion = completion


_BY_CODE: dict[grpc.StatusCode, type[RadixServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
}


def from_rpc_error(err: grpc.RpcError) -> RadixServeError:
    """The exception for a failed gRPC call (sync or grpc.aio), keeping its code and text."""
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    message = (details_fn() if callable(details_fn) else None) or str(err)
    return _BY_CODE.get(code, RadixServeError)(message, code)
