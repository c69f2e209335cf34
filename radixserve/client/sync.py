"""Client: the blocking client of radixserve's gRPC API (radixserve.v1.Generation)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack, overload

import grpc

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


class Client:
    """A connection to a radixserve frontend (``host:port``, default port 30000).

    ``api_key`` (default: env RADIXSERVE_API_KEY) is sent as ``authorization: Bearer <key>``;
    ``metadata`` rides on every call;
    ``timeout`` (seconds, None = no limit) bounds every call unless the call gives its own;
    ``credentials`` (``grpc.ssl_channel_credentials()``) switch the channel to TLS. Use it as
    a context manager, or call ``close()``.
    """

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
            grpc.secure_channel(target, credentials, options=opts)
            if credentials is not None
            else grpc.insecure_channel(target, options=opts)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call = CallSettings.of(api_key, metadata, timeout)

    @overload
    def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion[None]: ...
    @overload
    def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: type[T] | OutputSpec[T],
        **options: Unpack[GenerateOptions],
    ) -> Completion[T]: ...
    @overload
    def generate(
        self, prompt: Prompt, *, structured_output: object, **options: Unpack[GenerateOptions]
    ) -> Completion[Any]: ...

    def generate(
        self,
        prompt: Prompt,
        *,
        structured_output: object = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion[Any]:
        """Generates to the end. With ``structured_output`` the server constrains the output
        to its JSON Schema and ``.parsed`` holds the answer as that type (StructuredOutputError
        if it does not parse, e.g. cut off by max_tokens)."""
        spec = None if structured_output is None else output_spec(structured_output)
        completion = completion_from_chunks(self._stream(prompt, spec, options))
        return completion if spec is None else parse_completion(spec, completion)

    def stream(
        self,
        prompt: Prompt,
        *,
        structured_output: object = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Chunk]:
        """Yields the output as it is generated; the last chunk has finish_reason and usage.
        ``structured_output`` constrains the output as in ``generate``; join the chunks' text
        and call ``output_spec(spec).parse(text)`` for the typed value. Leaving the loop early
        cancels the request on the server."""
        spec = None if structured_output is None else output_spec(structured_output)
        return self._stream(prompt, spec, options)

    def tokenize(
        self, prompt: str | Sequence[Mapping[str, str]], *, timeout: float | None = None
    ) -> Tokens:
        """The served model's tokens of a text, or of a chat after its chat template."""
        req = tokenize_request(prompt)
        return tokens_from_pb(self._unary(self._stub.Tokenize, req, timeout))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_pb(
            self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        )

    def flush_cache(self, *, timeout: float | None = None) -> FlushResult:
        """Empties the server's radix cache; refused (flushed=False) while requests run."""
        return flush_from_pb(self._unary(self._stub.FlushCache, pb.FlushCacheRequest(), timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stream(
        self, prompt: Prompt, spec: OutputSpec[Any] | None, options: GenerateOptions
    ) -> Iterator[Chunk]:
        # The request is built (and misuse raised) here, before the first next().
        req = generate_request(prompt, spec, options)
        timeout = self._call.timeout_for(options.get("timeout"))
        call = self._stub.Generate(req, timeout=timeout, metadata=self._call.metadata)
        return _chunks(call)

    def _unary(self, method: Any, req: Any, timeout: float | None) -> Any:
        try:
            t = self._call.timeout_for(timeout)
            return method(req, timeout=t, metadata=self._call.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e


def _chunks(call: Any) -> Iterator[Chunk]:
    try:
        for msg in call:
            yield chunk_from_pb(msg)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from e
    finally:
        call.cancel()  # a no-op once finished; frees the server's work when the caller quits
