"""What each HTTP route declares in /openapi.json beyond its 200: the answers it really gives.

FastAPI documents a 200 in JSON and a 422 it never sends (a bad body or query answers 400,
openai_errors.body_error). These tell the truth instead, so clients and schemathesis
(tests/e2e/test_openapi_fuzz.py) can hold the server to its schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from services.frontend.openai_errors import ErrorResponse

Responses = dict[int | str, dict[str, Any]]

# Every 4xx is OpenAI's error object: a bad body or query (400), a missing or wrong API key
# (401), an unknown model (404), a body too large (413) or too slow (408), a full queue (429).
# Declaring the range also keeps FastAPI from adding its 422.
CLIENT_ERRORS: Responses = {"4XX": {"model": ErrorResponse, "description": "refused"}}

# The generating routes: the engines not ready or gone (503), past the deadline (504).
GENERATION_ERRORS: Responses = {
    **CLIENT_ERRORS,
    503: {"model": ErrorResponse, "description": "no engine can serve it now"},
    504: {"model": ErrorResponse, "description": "the engine did not answer in time"},
}


def json_or_sse(description: str) -> Responses:
    """A 200 in JSON, or with ``stream: true`` server-sent events (``data: {...}`` lines)."""
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"description": description, "content": sse}, **GENERATION_ERRORS}


class Status(BaseModel):
    status: str


READY: Responses = {503: {"model": Status, "description": "the engines are not ready"}}


class FlushResult(BaseModel):
    flushed: bool
    message: str


# A flush the scheduler refuses (requests running, no storage tier) is a 400 with the
# FlushResult; a bad query is a 400 with the error object.
FLUSH: Responses = {**CLIENT_ERRORS, 400: {"model": FlushResult | ErrorResponse}}


def json_body(properties: dict[str, Any]) -> dict[str, Any]:
    """The JSON object a route that parses its own body (http_native) reads: openapi_extra."""
    schema = {"type": "object", "properties": properties}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# The fields the native routes are most often sent; native_protocol.parse_* checks them all.
GENERATE_BODY = json_body(
    {
        "text": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "input_ids": {"type": "array", "items": {"type": "integer"}},
        "sampling_params": {"type": "object"},
        "stream": {"type": "boolean"},
    }
)
ABORT_BODY = json_body({"rid": {"type": "string"}, "abort_all": {"type": "boolean"}})
