"""OpenAI's HTTP protocol: its request bodies, answers, stream chunks and errors, and the
mapping between them and the public ``radixserve.v1`` messages.

Everything OpenAI-shaped lives here, so the routes (http_api.py) and the shared completion
path (http_completion.py) hold no OpenAI field names. A body becomes the same
GenerateRequest a gRPC client sends, so validation, routing and the radix cache behave the
same through either door; GenerateResponses become OpenAI's answers and chunks. Errors take
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import copy
import json
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Annotated, Any

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixserve.v1 import generation_pb2 as pb
from services.frontend import sse
from services.frontend.chat_tools import (
    ChatOutput,
    ChatParsers,
    ChatPlan,
    MessageToolCall,
    ToolChoice,
    ToolSpec,
)
from services.frontend.pipeline import FrontendError
from services.frontend.tokenizer import Tokenizer
from services.frontend.tool_grammar import ToolGrammarError
from services.frontend.validation import MAX_SAMPLES

# ---- errors -------------------------------------------------------------------------

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
        got = _shown(branches[0].get("input"))
        return ApiError(400, f"{_where(field[:1])}: must be {one_of} (got {got})", str(field[0]))
    err = err or branches[0]  # several items of a list wrong alike: the first is named
    message = f"{_where(_path(err))}: {err.get('msg', 'invalid')}"
    if err.get("type") != "missing":
        message += f" (got {_shown(err.get('input'))})"
    return ApiError(400, message, str(field[0]))


def _is_union_tag(x: object) -> bool:
    """pydantic names each member of a union in ``loc`` ('str', 'list[constrained-int]',
    a model's class name); the body's own field names are lower snake case."""
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
    """Of the errors of one field (one per member of a union), the one that says most: a
    broken limit before a wrong type, a deeper position before a shallower one. None when
    every member refused the value's type at the same depth."""
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


def _shown(value: Any) -> str:
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


# ---- request bodies -----------------------------------------------------------------
# Fields outside OpenAI's API are accepted and ignored (clients add their own); the OpenAI
# fields below are not served yet, so anything but their "not asked for" values is a 400
# naming the field: dropping them would answer another question than the one asked.
# ``user`` and ``metadata`` are accepted and not used (they change no output). Chat declares
# tools and tool_choice (chat_tools.py); on /v1/completions they stay refused here.
_UNSERVED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "service_tier": (None,),
    "store": (None, False),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


# OpenAI's deprecated forms of tool calling -> what replaces them.
_DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}


def check_unserved(body: BaseModel) -> None:
    """400 for an OpenAI field radixserve would otherwise have to drop."""
    for name, value in (body.model_extra or {}).items():
        if name in _UNSERVED and not any(
            value == ok and type(value) is type(ok) for ok in _UNSERVED[name]
        ):
            instead = (
                f"use {_DEPRECATED[name]} (OpenAI deprecated {name})"
                if name in _DEPRECATED and isinstance(body, ChatCompletionRequest)
                else "leave it out"
            )
            raise ApiError(
                400, f"{name} is not supported by radixserve (got {_shown(value)}); {instead}", name
            )


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; the body still says "schema".
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar is always enforced, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "text"  # text | json_object | json_schema | structural_tag
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (as vLLM and SGLang take it): xgrammar's "format", or the older
    # "structures" ({begin, schema, end} each) with the "triggers" that open them.
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


# Integers the protobuf fields behind them hold: a larger one is a 400 naming the field, not
# an overflow deep in the conversion (HTTP 500).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


def _first_unencodable(value: Any, path: str) -> str | None:
    """The path of the first string that is not valid Unicode (a lone surrogate, which JSON's
    \\ud800 escapes can carry and UTF-8 cannot encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict | list):
        items: Any = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            found = _first_unencodable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    return None


class _SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = _first_unencodable(data, "")
        if bad:
            raise ValueError(f"{bad}: invalid Unicode (a lone surrogate)")
        return data

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    user: str | None = None
    # Beyond OpenAI (as vLLM and SGLang accept them).
    stop_regex: str | list[str] | None = None  # SGLang's: stop where the text matches one
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    disable_speculation: bool = False  # radixserve's: no speculative decoding for this one
    stop_token_ids: list[Int32] | None = None
    # EOS and stop_token_ids cannot end the output before this many tokens (vLLM's name).
    min_tokens: Int32 | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    priority: Int32 = 0
    # Constrained decoding: OpenAI's response_format, and vLLM's / SGLang's regex and ebnf.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk only when the client asks for it."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    # Samples generated, of which the n of highest cumulative logprob are returned (>= n).
    best_of: Int32 | None = None
    logprobs: Int32 | None = Field(default=None, description="top alternatives per token, [0, 20]")
    # The prompt leads the choice's text (and, with logprobs, its lists); with max_tokens 0
    # the answer scores the prompt alone (as lm-eval's loglikelihood does).
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, fed back
    tool_call_id: str | None = None  # role "tool": the call this result answers
    name: str | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    # Tool calling (chat_tools.py, docs/tools.md).
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


# ---- OpenAI body -> GenerateRequest --------------------------------------------------


def _sampling(body: _SamplingBody, max_tokens: int | None) -> pb.SamplingParams:
    """The public SamplingParams; only the limits the proto cannot state are checked here."""
    if body.n < 1:  # the upper bound (MAX_SAMPLES) is validation's
        raise ApiError(400, f"n must be at least 1, got {body.n}", "n")
    if body.seed is not None and not 0 <= body.seed < 2**64:
        raise ApiError(400, f"seed must be in [0, 2^64), got {body.seed}", "seed")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sp = pb.SamplingParams(
        stop=stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        disable_speculation=body.disable_speculation,
    )
    optional = {
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
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
        if value is not None:  # unset stays unset: the engine applies its own default
            setattr(sp, name, value)
    regexes = body.stop_regex
    sp.stop_regex.extend([regexes] if isinstance(regexes, str) else regexes or [])
    try:
        sp.logit_bias.extend(logit_bias_entries(body.logit_bias))
    except ValueError as e:
        raise ApiError(400, f"logit_bias: {e}", "logit_bias") from None
    _constrain(body, sp)
    return sp


def logit_bias_entries(bias: Mapping[str, float] | None) -> list[pb.LogitBias]:
    """OpenAI's ``{"token id": bias}`` as LogitBias entries; ValueError for a key that is not
    a token id. The limits (the vocabulary, [-100, 100], how many) are validation's."""
    out = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
            raise ValueError(f"the keys are token ids (decimal strings), got {key!r}")
        out.append(pb.LogitBias(token_id=int(key), bias=value))
    return out


def _constraints_given(body: _SamplingBody) -> list[str]:
    """The body fields that constrain the output: response_format, regex, ebnf."""
    given = [p for p in ("regex", "ebnf") if getattr(body, p) is not None]
    rf = body.response_format
    if rf is not None and rf.type != "text":
        given.insert(0, "response_format")
    return given


def _constrain(body: _SamplingBody, sp: pb.SamplingParams) -> None:
    """response_format / regex / ebnf -> the one constraint of SamplingParams."""
    given = _constraints_given(body)
    rf = body.response_format
    if len(given) > 1:
        raise ApiError(
            400, f"at most one constraint per request, got {' and '.join(given)}", given[1]
        )
    if body.regex is not None:
        sp.regex = body.regex
    elif body.ebnf is not None:
        sp.ebnf = body.ebnf
    elif rf is not None:
        _response_format(rf, sp)


def _response_format(rf: ResponseFormat, sp: pb.SamplingParams) -> None:
    if rf.type == "json_object":
        sp.json_object = True
    elif rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(
                400, "response_format json_schema needs json_schema.schema", "response_format"
            )
        sp.json_schema = json.dumps(rf.json_schema.schema_)
    elif rf.type == "structural_tag":
        if rf.format is None and rf.structures is None:
            raise ApiError(
                400,
                "response_format structural_tag needs format (or structures and triggers)",
                "response_format",
            )
        # The response_format object is the structural tag itself ({"type", "format"}).
        sp.structural_tag = json.dumps(rf.model_dump(exclude_none=True))
    elif rf.type != "text":
        raise ApiError(
            400,
            "response_format.type must be text, json_object, json_schema or structural_tag,"
            f" got {rf.type!r}",
            "response_format",
        )


def _request(body: _SamplingBody, sp: pb.SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=body.request_id or "",
        sampling=sp,
        priority=body.priority,
        cache_salt=body.cache_salt or "",
        n=body.n,
    )


def _one_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
    """OpenAI's four prompt forms cut down to one prompt: text or token ids.

    The body's type already made a list all ints or all prompts, so splitting by kind tells
    which it is.
    """
    if isinstance(prompt, str):
        return prompt
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) == len(prompt):
        return ids
    batch = [p for p in prompt if not isinstance(p, int)]
    if len(batch) != 1:
        raise ApiError(
            400, "batches of prompts are not supported; send one prompt per request", "prompt"
        )
    return batch[0]


def completion_to_request(body: CompletionRequest) -> pb.GenerateRequest:
    """A completions body as the public request; ``logprobs: k`` asks for k alternatives
    (of the prompt's tokens too with ``echo``)."""
    req = _request(body, _sampling(body, body.max_tokens))
    if body.logprobs is not None:
        req.sampling.logprobs = True
        req.sampling.top_logprobs = body.logprobs
        req.sampling.prompt_logprobs = body.echo
    req.n = _best_of(body)
    if req.n > body.n:
        req.sampling.logprobs = True  # the samples are ranked by their cumulative logprob
    prompt = _one_prompt(body.prompt)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)
    return req


def _best_of(body: CompletionRequest) -> int:
    """The samples to generate: best_of (>= n; the n best are returned), else n."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise ApiError(400, f"best_of must be >= n ({body.n}), got {body.best_of}", "best_of")
    if body.best_of > MAX_SAMPLES:
        raise ApiError(400, f"best_of must be at most {MAX_SAMPLES}, got {body.best_of}", "best_of")
    if body.stream:
        why = "best_of > n cannot be streamed: the best are known at the end"
        raise ApiError(400, why, "best_of")
    return body.best_of


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text; content parts are joined, and only text parts are served."""
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


def chat_plan(body: ChatCompletionRequest, parsers: ChatParsers) -> ChatPlan:
    """What the body's tools (and the server's parsers) ask of the output: the constraint,
    and how the answer is read. 400 naming the field at fault."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    given = _constraints_given(body)
    try:
        return parsers.plan(
            tools, body.tool_choice, body.parallel_tool_calls, given[0] if given else None
        )
    except ToolGrammarError as e:
        raise ApiError(400, str(e), e.param) from None


def chat_to_request(
    body: ChatCompletionRequest, plan: ChatPlan | None = None
) -> pb.GenerateRequest:
    """A chat body as the public request: messages and tools, which the frontend's chat
    template renders, and the constraint of ``plan`` (chat_plan) if it has one.

    ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``.
    """
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
        msg = req.messages.messages.add(role=m.role, content=_content_text(m.content))
        msg.tool_call_id, msg.name = m.tool_call_id or "", m.name or ""
        for c in m.tool_calls or []:
            msg.tool_calls.add(id=c.id, name=c.function.name, arguments=c.arguments_json())
    for t in body.tools or []:
        params = t.function.parameters
        req.messages.tools.add(
            name=t.function.name,
            description=t.function.description or "",
            parameters="" if params is None else json.dumps(params, ensure_ascii=False),
        )
    if plan is not None and plan.structural_tag is not None:
        req.sampling.structural_tag = plan.structural_tag
    return req


# ---- answers and chunks --------------------------------------------------------------
# The completion path sends answers and chunks with exclude_unset: a field left unset
# (``usage`` before the last chunk, a delta's ``role`` after the first) is absent, as in
# OpenAI's answers, not null. The model list is sent whole, defaults included.


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "radixserve"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class CachedTokensDetails(BaseModel):
    """Where the cached prompt tokens came from (the hierarchical cache's tiers)."""

    device: int
    host: int
    storage: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def total(cls, finals: Sequence[pb.GenerateResponse]) -> Usage:
        """n samples of one prompt: the prompt counted once (as OpenAI does; each sample
        says the same cached_tokens), every sample's tokens counted, best_of's unreturned
        ones too (they were generated)."""
        usage = cls.of(finals[0])
        usage.completion_tokens = sum(f.completion_tokens for f in finals)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return usage

    @classmethod
    def of(cls, final: pb.GenerateResponse) -> Usage:
        """From a request's last response, the only one that carries the counts."""
        return cls(
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            total_tokens=final.prompt_tokens + final.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=final.cached_tokens,
                cached_tokens_details=CachedTokensDetails(
                    device=final.cached_tokens
                    - final.cached_tokens_details.host
                    - final.cached_tokens_details.storage,
                    host=final.cached_tokens_details.host,
                    storage=final.cached_tokens_details.storage,
                ),
            ),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # null for an echoed prompt's first token: nothing precedes it.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + other.tokens,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            top_logprobs=self.top_logprobs + other.top_logprobs,
        )


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class ChatDelta(BaseModel):
    role: str | None = None  # on the first chunk only
    content: str | None = None
    # With the parsers (chat_tools.py): the thinking, and calls as OpenAI's delta items.
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: CalledFunctionOut


class AssistantMessage(BaseModel):
    role: str
    content: str | None  # null when the answer is calls only
    reasoning_content: str | None = None  # set with --reasoning-parser
    tool_calls: list[ToolCallOut] | None = None  # set when calls were made


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _Answer(BaseModel):
    id: str
    object: str
    created: int
    model: str


class Completion(_Answer):
    """A whole completions answer, and each of its stream's chunks (OpenAI uses one shape)."""

    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Answer):
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatCompletion(_Answer):
    choices: list[ChatChoice]
    usage: Usage


# ---- GenerateResponse -> answers -----------------------------------------------------


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Special tokens too: a logprob belongs to the token the model chose, whatever it is.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, lps: Sequence[pb.TokenLogprob]
) -> CompletionLogprobs | None:
    """Completions' logprobs: parallel lists, alternatives as {token: logprob}; None if none."""
    if not lps:
        return None
    return CompletionLogprobs(
        tokens=[_token_text(tokenizer, lp.token_id) for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[
            {_token_text(tokenizer, t.token_id): t.logprob for t in lp.top} for lp in lps
        ],
    )


def echo_logprobs(
    tokenizer: Tokenizer, first_token: int, prompt_lps: Sequence[pb.TokenLogprob]
) -> CompletionLogprobs:
    """An echoed prompt's logprobs: its first token has none (null), then one per token."""
    lead = CompletionLogprobs(
        tokens=[_token_text(tokenizer, first_token)], token_logprobs=[None], top_logprobs=[None]
    )
    rest = completion_logprobs(tokenizer, prompt_lps)
    return lead + rest if rest is not None else lead


def _chat_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> ChatLogprob:
    token = _token_text(tokenizer, token_id)
    return ChatLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


def _chat_token(tokenizer: Tokenizer, lp: pb.TokenLogprob) -> ChatTokenLogprob:
    token = _token_text(tokenizer, lp.token_id)
    top = [_chat_logprob(tokenizer, t.token_id, t.logprob) for t in lp.top]
    return ChatTokenLogprob(
        token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
    )


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[pb.TokenLogprob]) -> ChatLogprobs | None:
    """Chat's logprobs: one entry per token, with its UTF-8 bytes, since a token may hold
    only part of a character; None if none were asked for."""
    if not lps:
        return None
    return ChatLogprobs(content=[_chat_token(tokenizer, lp) for lp in lps])


class _OpenAIShape(ABC):
    """One OpenAI answer in the making: the id and creation time all its chunks share.

    It is a Renderer (http_completion.py): the shared completion path asks it for the
    chunks of a stream or for the whole answer. With n samples, each is rendered by a fork
    (choice ``index``) and this one sends the usage of all.
    """

    input_param: str  # the body field blamed for a bad prompt
    id_prefix: str  # of the answer's id
    chunk_object: str  # the ``object`` of the stream's chunks
    chunk_model: type[BaseModel]

    def __init__(self, tokenizer: Tokenizer, model: str, include_usage: bool) -> None:
        self._tokenizer = tokenizer
        self._include_usage = include_usage
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.index = 0  # the choice this renders

    def opening(self) -> list[BaseModel]:
        return []

    def fork(self, index: int) -> _OpenAIShape:
        """Choice ``index`` of the same answer: a copy of this one as it is before any
        response (so with state of its own) that shares the tokenizer."""
        clone = copy.deepcopy(self, {id(self._tokenizer): self._tokenizer})
        clone.__dict__.pop("_text_template", None)  # it holds choice 0's index
        clone.index, clone._include_usage = index, False
        return clone

    def closing(self, finals: Sequence[pb.GenerateResponse]) -> list[BaseModel]:
        if not self._include_usage:
            return []
        usage = Usage.total(finals)
        return [self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage)]

    def combine(
        self, answers: Sequence[BaseModel], wholes: Sequence[pb.GenerateResponse]
    ) -> dict[str, Any]:
        """The forks' answers as one: their choices in order, the usage of all."""
        body = sse.payload(answers[0])
        body["choices"] = []
        for new_index, i in enumerate(self._returned(wholes)):
            choice = sse.payload(answers[i])["choices"][0]
            body["choices"].append({**choice, "index": new_index})
        body["usage"] = Usage.total(wholes).model_dump()
        return body

    def _returned(self, wholes: Sequence[pb.GenerateResponse]) -> list[int]:
        """The samples the answer returns, in its order: all of them."""
        return list(range(len(wholes)))

    def events(self, resp: pb.GenerateResponse) -> str:
        """The events of chunks(resp); a chunk of new text alone (nearly every one) is
        filled into a template of this answer's chunks: the same bytes, 1.3 instead of 15 us."""
        if resp.text and not (resp.finish_reason or resp.logprobs) and self._plain():
            template = self._text_template
            if template is not None:
                return template.fill(resp.text)
        return sse.events(self.chunks(resp))

    @cached_property
    def _text_template(self) -> sse.TextTemplate | None:
        # Built on first use: a subclass's own state must exist before _chunk runs.
        return sse.TextTemplate.of(lambda text: self._chunk(text, None, ()))

    def _plain(self) -> bool:
        """Whether a text-only response's chunk is the plain one (nothing leads its text)."""
        return True

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        """The chunk of one response if it carries anything, then usage after the last."""
        out: list[BaseModel] = []
        if resp.text or resp.finish_reason or resp.logprobs:
            out.append(self._chunk(resp.text, resp.finish_reason or None, resp.logprobs))
        if resp.finish_reason and self._include_usage:
            usage = Usage.of(resp)
            out.append(self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage))
        return out

    def _meta(self, obj: str) -> dict[str, Any]:
        """The fields every answer and chunk starts with."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @abstractmethod
    def _chunk(self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]) -> BaseModel:
        """One stream chunk: new text, its logprobs, and the finish reason on the last."""

    @abstractmethod
    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> BaseModel:
        """The answer to a request that did not ask to stream."""


class CompletionShape(_OpenAIShape):
    """``/v1/completions``: text choices, logprobs as parallel lists. With ``echo`` the
    prompt (and its logprobs, the first null) leads the first chunk or the whole answer."""

    input_param, id_prefix = "prompt", "cmpl"
    chunk_object, chunk_model = "text_completion", Completion

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: str,
        include_usage: bool,
        echo: str | list[int] | None = None,
    ) -> None:
        super().__init__(tokenizer, model, include_usage)
        self._echo = echo  # the prompt still to echo; None when not asked or done
        self._lead: tuple[str, CompletionLogprobs | None] | None = None
        self._keep = 0  # best_of: the samples returned (0: all)
        self._show_logprobs = True  # False where only best_of asked for them

    @classmethod
    def of(cls, body: CompletionRequest, tokenizer: Tokenizer, model: str) -> CompletionShape:
        echo = _one_prompt(body.prompt) if body.echo else None
        shape = cls(tokenizer, model, body.include_usage, echo)
        shape._keep, shape._show_logprobs = body.n, body.logprobs is not None
        return shape

    def _returned(self, wholes: Sequence[pb.GenerateResponse]) -> list[int]:
        """best_of: the n samples of highest cumulative logprob, best first."""
        order = list(range(len(wholes)))
        if not 0 < self._keep < len(wholes):
            return order
        score = [sum(lp.logprob for lp in whole.logprobs) for whole in wholes]
        return sorted(order, key=lambda i: -score[i])[: self._keep]

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        self._take_echo(resp)  # the first response carries the prompt logprobs
        return super().chunks(resp)

    def _plain(self) -> bool:
        return self._echo is None and self._lead is None

    def _take_echo(self, first: pb.GenerateResponse) -> None:
        if self._echo is None:
            return
        prompt, self._echo = self._echo, None
        text = prompt if isinstance(prompt, str) else self._tokenizer.decode(prompt)
        logprobs = None
        if first.prompt_logprobs_start:  # asked (logprobs with echo)
            ids = prompt if isinstance(prompt, list) else self._tokenizer.encode(prompt)
            logprobs = echo_logprobs(self._tokenizer, ids[0], first.prompt_logprobs)
        self._lead = (text, logprobs)

    def _chunk(self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]) -> Completion:
        logprobs = completion_logprobs(self._tokenizer, lps)
        if self._lead is not None:
            lead_text, lead_lps = self._lead
            self._lead = None
            text = lead_text + text
            if lead_lps is not None:
                logprobs = lead_lps + logprobs if logprobs is not None else lead_lps
        choice = CompletionChoice(
            index=self.index, text=text, logprobs=logprobs, finish_reason=finish
        )
        return Completion(**self._meta(self.chunk_object), choices=[choice])

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> Completion:
        self._take_echo(final)  # the merged responses: the prompt logprobs included
        answer = self._chunk(text, final.finish_reason, lps if self._show_logprobs else ())
        answer.usage = Usage.of(final)
        return answer


class ChatShape(_OpenAIShape):
    """``/v1/chat/completions``: a stream opens with the role, then carries content deltas.

    With ``output`` (chat_tools.ChatPlan.output) the text is read first: a stream carries
    one chunk per reasoning, content or tool-call delta and ends with an empty delta that
    holds the finish reason; "stop" becomes "tool_calls" when calls were made."""

    input_param, id_prefix = "messages", "chatcmpl"
    chunk_object, chunk_model = "chat.completion.chunk", ChatCompletionChunk

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: str,
        include_usage: bool,
        output: ChatOutput | None = None,
    ) -> None:
        super().__init__(tokenizer, model, include_usage)
        self._output = output

    def _plain(self) -> bool:
        return self._output is None

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        if self._output is None:
            return super().chunks(resp)
        deltas = self._output.feed(resp.text)
        if resp.finish_reason:
            deltas += self._output.finish()
        logprobs = chat_logprobs(self._tokenizer, resp.logprobs)
        out: list[BaseModel] = []
        for delta in deltas or ([{}] if logprobs else []):  # logprobs need a chunk
            out.append(self._delta_chunk(ChatDelta(**delta), None, logprobs))
            logprobs = None
        if resp.finish_reason:
            out.append(self._delta_chunk(ChatDelta(), self._finish(resp.finish_reason), None))
            if self._include_usage:
                usage = Usage.of(resp)
                out.append(
                    self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage)
                )
        return out

    def _finish(self, reason: str) -> str:
        called = self._output is not None and self._output.tool_calls
        return "tool_calls" if called and reason == "stop" else reason

    def opening(self) -> list[BaseModel]:
        return [self._delta_chunk(ChatDelta(role="assistant", content=""), None, None)]

    def _chunk(
        self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]
    ) -> ChatCompletionChunk:
        logprobs = chat_logprobs(self._tokenizer, lps)
        return self._delta_chunk(ChatDelta(content=text), finish, logprobs)

    def _delta_chunk(
        self, delta: ChatDelta, finish: str | None, logprobs: ChatLogprobs | None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish
        )
        return ChatCompletionChunk(**self._meta(self.chunk_object), choices=[choice])

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> ChatCompletion:
        message = self._message(text)  # first: the finish reason depends on its calls
        choice = ChatChoice(
            index=self.index,
            message=message,
            logprobs=chat_logprobs(self._tokenizer, lps),
            finish_reason=self._finish(final.finish_reason),
        )
        meta = self._meta("chat.completion")
        return ChatCompletion(**meta, choices=[choice], usage=Usage.of(final))

    def _message(self, text: str) -> AssistantMessage:
        if self._output is None:
            return AssistantMessage(role="assistant", content=text)
        parsed = self._output.whole(text)
        message = AssistantMessage(
            role="assistant",
            content=None if parsed.tool_calls and not parsed.content.strip() else parsed.content,
        )
        if parsed.reasoning is not None:
            message.reasoning_content = parsed.reasoning or None
        if parsed.tool_calls:
            message.tool_calls = [ToolCallOut(**c.to_openai()) for c in parsed.tool_calls]
        return message
