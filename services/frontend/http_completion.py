"""The one path every generating HTTP route takes: submit, then stream or answer whole.

A route turns its body into a GenerateRequest and picks a Renderer (the shape of its
answers); the request runs through the same Frontend pipeline as gRPC and is streamed as
server-sent events or collected into one JSON answer. With n samples, each has a Renderer
fork; the first Renderer closes the stream or combines the forks' answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from radixserve.v1 import generation_pb2 as pb
from services.frontend import sse
from services.frontend.openai_errors import ApiError, api_error
from services.frontend.pipeline import Frontend, FrontendError
from services.frontend.spans import carrier_from

Responses = AsyncGenerator[pb.GenerateResponse, None]
Collected = tuple[str, list[pb.TokenLogprob], pb.GenerateResponse]  # what whole() takes
# How often a non-streaming request checks that its client is still connected.
DISCONNECT_POLL_S = 0.5


class Renderer(Protocol):
    """One API's shape of a generation, fresh for each request (it may keep state)."""

    input_param: str  # the body field that an error about the prompt names

    def opening(self) -> list[BaseModel]:
        """Chunks a stream starts with, before any token."""
        ...

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        """Chunks for one streamed response (none if it carries nothing worth sending)."""
        ...

    def events(self, resp: pb.GenerateResponse) -> str:
        """The server-sent events of ``chunks(resp)`` ("" for none): what the stream sends."""
        ...

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> BaseModel:
        """The answer to a request that did not stream; ``final`` holds the whole generation."""
        ...

    def fork(self, index: int) -> Renderer:
        """The renderer of sample ``index`` (n > 1): state of its own, no usage of its own."""
        ...

    def closing(self, finals: Sequence[pb.GenerateResponse]) -> list[BaseModel]:
        """Chunks a stream of n samples ends with, once every one has ended."""
        ...

    def combine(self, answers: Sequence[BaseModel], wholes: Sequence[pb.GenerateResponse]) -> Any:
        """The JSON answer to n samples from the forks' ``whole`` answers, by index."""
        ...


async def complete(
    frontend: Frontend, req: pb.GenerateRequest, renderer: Renderer, http: Request, stream: bool
) -> Response:
    """Runs one generation for an HTTP caller: an SSE stream, or one JSON answer.

    The request is submitted before this returns, so a bad one fails with its own status
    (ApiError) even when it asked to stream; later failures end the stream with an error
    event, as OpenAI's clients expect.
    """
    responses = await _open(frontend, req, renderer.input_param, http)
    n = max(req.n, 1)
    forks = [renderer.fork(i) for i in range(n)] if n > 1 else [renderer]
    if stream:
        events = _events(responses, renderer, forks)
        return StreamingResponse(events, media_type="text/event-stream")
    collected = await _collect_while_connected(responses, renderer.input_param, http, n)
    if collected is None:  # nobody is left to read it
        return Response(status_code=499)
    if n == 1:
        return JSONResponse(sse.payload(renderer.whole(*collected[0])))
    answers = [fork.whole(*c) for fork, c in zip(forks, collected, strict=True)]
    return JSONResponse(renderer.combine(answers, [c[2] for c in collected]))


async def _collect_while_connected(
    responses: Responses, input_param: str, http: Request, n: int = 1
) -> list[Collected] | None:
    """_collect, unless the client hangs up first: then the request is aborted, None returned."""
    task = asyncio.ensure_future(_collect(responses, input_param, n))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, FrontendError, ApiError):
                await task
            await responses.aclose()  # the pipeline aborts the request on close
            return None


async def _open(
    frontend: Frontend, req: pb.GenerateRequest, input_param: str, http: Request
) -> Responses:
    """Submits under the caller's W3C trace headers, so the request's spans join its trace."""
    try:
        return await frontend.open(req, carrier_from(http.headers.items()))
    except FrontendError as e:
        raise api_error(e, input_param) from e


class _Gathered:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.lps: list[pb.TokenLogprob] = []
        self.whole = pb.GenerateResponse()
        self.seen = False

    def add(self, resp: pb.GenerateResponse) -> None:
        self.seen = True
        self.text.append(resp.text)
        self.lps.extend(resp.logprobs)
        self.whole.MergeFrom(resp)

    def result(self) -> Collected:
        self.whole.text = "".join(self.text)
        return self.whole.text, self.lps, self.whole


async def _collect(
    responses: AsyncIterator[pb.GenerateResponse], input_param: str, n: int = 1
) -> list[Collected]:
    """Runs a request to its end: per sample, its text, its token logprobs and the whole
    generation merged into one response (repeated fields append, later scalars win)."""
    samples = [_Gathered() for _ in range(n)]
    try:
        async for resp in responses:
            samples[resp.index].add(resp)
    except FrontendError as e:
        raise api_error(e, input_param) from e
    if not all(s.seen for s in samples):  # the pipeline always ends with a response or an error
        raise ApiError(500, "the generation ended without a response", kind="server_error")
    return [s.result() for s in samples]


async def _events(
    responses: Responses, renderer: Renderer, forks: Sequence[Renderer]
) -> AsyncIterator[str]:
    """Server-sent events: the renderer's chunks, an error as the last one, then [DONE]."""
    finals: list[pb.GenerateResponse] = []
    try:
        opening = "".join(sse.events(fork.opening()) for fork in forks)
        if opening:
            yield opening
        async for resp in responses:
            text = forks[resp.index].events(resp)
            if text:
                yield text
            if resp.finish_reason:
                finals.append(resp)
        if len(forks) > 1:
            closing = sse.events(renderer.closing(sorted(finals, key=lambda f: f.index)))
            if closing:
                yield closing
    except FrontendError as e:
        yield sse.data_event(api_error(e, renderer.input_param).body())
    finally:
        await responses.aclose()  # a client that went away aborts the request
    yield "data: [DONE]\n\n"
