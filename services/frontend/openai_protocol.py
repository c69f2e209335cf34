"""OpenAI's HTTP request bodies, mapped onto the public ``radixserve.v1`` GenerateRequest.

A body becomes the same GenerateRequest a gRPC client sends, so validation, routing and the
radix cache behave the same through either door.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixserve.v1 import generation_pb2 as pb
from services.frontend.chat_tools import (
    ChatParsers,
    ChatPlan,
    MessageToolCall,
    ToolChoice,
    ToolSpec,
)
from services.frontend.openai_errors import ApiError, shown
from services.frontend.tool_grammar import ToolGrammarError
from services.frontend.validation import MAX_SAMPLES

# Unknown fields are ignored, but these OpenAI ones are not served: anything but their
# "not asked for" values is a 400, since dropping them would answer another question.
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


_DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}
# OpenAI fields that label a request and ask nothing of its output: accepted as they are.
_LABELS = frozenset({"metadata", "safety_identifier", "prompt_cache_key"})


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
                400, f"{name} is not supported by radixserve (got {shown(value)}); {instead}", name
            )
        if name not in _UNSERVED and name not in _LABELS:  # a typo, another server's extension
            raise ApiError(400, f"unknown field {name!r}: radixserve does not serve it", name)


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


# Fits the protobuf int32 behind it: a larger value is a 400, not an overflow (a 500).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


def _first_unencodable(value: Any, path: str) -> str | None:
    """The path of the first string UTF-8 cannot encode (a lone surrogate), or None."""
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
    # With max_tokens 0 the answer scores the prompt alone (as lm-eval's loglikelihood does).
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
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


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
    """OpenAI's ``{"token id": bias}`` as LogitBias entries; ValueError for a non-id key."""
    out = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
            raise ValueError(f"the keys are token ids (decimal strings), got {key!r}")
        out.append(pb.LogitBias(token_id=int(key), bias=value))
    return out


def _constraints_given(body: _SamplingBody) -> list[str]:
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


def one_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
    """OpenAI's four prompt forms cut down to one prompt: text or token ids."""
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
    """A completions body as the public request."""
    req = _request(body, _sampling(body, body.max_tokens))
    if body.logprobs is not None:
        req.sampling.logprobs = True
        req.sampling.top_logprobs = body.logprobs
        req.sampling.prompt_logprobs = body.echo
    req.n = _best_of(body)
    if req.n > body.n:
        req.sampling.logprobs = True  # the samples are ranked by their cumulative logprob
    prompt = one_prompt(body.prompt)
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
    """What the body's tools ask of the output; 400 naming the field at fault."""
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
    """A chat body as the public request, with the constraint of ``plan`` if it has one;
    ``max_completion_tokens`` wins over ``max_tokens``."""
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
