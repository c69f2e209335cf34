"""OpenAI-compatible HTTP API (FastAPI on uvicorn), in the frontend's asyncio loop.

It maps OpenAI's request bodies onto GenerateRequest and runs them through the same
Frontend as the gRPC API, so validation, routing, stop strings and cancellation are the
same; errors take OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import contextmanager
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from radixserve.v1 import generation_pb2 as pb
from services.frontend.pipeline import Frontend, FrontendError
from services.frontend.spans import carrier_from

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


# ---- request bodies (unknown OpenAI fields are accepted and ignored) -----------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # Beyond OpenAI (as vLLM and SGLang accept them).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, description="top alternatives per token, [0, 20]")
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- errors -----------------------------------------------------------------------


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


def _param_of(field: str | None, input_param: str) -> str | None:
    """The OpenAI parameter behind a GenerateRequest field path."""
    if field is None:
        return None
    head = field.split(".", 1)[0].split("[", 1)[0]
    if head in ("input", "text", "input_ids", "messages"):
        return input_param
    if head == "sampling":
        return field.split(".", 1)[1].split("[", 1)[0]
    return head


def _api_error(e: FrontendError, input_param: str) -> ApiError:
    status = _HTTP_STATUS.get(e.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, e.message, _param_of(e.field, input_param), kind)


# ---- OpenAI body -> GenerateRequest --------------------------------------------------


def _sampling(body: _SamplingBody, max_tokens: int | None) -> pb.SamplingParams:
    if body.n != 1:
        raise ApiError(400, f"n must be 1 (got {body.n}); send one request per completion", "n")
    if body.seed is not None and not 0 <= body.seed < 2**64:
        raise ApiError(400, f"seed must be in [0, 2^64), got {body.seed}", "seed")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sp = pb.SamplingParams(
        stop=stop, stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos
    )
    optional = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(sp, name, value)
    return sp


def _request(body: _SamplingBody, sp: pb.SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=body.request_id or "",
        sampling=sp,
        priority=body.priority,
        cache_salt=body.cache_salt or "",
    )


def completion_to_request(body: CompletionRequest) -> pb.GenerateRequest:
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    req = _request(body, _sampling(body, body.max_tokens))
    if body.logprobs is not None:
        req.sampling.logprobs = True
        req.sampling.top_logprobs = body.logprobs
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400, "batches of prompts are not supported; send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)
    return req


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(
                400, f"only text content parts are supported, got {part.get('type')!r}", "messages"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def chat_to_request(body: ChatCompletionRequest) -> pb.GenerateRequest:
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    req = _request(body, _sampling(body, max_tokens))
    req.sampling.logprobs = body.logprobs
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        req.sampling.top_logprobs = body.top_logprobs
    req.messages.SetInParent()  # an empty list stays "messages", which validation refuses
    for m in body.messages:
        req.messages.messages.add(role=m.role, content=_content_text(m.content))
    return req


# ---- GenerateResponse -> OpenAI ------------------------------------------------------


def _usage(final: pb.GenerateResponse) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


class _Logprobs:
    """Turns TokenLogprob messages into OpenAI's chat or completions logprobs shape."""

    def __init__(self, frontend: Frontend) -> None:
        self._fe = frontend

    def _token(self, token_id: int) -> str:
        return self._fe.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, lps) -> dict | None:
        if not lps:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            tok = self._token(token_id)
            return {"token": tok, "logprob": logprob, "bytes": list(tok.encode())}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top],
                }
                for lp in lps
            ]
        }

    def completion(self, lps) -> dict | None:
        if not lps:
            return None
        return {
            "tokens": [self._token(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t.token_id): t.logprob for t in lp.top} for lp in lps],
        }


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Api:
    """The routes' logic; one per app, holding the Frontend it serves."""

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self.logprobs = _Logprobs(frontend)

    def check_model(self, model: str | None) -> None:
        if model and model != self.fe.model_id:
            raise ApiError(
                404,
                f"The model {model!r} does not exist; this server serves {self.fe.model_id!r}",
                "model",
                "not_found_error",
            )

    def open(
        self, req: pb.GenerateRequest, input_param: str, http: Request
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            return self.fe.open(req, carrier_from(http.headers.items()))
        except FrontendError as e:
            raise _api_error(e, input_param) from e

    async def collect(self, stream: AsyncIterator[pb.GenerateResponse], input_param: str):
        """Runs a request to its end: (text, logprobs, final message)."""
        text, lps = [], []
        try:
            async for resp in stream:
                text.append(resp.text)
                lps.extend(resp.logprobs)
        except FrontendError as e:
            raise _api_error(e, input_param) from e
        return "".join(text), lps, resp

    async def sse(
        self, stream, input_param: str, chunk, include_usage: bool, head: dict | None = None
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per response, usage if asked, then [DONE]."""
        try:
            if head is not None:
                yield _sse(chunk(head, None, []))
            async for resp in stream:
                delta = {"content": resp.text} if head is not None else resp.text
                if resp.text or resp.finish_reason or resp.logprobs:
                    yield _sse(chunk(delta, resp.finish_reason or None, resp.logprobs))
                if resp.finish_reason and include_usage:
                    yield _sse(chunk(None, None, [], usage=_usage(resp)))
        except FrontendError as e:
            yield _sse(_api_error(e, input_param).body())
        finally:
            await stream.aclose()  # a client that went away aborts the request
        yield "data: [DONE]\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def create_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="radixserve", description="OpenAI-compatible API of radixserve")
    api = _Api(frontend)

    @app.exception_handler(ApiError)
    async def _api_error_handler(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _body_error_handler(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        return JSONResponse(
            ApiError(
                400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid body')}", param
            ).body(),
            status_code=400,
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = frontend.engines.healthy
        return JSONResponse(
            {"status": "ok" if ok else "engines not ready"}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = generate_latest(REGISTRY) + generate_latest(frontend.metrics.registry)
        return PlainTextResponse(text.decode(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        res = await frontend.flush_cache()
        return JSONResponse(
            {"flushed": res.flushed, "message": res.message},
            status_code=200 if res.flushed else 400,
        )

    @app.get("/v1/models")
    async def models() -> dict:
        max_len = frontend.max_model_len
        card = {
            "id": frontend.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "radixserve",
            "max_model_len": max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        api.check_model(body.model)
        stream = api.open(completion_to_request(body), "prompt", http)
        rid, created, model = _new_id("cmpl"), int(time.time()), frontend.model_id

        def chunk(text, finish, lps, usage=None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": model}
            if usage is not None:
                return {**out, "choices": [], "usage": usage}
            choice = {
                "index": 0,
                "text": text,
                "logprobs": api.logprobs.completion(lps),
                "finish_reason": finish,
            }
            return {**out, "choices": [choice]}

        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                api.sse(stream, "prompt", chunk, usage), media_type="text/event-stream"
            )
        text, lps, final = await api.collect(stream, "prompt")
        return {**chunk(text, final.finish_reason, lps), "usage": _usage(final)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        api.check_model(body.model)
        stream = api.open(chat_to_request(body), "messages", http)
        rid, created, model = _new_id("chatcmpl"), int(time.time()), frontend.model_id

        def chunk(delta, finish, lps, usage=None) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            if usage is not None:
                return {**out, "choices": [], "usage": usage}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": api.logprobs.chat(lps),
                "finish_reason": finish,
            }
            return {**out, "choices": [choice]}

        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            head = {"role": "assistant", "content": ""}
            return StreamingResponse(
                api.sse(stream, "messages", chunk, usage, head=head), media_type="text/event-stream"
            )
        text, lps, final = await api.collect(stream, "messages")
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": api.logprobs.chat(lps),
            "finish_reason": final.finish_reason,
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(final),
        }

    return app


class _UvicornInLoop(uvicorn.Server):
    """uvicorn sharing the frontend's loop: signals are the frontend's business, not its."""

    @contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, frontend: Frontend, host: str, port: int) -> None:
        self._app = create_app(frontend)
        self._host, self._port = host, port
        self._server: _UvicornInLoop | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Binds (port 0 picks a free one) and serves in the background; returns the port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off")
        self._server = _UvicornInLoop(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        return port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
