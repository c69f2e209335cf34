"""SGLang's native request bodies (``/generate``, ``/abort_request``), mapped onto the public
``radixserve.v1`` GenerateRequest.

Anything wrong is a 400 naming SGLang's field; a parameter SGLang knows but radixserve cannot
honour is refused, never ignored (docs/sglang.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from radixserve.v1 import generation_pb2 as pb
from services.common.sampling_limits import MAX_TOP_LOGPROBS
from services.frontend.openai_errors import ApiError
from services.frontend.openai_protocol import logit_bias_entries

# Prompts in one /generate body at most; each is its own request in the engine.
MAX_BATCH = 256
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]

# Refused when given: ignoring an image or an adapter would answer a different question.
_UNSERVED_INPUTS = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "token_ids_logprob",
    "return_hidden_states",
)


class NativeSampling(BaseModel):
    """SGLang's ``sampling_params`` (its names and defaults); an unknown key is a 400, as in
    SGLang. ``null`` means the default, as in SGLang."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    min_new_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None  # -1: off (SGLang); 0 is refused, as SGLang does
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool | None = None
    # radixserve's: opt out of speculative decoding (--speculative-algorithm) for this request.
    disable_speculation: bool | None = None
    skip_special_tokens: bool | None = None
    # Only matters where special tokens are kept in the text; radixserve always skips them.
    spaces_between_special_tokens: bool | None = None
    n: Int32 | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | bool | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None  # xgrammar's JSON, as text or object
    sampling_seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stream_interval: Int32 | None = None  # a pacing hint: radixserve streams every step
    stop_regex: str | list[str] | None = None  # SGLang's client sends [] for none
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    # Known to SGLang, not served by radixserve: refused unless left at their defaults.
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        logit_bias_entries(bias)  # ValueError for a key that is not a token id
        return bias

    @model_validator(mode="after")
    def _served(self) -> NativeSampling:
        refusal = _unserved_sampling(self)
        if refusal is not None:
            raise ValueError(refusal)
        return self


_CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")


def _unserved_sampling(sp: NativeSampling) -> str | None:
    """Why a parameter SGLang knows cannot be honoured here, or None."""
    if sp.n is not None and sp.n < 1:  # the upper bound is validation's (MAX_SAMPLES)
        return f"n must be at least 1, got {sp.n}"
    if sp.top_k == 0:
        return "top_k must be -1 (off) or >= 1, got 0"
    if sp.skip_special_tokens is False:
        return "skip_special_tokens: radixserve always leaves special tokens out of the text"
    if sp.no_stop_trim:
        return "no_stop_trim: radixserve always cuts the text before a stop string"
    if sp.custom_params is not None:
        return "custom_params is not supported by radixserve"
    constraints = [c for c in _CONSTRAINTS if getattr(sp, c) is not None]
    if len(constraints) > 1:
        return f"at most one of {', '.join(_CONSTRAINTS)}; got {' and '.join(constraints)}"
    return None


class LogprobAsk(BaseModel):
    """One prompt's logprob options (SGLang's top-level fields)."""

    return_logprob: bool = False
    # -1: output tokens only; else the first prompt position whose logprob is returned.
    logprob_start_len: Annotated[int, Field(ge=-1, le=2**31 - 1)] = -1
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    return_text_in_logprobs: bool = False

    @property
    def prompt(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


@dataclass(frozen=True)
class NativeItem:
    """One prompt of a /generate body, ready to submit."""

    req: pb.GenerateRequest
    ask: LogprobAsk
    input_param: str  # "text" or "input_ids": the field blamed for a bad prompt


@dataclass(frozen=True)
class NativeBody:
    items: list[NativeItem]
    batch: bool  # a list of prompts: answered with a list
    stream: bool


def _bad(field: str, message: str) -> ApiError:
    """A 400 naming ``field``; its top-level name is the error's param."""
    return ApiError(400, f"{field}: {message}", field.split(".", 1)[0].split("[", 1)[0])


def _prompts(body: dict[str, Any]) -> tuple[list[str | list[int]], bool, str]:
    """The prompts, whether they came as a batch, and the field that held them."""
    given = [k for k in ("text", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise _bad("text", "give exactly one of text or input_ids")
    field = given[0]
    value = body[field]
    if field == "text":
        if isinstance(value, str):
            return [value], False, field
        if isinstance(value, list) and all(isinstance(t, str) for t in value):
            return _non_empty_batch(list(value), field), True, field
        raise _bad(field, "must be a string or a list of strings")
    if isinstance(value, list) and value and all(_is_id(t) for t in value):
        return [list(value)], False, field
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        for i, p in enumerate(value):
            if not p or not all(_is_id(t) for t in p):
                raise _bad(f"{field}[{i}]", "must be a non-empty list of token ids")
        return _non_empty_batch([list(p) for p in value], field), True, field
    raise _bad(field, "must be a non-empty list of token ids, or a list of such lists")


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and -(2**31) <= t < 2**31


def _non_empty_batch(prompts: list[Any], field: str) -> list[Any]:
    if not prompts:
        raise _bad(field, "the batch is empty")
    if len(prompts) > MAX_BATCH:
        raise _bad(field, f"at most {MAX_BATCH} prompts in one request, got {len(prompts)}")
    return prompts


def _per_prompt(body: dict[str, Any], name: str, n: int, batch: bool) -> list[Any]:
    """A top-level option for each prompt: one value for all, or (in a batch) a list."""
    value = body.get(name)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise _bad(name, f"has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _rids(body: dict[str, Any], n: int, batch: bool) -> list[str]:
    """SGLang's rule: one rid for a batch becomes rid_0, rid_1, ...; a list gives each."""
    rid = body.get("rid")
    if rid is None:
        return [""] * n  # the frontend makes one
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    if batch and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise _bad("rid", f"has {len(rid)} entries for {n} prompts")
        return list(rid)
    raise _bad("rid", "must be a string" + (" or a list of strings" if batch else ""))


def _pydantic_message(prefix: str, e: ValidationError) -> ApiError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown sampling parameter (SGLang's names: max_new_tokens, stop, ...)"
    field = f"{prefix}.{loc}" if loc else prefix
    return _bad(field, msg)


def _sampling(raw: Any, where: str) -> NativeSampling:
    if raw is None:
        return NativeSampling()
    if not isinstance(raw, dict):
        raise _bad(where, "must be an object")
    try:
        return NativeSampling.model_validate(raw)
    except ValidationError as e:
        raise _pydantic_message(where, e) from None


def _logprob_ask(values: dict[str, Any], at: str) -> LogprobAsk:
    """The logprob fields of one prompt; ``at`` is its ``[i]`` in a batch."""
    try:
        return LogprobAsk.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(x) for x in err.get("loc", ()))
        raise _bad(f"{name}{at}", str(err.get("msg", "invalid"))) from None


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string UTF-8 cannot encode (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items: Any = value.items() if isinstance(value, dict) else ()
    if isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    for key, item in items:
        sub = key if key.startswith("[") else f".{key}"
        found = _lone_surrogate(item, f"{path}{sub}".lstrip("."))
        if found:
            return found
    return None


def parse_generate(body: Any) -> NativeBody:
    """A /generate body as requests; ApiError (400) naming the field for anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    bad = _lone_surrogate(body, "")
    if bad is not None:
        raise _bad(bad, "invalid Unicode (a lone surrogate)")
    for name in _UNSERVED_INPUTS:
        if body.get(name) not in (None, False, [], {}):
            raise _bad(name, "is not supported by radixserve")
    prompts, batch, input_param = _prompts(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be true or false")
    if stream and batch:
        raise _bad("stream", "streaming a batch is not supported; stream one prompt per request")
    items = _items(body, prompts, batch, input_param)
    return NativeBody(items, batch, stream)


_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


def _items(
    body: dict[str, Any], prompts: list[str | list[int]], batch: bool, input_param: str
) -> list[NativeItem]:
    n = len(prompts)
    rids = _rids(body, n, batch)
    params = _per_prompt(body, "sampling_params", n, batch)
    params_each = batch and isinstance(body.get("sampling_params"), list)
    per = {name: _per_prompt(body, name, n, batch) for name in _LOGPROB_FIELDS}
    items = []
    for i, prompt in enumerate(prompts):
        at = f"[{i}]" if batch else ""
        sp = _sampling(params[i], "sampling_params" + (at if params_each else ""))
        values = {name: per[name][i] for name in _LOGPROB_FIELDS}
        values["return_text_in_logprobs"] = body.get("return_text_in_logprobs")
        ask = _logprob_ask(values, at)
        items.append(NativeItem(_request(prompt, sp, ask, rids[i]), ask, input_param))
    return items


_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty")


def _request(
    prompt: str | list[int], sp: NativeSampling, ask: LogprobAsk, rid: str
) -> pb.GenerateRequest:
    out = pb.SamplingParams(
        stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop or []),
        stop_token_ids=sp.stop_token_ids or [],
        ignore_eos=bool(sp.ignore_eos),
        disable_speculation=bool(sp.disable_speculation),
        stop_regex=[sp.stop_regex] if isinstance(sp.stop_regex, str) else sp.stop_regex or [],
        logit_bias=logit_bias_entries(sp.logit_bias),
    )
    for name in (*_FLOATS, "repetition_penalty"):
        value = getattr(sp, name)
        if value is not None:  # unset stays unset: the engine applies its own default
            setattr(out, name, value)
    if sp.max_new_tokens is not None:
        out.max_tokens = sp.max_new_tokens
    if sp.min_new_tokens is not None:
        out.min_tokens = sp.min_new_tokens
    if sp.top_k is not None and sp.top_k != -1:
        out.top_k = sp.top_k
    if sp.sampling_seed is not None:
        out.seed = sp.sampling_seed
    if sp.regex is not None:
        out.regex = sp.regex
    elif sp.ebnf is not None:
        out.ebnf = sp.ebnf
    elif sp.json_schema is not None:
        schema = sp.json_schema
        out.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif sp.structural_tag is not None:
        tag = sp.structural_tag
        out.structural_tag = tag if isinstance(tag, str) else json.dumps(tag)
    if ask.return_logprob:
        out.logprobs = True
        out.top_logprobs = ask.top_logprobs_num
    if ask.prompt:
        out.prompt_logprobs = True
        out.prompt_logprobs_start = max(ask.logprob_start_len, 1)  # position 0 has no logit
    req = pb.GenerateRequest(request_id=rid, sampling=out, n=sp.n or 1)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)
    return req


# Public field paths (in the pipeline's messages) -> SGLang's names for them.
_NATIVE_NAMES = (
    ("sampling.max_tokens", "sampling_params.max_new_tokens"),
    ("sampling.min_tokens", "sampling_params.min_new_tokens"),
    ("sampling.top_logprobs", "top_logprobs_num"),
    ("sampling.prompt_logprobs_start", "logprob_start_len"),
    ("sampling.seed", "sampling_params.sampling_seed"),
    ("sampling.", "sampling_params."),
    ("n: ", "sampling_params.n: "),
    ("input_ids.ids", "input_ids"),
    ("request_id", "rid"),
)


def native_error(e: ApiError, index: int | None = None) -> ApiError:
    """A pipeline error, its field renamed to what the /generate body calls it."""
    message, param = e.message, e.param
    for public, native in _NATIVE_NAMES:
        if message.startswith(public):
            message = native + message[len(public) :]
            param = native.split(".", 1)[0]
            break
    if index is not None:
        message = f"prompt {index}: {message}"
    return ApiError(e.status, message, param, e.kind, e.headers)


def parse_abort(body: Any) -> str | None:
    """SGLang's AbortReq: the rid to abort, or None for ``abort_all``. Unlike SGLang, only
    the rid and its batch (rid_0, rid_1, ...) go, not every rid it prefixes."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise _bad("abort_all", "must be true or false")
    if not isinstance(rid, str):
        raise _bad("rid", "must be a string")
    if abort_all:
        return None
    if not rid:
        raise _bad("rid", "give the rid of the request to abort, or abort_all: true")
    return rid
