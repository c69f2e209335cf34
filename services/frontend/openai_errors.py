"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, from a
FrontendError or from pydantic's validation errors, with the field a client sent named.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from pydantic import BaseModel

from services.frontend.pipeline import FrontendError

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, not_found_error or server_error
    param: str | None  # the body field at fault, for clients that highlight it
    code: str | None  # always null: the HTTP status says it


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: raised anywhere below a route, answered by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.kind, param=self.param, code=None)
        return ErrorResponse(error=detail).model_dump()


def _param_of(field: str | None, input_param: str) -> str | None:
    """The OpenAI parameter behind a GenerateRequest field path (``sampling.top_p``)."""
    if field is None:
        return None
    if field.startswith("messages.tools"):
        return "tools"
    head = field.split(".", 1)[0].split("[", 1)[0]
    if head in ("input", "text", "input_ids", "messages"):
        return input_param
    if head == "sampling":
        name = field.split(".", 1)[1].split("[", 1)[0]
        return _CONSTRAINT_PARAMS.get(name, name)
    return head


# Constraint fields of SamplingParams -> the body parameter that set them.
_CONSTRAINT_PARAMS = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "structural_tag": "response_format",
}


def api_error(e: FrontendError, input_param: str) -> ApiError:
    """A pipeline failure as OpenAI's error; ``input_param`` takes the blame for the prompt."""
    status = _HTTP_STATUS.get(e.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = retry_after_header(e)
    return ApiError(status, e.message, _param_of(e.field, input_param), kind, headers)


def retry_after_header(e: FrontendError) -> dict[str, str]:
    """Retry-After (whole seconds) for an engine that refused a request as overloaded."""
    return {"Retry-After": str(math.ceil(e.retry_after))} if e.retry_after > 0 else {}


def body_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A body that does not parse: 400 naming the bad field in the client's terms (not
    FastAPI's 422, nor pydantic's names for the members of a union)."""
    if not errors:
        return ApiError(400, "the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", "JSON decode error")
        at = next((x for x in first.get("loc", ()) if isinstance(x, int)), 0)
        return ApiError(400, f"the request body is not valid JSON: {why} (at character {at})")
    field = _path(first)
    if not field:  # the body as a whole: not an object, or a check across its fields
        if first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return ApiError(400, "the request body must be a JSON object")
        return ApiError(400, str(first.get("msg", "invalid body")).removeprefix("Value error, "))
    branches = [e for e in errors if _path(e)[:1] == field[:1]]
    err = _most_telling(branches)
    kinds = sorted({_kind(t) for e in branches for t in _union_tags(e)}, key=len)
    if err is None and kinds:  # a value of a type no member of the union takes
        one_of = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
        got = shown(branches[0].get("input"))
        return ApiError(400, f"{_where(field[:1])}: must be {one_of} (got {got})", str(field[0]))
    err = err or branches[0]  # several items of a list wrong alike: the first is named
    message = f"{_where(_path(err))}: {err.get('msg', 'invalid')}"
    if err.get("type") != "missing":
        message += f" (got {shown(err.get('input'))})"
    return ApiError(400, message, str(field[0]))


def _is_union_tag(x: object) -> bool:
    """pydantic's name for a union member in ``loc`` ('str', 'list[constrained-int]', a class
    name), never a body field (lower snake case)."""
    if not isinstance(x, str):
        return False
    return (
        "[" in x
        or x[:1].isupper()
        or x in _TYPE_WORDS
        or x.startswith(("constrained-", "function-"))
    )


_TYPE_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}


def _union_tags(err: Mapping[str, Any]) -> list[str]:
    return [x for x in err.get("loc", ()) if _is_union_tag(x)][:1]


def _kind(tag: str) -> str:
    """'list[list[constrained-int]]' -> 'a list of lists of integers'."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _kind(tag[5:-1]).removeprefix("a ").removeprefix("an ")
        return "a list of " + (
            inner.replace("list", "lists", 1) if inner.startswith("list") else inner + "s"
        )
    word = tag.removeprefix("constrained-")
    return _TYPE_WORDS.get(word, f"a {word}")


def _path(err: Mapping[str, Any]) -> list[str | int]:
    return [x for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]


def _most_telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Of one field's errors (one per union member), the one that says most: a broken limit,
    then the deepest. None when every member refused the type at the same depth."""
    limits = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    if limits:
        return max(limits, key=lambda e: len(_path(e)))
    if len(errors) == 1:
        return errors[0]
    depths = sorted((len(_path(e)) for e in errors), reverse=True)
    if depths[0] > depths[1]:
        return max(errors, key=lambda e: len(_path(e)))
    return None


def _where(path: Sequence[str | int]) -> str:
    """['messages', 0, 'role'] -> 'messages[0].role'."""
    out = ""
    for x in path:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "body"


def shown(value: Any) -> str:
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model(requested: str | None, served: str) -> None:
    """404 for a model this server does not serve; an empty ``model`` means the served one."""
    if requested and requested != served:
        raise ApiError(
            404,
            f"The model {requested!r} does not exist; this server serves {served!r}",
            "model",
            "not_found_error",
        )
