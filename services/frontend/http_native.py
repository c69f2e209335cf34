"""SGLang's native HTTP API (docs/sglang.md), so ``sgl.RuntimeEndpoint`` runs unchanged.

Each prompt of ``POST /generate`` runs through the shared completion path (http_completion.py)
with ``NativeShape`` as its Renderer, so pipeline, validation and radix cache are the OpenAI
routes' and gRPC's. Bodies: native_protocol.py; answers: native_answers.py.
"""

from __future__ import annotations

import asyncio
import json
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.frontend import http_docs as docs
from services.frontend.http_completion import complete
from services.frontend.native_answers import NativeShape
from services.frontend.native_protocol import (
    NativeBody,
    NativeItem,
    native_error,
    parse_abort,
    parse_generate,
)
from services.frontend.openai_errors import ApiError
from services.frontend.pipeline import Frontend


def _version() -> str:
    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _read_json(http: Request) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


async def _first_id(frontend: Frontend, item: NativeItem) -> int | None:
    """Prompt token 0, which a logprob_start_len of 0 lists (with a null logprob)."""
    if item.ask.logprob_start_len != 0 or not item.ask.return_logprob:
        return None
    req = item.req
    if req.WhichOneof("input") == "input_ids":
        return req.input_ids.ids[0]
    ids = await asyncio.to_thread(frontend.tokenizer.encode, req.text[:256])
    return ids[0] if ids else None


async def _one(
    frontend: Frontend, item: NativeItem, http: Request, stream: bool, index: int | None
) -> Response:
    shape = NativeShape(frontend.tokenizer, item, await _first_id(frontend, item))
    try:
        return await complete(frontend, item.req, shape, http, stream)
    except ApiError as e:
        raise native_error(e, index) from None


async def _batch(frontend: Frontend, body: NativeBody, http: Request) -> Response:
    """Every prompt at once, answered with a list in their order. Each runs to its end even
    if another fails, so none is left without a reader; the first failure is the answer."""
    runs = [_one(frontend, item, http, False, i) for i, item in enumerate(body.items)]
    results = await asyncio.gather(*runs, return_exceptions=True)
    answers = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        if r.status_code != 200:  # 499: the client went away
            return r
        answer = json.loads(bytes(r.body))
        if isinstance(answer, list):  # a prompt's n samples: its outputs in a row (SGLang)
            answers.extend(answer)
        else:
            answers.append(answer)
    return JSONResponse(answers)


def native_routes(frontend: Frontend) -> APIRouter:
    """SGLang's native routes, on the same Frontend as the OpenAI routes and gRPC."""
    router = APIRouter(responses=docs.CLIENT_ERRORS)

    @router.post(
        "/generate",
        responses=docs.json_or_sse("the answer, or a list for a batch"),
        openapi_extra=docs.GENERATE_BODY,
    )
    async def generate(http: Request) -> Response:
        body = parse_generate(await _read_json(http))
        if body.batch:
            return await _batch(frontend, body, http)
        return await _one(frontend, body.items[0], http, body.stream, None)

    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        # SGLang's client picks its chat template by matching model_path against model names.
        name = frontend.model_id
        return {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
        }

    @router.get("/server_info", responses=docs.GENERATION_ERRORS)
    @router.get("/get_server_info", responses=docs.GENERATION_ERRORS)
    async def server_info() -> JSONResponse:
        info = frontend.engines.info
        if not frontend.engines.ready or info is None:
            message = "the engines are not ready yet; retry shortly"
            raise ApiError(503, message, kind="server_error")
        body = {
            "model_path": frontend.model_id,
            "tokenizer_path": frontend.model_id,
            "served_model_name": frontend.model_id,
            "context_length": info.max_model_len,
            "page_size": info.page_size,
            "max_total_num_tokens": info.max_total_num_tokens,
            "vocab_size": frontend.vocab_size,
            "num_engines": info.num_engines,
            "architecture": info.worker.architecture,
            "version": _version(),
        }
        return JSONResponse(body)

    @router.post("/abort_request", openapi_extra=docs.ABORT_BODY)
    async def abort_request(http: Request) -> JSONResponse:
        rid = parse_abort(await _read_json(http))
        aborted = frontend.abort(rid, "aborted by /abort_request")
        return JSONResponse({"aborted": aborted})

    @router.get("/flush_cache", response_model=docs.FlushResult, responses=docs.FLUSH)
    async def flush_cache_get(storage: bool = False) -> JSONResponse:
        # SGLang serves its flush on GET too; POST is in http_api's service routes.
        res = await frontend.flush_cache(storage)
        body = {"flushed": res.flushed, "message": res.message}
        return JSONResponse(body, status_code=200 if res.flushed else 400)

    return router
