"""The public gRPC service radixserve.v1.Generation (grpc.aio), a thin shell over Frontend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc
from services.frontend.key_limits import RETRY_AFTER_S, KeyBusy, KeyConcurrency, metadata_token
from services.frontend.pipeline import Frontend, FrontendError
from services.frontend.spans import carrier_from

_T = TypeVar("_T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, key_limits: KeyConcurrency | None = None) -> None:
        self._fe = frontend
        self._limits = key_limits or KeyConcurrency()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        metadata = context.invocation_metadata() or ()
        try:
            # Held until the stream ends, however: a cancel raises CancelledError here too.
            with self._limits.hold(metadata_token(metadata)):
                async for resp in self._fe.generate(request, carrier_from(metadata)):
                    yield resp
        except KeyBusy as e:
            retry = (("retry-after", str(RETRY_AFTER_S)),)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry)
        except FrontendError as e:
            trailer = (("retry-after", f"{e.retry_after:g}"),) if e.retry_after > 0 else ()
            await context.abort(e.code, e.message, trailing_metadata=trailer)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await _unary(context, lambda: self._fe.tokenize(request), in_thread=True)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return await _unary(context, self._fe.model_info)

    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        return await self._fe.flush_cache(storage=request.storage)


async def _unary(
    context: grpc.aio.ServicerContext, call: Callable[[], _T], in_thread: bool = False
) -> _T:
    """The answer of ``call``, or its FrontendError as the call's gRPC status."""
    try:
        return await asyncio.to_thread(call) if in_thread else call()
    except FrontendError as e:
        await context.abort(e.code, e.message)
        raise  # not reached: abort raises, but its stub does not say so


def add_generation_servicer(
    server: grpc.aio.Server, frontend: Frontend, key_limits: KeyConcurrency | None = None
) -> None:
    servicer = GenerationServicer(frontend, key_limits)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
