"""The HTTP routes of the frontend (FastAPI on uvicorn, in the frontend's asyncio loop).

OpenAI's ``/v1/*`` routes, health, metrics and cache control. The routes only pick the
pieces (openai_protocol.py, openai_answers.py); both generating routes run through
http_completion.py, on the same Frontend as the gRPC API.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.frontend import http_docs as docs
from services.frontend.auth import LIVE_PATHS, READY_PATHS, ApiKeyAuth, ApiKeys
from services.frontend.chat_tools import ChatParsers
from services.frontend.http_completion import complete
from services.frontend.http_limits import BodyLimit
from services.frontend.http_native import native_routes
from services.frontend.key_limits import KeyConcurrency, KeyConcurrencyLimit
from services.frontend.openai_answers import ChatShape, CompletionShape, ModelCard, ModelList
from services.frontend.openai_errors import ApiError, body_error, check_model
from services.frontend.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_plan,
    chat_to_request,
    check_unserved,
    completion_to_request,
)
from services.frontend.pipeline import Frontend


def create_app(frontend: Frontend, parsers: ChatParsers | None = None) -> FastAPI:
    """The HTTP app of one Frontend; errors anywhere below a route answer in OpenAI's shape."""
    app = FastAPI(title="radixserve", description="OpenAI-compatible API of radixserve")
    app.exception_handler(ApiError)(_on_api_error)
    app.exception_handler(RequestValidationError)(_on_bad_body)
    app.exception_handler(StarletteHTTPException)(_on_http_error)
    app.include_router(_service_routes(frontend))
    app.include_router(_openai_routes(frontend, parsers or ChatParsers()))
    app.include_router(native_routes(frontend))  # SGLang's /generate etc. (http_native.py)
    return app


async def _on_api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


async def _on_bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
    return await _on_api_error(request, body_error(e.errors()))


async def _on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route, wrong method) in OpenAI's shape, not {"detail"}."""
    detail = e.detail if isinstance(e.detail, str) else "bad request"
    error = ApiError(e.status_code, f"{detail}: {request.method} {request.url.path}")
    return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)


def _service_routes(frontend: Frontend) -> APIRouter:
    """Readiness and liveness for probes, metrics for Prometheus, and a cache flush."""
    router = APIRouter()

    async def ready() -> JSONResponse:
        ok = frontend.engines.healthy
        status = {"status": "ok" if ok else "engines not ready"}
        return JSONResponse(status, status_code=200 if ok else 503)

    async def alive() -> JSONResponse:
        # Liveness only: a lost worker must not make Kubernetes restart a fine frontend.
        return JSONResponse({"status": "alive"})

    for path in READY_PATHS:
        router.add_api_route(path, ready, methods=["GET"], responses=docs.READY)
    for path in LIVE_PATHS:
        router.add_api_route(path, alive, methods=["GET"])

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = generate_latest(REGISTRY) + generate_latest(frontend.metrics.registry)
        return PlainTextResponse(text.decode(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/flush_cache", response_model=docs.FlushResult, responses=docs.FLUSH)
    async def flush_cache(storage: bool = False) -> JSONResponse:
        res = await frontend.flush_cache(storage)
        body = {"flushed": res.flushed, "message": res.message}
        return JSONResponse(body, status_code=200 if res.flushed else 400)

    return router


def _openai_routes(frontend: Frontend, parsers: ChatParsers) -> APIRouter:
    """OpenAI's routes; both generating ones differ only in body conversion and answer shape."""
    router = APIRouter(responses=docs.CLIENT_ERRORS)

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        card = ModelCard(id=frontend.model_id, max_model_len=frontend.max_model_len)
        return ModelList(data=[card]).model_dump()

    @router.post("/v1/completions", responses=docs.json_or_sse("a completion"))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        check_model(body.model, frontend.model_id)
        check_unserved(body)
        shape = CompletionShape.of(body, frontend.tokenizer, frontend.model_id)
        return await complete(frontend, completion_to_request(body), shape, http, body.stream)

    @router.post("/v1/chat/completions", responses=docs.json_or_sse("a chat completion"))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        check_model(body.model, frontend.model_id)
        check_unserved(body)
        plan = chat_plan(body, parsers)
        shape = ChatShape(frontend.tokenizer, frontend.model_id, body.include_usage, plan.output())
        return await complete(frontend, chat_to_request(body, plan), shape, http, body.stream)

    return router


class _UvicornInLoop(uvicorn.Server):
    """uvicorn sharing the frontend's loop: signals are the frontend's business, not its."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class HttpTls:
    """The HTTP port's TLS files (--ssl-*): plaintext without a certificate; with a client
    CA, every client must present a certificate it signed."""

    certfile: str = ""
    keyfile: str = ""
    client_ca: str = ""

    def uvicorn_kwargs(self) -> dict[str, Any]:
        if not self.certfile:
            return {}
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.client_ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_ca else ssl.CERT_NONE,
        }


class HttpServer:
    def __init__(
        self,
        frontend: Frontend,
        host: str,
        port: int,
        max_request_bytes: int = 8 << 20,
        body_timeout_s: float = 30.0,
        keys: ApiKeys | None = None,
        parsers: ChatParsers | None = None,
        tls: HttpTls | None = None,
        key_limits: KeyConcurrency | None = None,
    ) -> None:
        # The API key first, then the key's requests in flight, then bodies are bounded in
        # size and time before FastAPI parses them.
        limited = BodyLimit(create_app(frontend, parsers), max_request_bytes, body_timeout_s)
        per_key = KeyConcurrencyLimit(limited, key_limits or KeyConcurrency())
        self._app = ApiKeyAuth(per_key, keys or ApiKeys())
        self._host, self._port = host, port
        self._tls = tls or HttpTls()
        self._server: _UvicornInLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Binds (port 0 picks a free one) and serves in the background; returns the port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        port: int = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            interface="asgi3",
            log_level="warning",
            access_log=False,
            lifespan="off",
            **self._tls.uvicorn_kwargs(),
        )
        self._server = _UvicornInLoop(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        return port

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stops listening at once; open requests get ``grace_s`` to finish, then are cut."""
        if self._server is not None and self._task is not None:
            self._server.config.timeout_graceful_shutdown = math.ceil(grace_s)
            self._server.should_exit = True
            await self._task
