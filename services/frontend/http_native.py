"""SGLang's native HTTP API, so SGLang's frontend language (``sgl.RuntimeEndpoint``) runs
unchanged against radixserve.

``POST /generate`` takes SGLang's body (``text`` or ``input_ids``, one prompt or a list of
them, ``sampling_params`` with SGLang's names, the logprob options at the top level) and
answers ``{"text", "output_ids", "meta_info"}`` per prompt, a list for a list. Each prompt
becomes the same public GenerateRequest a gRPC client sends and runs through the shared
completion path (http_completion.py) with ``NativeShape`` as its Renderer, so the pipeline,
the validation and the radix cache are the OpenAI routes' and gRPC's. Beside it:
``/get_model_info``, ``/server_info`` (and ``/get_server_info``), ``/flush_cache`` and
``/abort_request`` (a running request by its rid, or all of them).

``sampling_params.n`` > 1 answers with a list of n outputs (prompt by prompt in a batch), as
SGLang does; a stream's events then carry their sample's ``index``.

Where radixserve differs from SGLang, it says so instead of pretending (docs/sglang.md):
a parameter SGLang knows but radixserve cannot honour (``skip_special_tokens: false``,
images, LoRA, ...) is a 400 naming it, never ignored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
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
from services.frontend import http_docs as docs
from services.frontend import sse
from services.frontend.http_completion import complete
from services.frontend.openai_errors import ApiError
from services.frontend.openai_protocol import logit_bias_entries
from services.frontend.pipeline import Frontend
from services.frontend.tokenizer import Tokenizer

# Prompts in one /generate body at most; each is its own request in the engine.
MAX_BATCH = 256
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]

# ---- the body ----------------------------------------------------------------------------

# SGLang's inputs that radixserve does not serve: refused when given, since ignoring an image
# or an adapter would answer a different question than the one asked.
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
    """The logprob fields of one prompt; ``at`` is its ``[i]`` in a batch (errors say
    ``logprob_start_len[2]: ...``)."""
    try:
        return LogprobAsk.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(x) for x in err.get("loc", ()))
        raise _bad(f"{name}{at}", str(err.get("msg", "invalid"))) from None


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string UTF-8 cannot encode (JSON's \\ud800 escapes can carry a
    lone surrogate), or None."""
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
    """Each prompt with its own sampling params, logprob options and rid."""
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


# ---- body -> GenerateRequest --------------------------------------------------------------

# Same meaning, same or renamed field of the public SamplingParams.
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


# ---- GenerateResponse -> SGLang's answer -----------------------------------------------


class NativeOutput(BaseModel):
    """One prompt's answer, or one event of its stream (text and ids so far)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None  # the sample's, with n > 1 (set only then, as SGLang does)


Entry = list[Any]  # [logprob or null, token id, token text or null]


class NativeShape:
    """SGLang's shape of one generation (a Renderer for http_completion.complete).

    A stream's events carry the text and ids so far (cumulative, as SGLang's client reads
    them), not the new piece; ``meta_info.finish_reason`` is null until the last.
    """

    def __init__(self, tokenizer: Tokenizer, item: NativeItem, first_id: int | None = None) -> None:
        self.input_param = item.input_param
        self._tok = tokenizer
        self._ask = item.ask
        self._stops = {*item.req.sampling.stop, *item.req.sampling.stop_regex}
        self._first_id = first_id  # prompt token 0, for its null entry (start 0 only)
        self._item = item
        self._index: int | None = None  # a fork's sample (n > 1)
        self._text = ""
        self._ids: list[int] = []
        self._out_lps: list[pb.TokenLogprob] = []
        self._prompt_lps: list[pb.TokenLogprob] = []

    def opening(self) -> list[BaseModel]:
        return []

    def fork(self, index: int) -> NativeShape:
        shape = NativeShape(self._tok, self._item, self._first_id)
        shape._index = index
        return shape

    def closing(self, finals: Sequence[pb.GenerateResponse]) -> list[BaseModel]:
        return []

    def combine(
        self, answers: Sequence[BaseModel], wholes: Sequence[pb.GenerateResponse]
    ) -> list[dict[str, Any]]:
        """n samples: a list of n outputs, as SGLang answers them."""
        return [sse.payload(a) for a in answers]

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        self._add(resp)
        if not (resp.text or resp.token_ids or resp.finish_reason):
            return []
        return [self._output(resp)]

    def events(self, resp: pb.GenerateResponse) -> str:
        # Every event repeats the text so far: no template fits them.
        return sse.events(self.chunks(resp))

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> BaseModel:
        # http_completion hands over the whole generation merged into ``final``.
        self._add(final)
        self._text = text
        return self._output(final)

    def _add(self, resp: pb.GenerateResponse) -> None:
        self._text += resp.text
        self._ids.extend(resp.token_ids)
        self._out_lps.extend(resp.logprobs)
        self._prompt_lps.extend(resp.prompt_logprobs)

    def _output(self, resp: pb.GenerateResponse) -> NativeOutput:
        meta: dict[str, Any] = {"id": resp.request_id, "finish_reason": None}
        if resp.finish_reason:
            meta["finish_reason"] = self._finish(resp)
            meta["prompt_tokens"] = resp.prompt_tokens
        if self._ask.return_logprob:
            meta.update(self._logprobs())
        meta["completion_tokens"] = resp.completion_tokens or len(self._ids)
        if resp.finish_reason:
            meta["cached_tokens"] = resp.cached_tokens
            d = resp.cached_tokens_details
            meta["cached_tokens_details"] = {
                "device": resp.cached_tokens - d.host - d.storage, "host": d.host,
                "storage": d.storage,
            }  # fmt: skip
            meta["e2e_latency"] = resp.timings.total_time
        out = NativeOutput(text=self._text, output_ids=list(self._ids), meta_info=meta)
        if self._index is not None:
            out.index = self._index
        return out

    def _finish(self, resp: pb.GenerateResponse) -> dict[str, Any]:
        """SGLang's finish reasons: a matched stop string as text, a stop token as its id."""
        if resp.finish_reason == "length":
            return {"type": "length", "length": resp.completion_tokens}
        if resp.finish_reason == "stop":
            matched: str | int | None = None
            if resp.matched_stop in self._stops:
                matched = resp.matched_stop
            elif resp.matched_stop and self._ids:
                matched = self._ids[-1]  # the stop token ends the output
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": resp.matched_stop or "the request was aborted"}

    def _logprobs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input_token_logprobs": self._prompt_entries(),
            "output_token_logprobs": [self._entry(lp.logprob, lp.token_id) for lp in self._out_lps],
        }
        if self._ask.top_logprobs_num > 0:
            out["input_top_logprobs"] = self._prompt_tops()
            out["output_top_logprobs"] = [self._tops(lp) for lp in self._out_lps]
        return out

    def _prompt_entries(self) -> list[Entry]:
        """From logprob_start_len on; position 0 has no logit, so its logprob is null."""
        if not self._ask.prompt:
            return []
        entries = [self._entry(lp.logprob, lp.token_id) for lp in self._prompt_lps]
        if self._ask.logprob_start_len == 0 and self._first_id is not None:
            entries.insert(0, self._entry(None, self._first_id))
        return entries

    def _prompt_tops(self) -> list[list[Entry] | None]:
        if not self._ask.prompt:
            return []
        tops: list[list[Entry] | None] = [self._tops(lp) for lp in self._prompt_lps]
        if self._ask.logprob_start_len == 0 and self._first_id is not None:
            tops.insert(0, None)
        return tops

    def _tops(self, lp: pb.TokenLogprob) -> list[Entry]:
        return [self._entry(t.logprob, t.token_id) for t in lp.top]

    def _entry(self, logprob: float | None, token_id: int) -> Entry:
        text = None
        if self._ask.return_text_in_logprobs:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        return [logprob, token_id, text]


# ---- /abort_request ------------------------------------------------------------------------


def parse_abort(body: Any) -> str | None:
    """SGLang's AbortReq: the rid to abort, or None for ``abort_all``. A batch's prompts
    sent under one rid go with it (rid_0, rid_1, ...); unlike SGLang, which aborts every rid
    that starts with the one given, no other request does."""
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


# ---- the routes --------------------------------------------------------------------------


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
    """Every prompt at once, answered with a list in their order.

    Each runs to its end even if another fails, so no request is left without a reader;
    the first failure is then the answer.
    """
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
        # SGLang's client picks its chat template by matching model_path against model
        # names; the served name is what radixserve can say (--served-model-name sets it).
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
        # ?storage=true deletes the storage tier's pages as well.
        res = await frontend.flush_cache(storage)
        body = {"flushed": res.flushed, "message": res.message}
        return JSONResponse(body, status_code=200 if res.flushed else 400)

    return router
