"""AsyncClient: the asyncio client (grpc.aio), the same surface as Client with awaits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack, overload

import grpc
import grpc.aio

from radixserve.client.connection import CallSettings, channel_options
from radixserve.client.convert import (
    chunk_from_pb,
    completion_from_chunks,
    flush_from_pb,
    model_info_from_pb,
    tokens_from_pb,
)
from radixserve.client.errors import from_rpc_error
from radixserve.client.requests import GenerateOptions, Prompt, generate_request, tokenize_request
from radixserve.client.structured import OutputSpec, output_spec, parse_completion
from radixserve.client.types import Chunk, Completion, FlushResult, ModelInfo, Tokens
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

T = TypeVar("T")


class AsyncClient:
    """Like Client, for asyncio: ``async with AsyncClient("host:30000") as c: await
    c.generate(...)``; ``async for chunk in c.stream(...)``. Create it inside the event loop
    that uses it (grpc.aio channels belong to one loop)."""

    def __init__(
        self,
        target: str = "localhost:30000",
        *,
        api_key: str | None = None,
        metadata: Mapping[str, str] | Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_args: Sequence[tuple[str, object]] = (),
    ) -> None:
        opts = channel_options(channel_args)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=opts)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=opts)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call = CallSettings.of(api_key, metadata, timeout)

    @overload
    async def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion[None]: ...
    @overload
    async def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: type[T] | OutputSpec[T],
        **options: Unpack[GenerateOptions],
    ) -> Completion[T]: ...
    @overload
    async def generate(
        self, prompt: Prompt, *, structured_output: object, **options: Unpack[GenerateOptions]
    ) -> Completion[Any]: ...

    async def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: object = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion[Any]:
        """See Client.generate."""
        spec = None if structured_output is None else output_spec(structured_output)
        chunks = [c async for c in self._stream(prompt, spec, options)]
        completion = completion_from_chunks(chunks)
        return completion if spec is None else parse_completion(spec, completion)

    def stream(
        self,
        prompt: Prompt,
        *,
        structured_output: object = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[Chunk]:
        """See Client.stream: ``async for chunk in client.stream(...)``."""
        spec = None if structured_output is None else output_spec(structured_output)
        return self._stream(prompt, spec, options)

    async def tokenize(
        self, prompt: str | Sequence[Mapping[str, str]], *, timeout: float | None = None
    ) -> Tokens:
        req = tokenize_request(prompt)
        return tokens_from_pb(await self._unary(self._stub.Tokenize, req, timeout))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        req = pb.GetModelInfoRequest()
        return model_info_from_pb(await self._unary(self._stub.GetModelInfo, req, timeout))

    async def flush_cache(self, *, timeout: float | None = None) -> FlushResult:
        req = pb.FlushCacheRequest()
        return flush_from_pb(await self._unary(self._stub.FlushCache, req, timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _stream(
        self, prompt: Prompt, spec: OutputSpec[Any] | None, options: GenerateOptions
    ) -> AsyncIterator[Chunk]:
        req = generate_request(prompt, spec, options)  # misuse raises here, not at first await
        timeout = self._call.timeout_for(options.get("timeout"))
        call = self._stub.Generate(req, timeout=timeout, metadata=self._call.metadata)
        return _chunks(call)

    async def _unary(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            t = self._call.timeout_for(timeout)
            return await method(req, timeout=t, metadata=self._call.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e


async def _chunks(call: Any) -> AsyncIterator[Chunk]:
    try:
        async for msg in call:
            yield chunk_from_pb(msg)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from e
    finally:
        call.cancel()
