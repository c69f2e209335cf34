"""One generation, end to end on the frontend, shared by the gRPC and the HTTP API.

validate -> tokenize (chat template) -> check length -> route to an engine -> for every
TokenDelta: detokenize incrementally, apply stop strings, yield a GenerateResponse. A
consumer that stops iterating (client cancelled or went away) aborts the request at its
scheduler at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.common.transport import pack_i32
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import DuplicateRequestError, EngineClient, EngineInfo
from services.frontend.engine_messages import (
    flush_to_public,
    logprobs_to_public,
    sampling_to_engine,
)
from services.frontend.metrics import FrontendMetrics
from services.frontend.parallel_sampling import interleave, prefill_request, sample_requests
from services.frontend.spans import RequestSpan
from services.frontend.stop_strings import StopRegexTimeout, StopStringMatcher, feed_tokens
from services.frontend.tokenizer import ChatToolsError, Tokenizer
from services.frontend.validation import (
    ValidationError,
    validate_input,
    validate_length,
    validate_request,
    validate_samples,
    validate_text_size,
)

log = logging.getLogger(__name__)

_Deltas = asyncio.Queue[engine_pb2.TokenDelta]  # one request's deltas, from its engine

# How long a stop-string finish waits for the scheduler's closing delta (counts, timings).
FINAL_DELTA_WAIT_S = 0.5


class FrontendError(Exception):
    """A request failure with its gRPC status; ``field`` is set for INVALID_ARGUMENT."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str | None = None,
        retry_after: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after  # overloaded: seconds until a retry may be admitted


def _invalid(e: ValidationError) -> FrontendError:
    return FrontendError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field)


def _status_from_name(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def _engine_error(delta: engine_pb2.TokenDelta, sp: engine_pb2.SamplingParams) -> FrontendError:
    """The engine's failure; its INVALID_ARGUMENT (a refused constraint) names that field."""
    code = _status_from_name(delta.error_code)
    message = delta.finish_message or delta.error_code
    kind = sp.constraint.WhichOneof("kind") if sp.HasField("constraint") else None
    if code == grpc.StatusCode.INVALID_ARGUMENT and kind is not None:
        return FrontendError(code, f"sampling.{kind}: {message}", f"sampling.{kind}")
    return FrontendError(code, message, retry_after=delta.retry_after)


@dataclass
class _Progress:
    """Counts and timings of a request so far; the scheduler's last delta carries its totals."""

    delivered: int = 0  # tokens streamed to the client
    cached_tokens: int = 0
    cached_host: int = 0  # of them, loaded from the host tier / the storage tier
    cached_storage: int = 0
    last: engine_pb2.TokenDelta = field(default_factory=engine_pb2.TokenDelta)

    def note(self, delta: engine_pb2.TokenDelta | None) -> None:
        if delta is not None:
            if delta.cached_tokens > self.cached_tokens:
                self.cached_tokens = delta.cached_tokens
                self.cached_host = delta.cached_host_tokens
                self.cached_storage = delta.cached_storage_tokens
            self.last = delta


@dataclass
class _InFlight:
    treq: engine_pb2.TokenizedRequest
    stop: list[str]  # stop strings: the engine never sees text, so the frontend applies them
    stop_regex: list[str]  # and stop regexes
    ids: list[int]  # the prompt
    queue: _Deltas
    arrival: float


class Frontend:
    def __init__(
        self,
        tokenizer: Tokenizer,
        engines: EngineClient,
        model_id: str,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.model_id = model_id
        self.metrics = metrics or FrontendMetrics(model_id)

    @property
    def vocab_size(self) -> int:
        info = self.engines.info
        return (
            info.worker.vocab_size if info and info.worker.vocab_size else self.tokenizer.vocab_size
        )

    @property
    def max_model_len(self) -> int:
        return self.engines.info.max_model_len if self.engines.info else 0

    def model_info(self) -> pb.GetModelInfoResponse:
        info = self._require_ready()
        return pb.GetModelInfoResponse(
            model_id=self.model_id,
            max_model_len=info.max_model_len,
            vocab_size=self.vocab_size,
            page_size=info.page_size,
            max_total_num_tokens=info.max_total_num_tokens,
            num_engines=info.num_engines,
            architecture=info.worker.architecture,
        )

    def _encode(self, req: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        kind = req.WhichOneof("input")
        if kind == "input_ids" and isinstance(req, pb.GenerateRequest):  # Tokenize has no ids
            return list(req.input_ids.ids)
        if kind == "text":
            return self.tokenizer.encode(req.text)
        messages, tools = template_chat(req.messages)
        try:
            return self.tokenizer.encode_chat(messages, tools)
        except ChatToolsError as e:
            raise ValidationError(e.field, str(e)) from e
        except Exception as e:  # a template may raise on a conversation it does not accept
            raise ValidationError("messages", f"the chat template refused them: {e}") from e

    def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        try:
            validate_input(req, self.vocab_size)
            validate_text_size(req, self.max_model_len)
            ids = self._encode(req)
        except ValidationError as e:
            raise _invalid(e) from e
        return pb.TokenizeResponse(ids=ids, tokens=self.tokenizer.token_strings(ids))

    async def flush_cache(self, storage: bool = False) -> pb.FlushCacheResponse:
        return flush_to_public(await self.engines.flush_cache(storage))

    def abort(self, rid: str | None, reason: str) -> list[str]:
        """Aborts ``rid`` with its batch prompts and samples (``rid_0``, ``rid_0_3``), or all
        for None; each stream ends with finish_reason "abort". Returns the rids aborted."""
        batch = re.compile(re.escape(rid) + r"(_\d+)*(_prefill)?") if rid is not None else None
        rids = [
            r for r in self.engines.in_flight() if batch is None or r == rid or batch.fullmatch(r)
        ]
        for r in rids:
            self.engines.abort(r, reason)
        return rids

    def _require_ready(self) -> EngineInfo:
        """What the engines said about themselves; refuses while they have not answered."""
        info = self.engines.info
        if not self.engines.ready or info is None:
            raise FrontendError(
                grpc.StatusCode.UNAVAILABLE, "the engines are not ready yet; retry shortly"
            )
        return info

    def _prepare(
        self, req: pb.GenerateRequest, arrival: float
    ) -> tuple[engine_pb2.TokenizedRequest, list[int]]:
        info = self._require_ready()
        try:
            validate_request(req, self.vocab_size)
            validate_text_size(req, self.max_model_len)  # before paying for tokenizing it
            ids = self._encode(req)
            validate_length(len(ids), req.sampling, self.max_model_len)
            pool = info.max_total_num_tokens
            validate_samples(req.n, len(ids), req.sampling, self.max_model_len, pool)
        except ValidationError as e:
            raise _invalid(e) from e
        treq = engine_pb2.TokenizedRequest(
            rid=req.request_id or uuid.uuid4().hex,
            input_ids=pack_i32(ids),
            sampling=sampling_to_engine(req.sampling),
            priority=req.priority,
            cache_salt=req.cache_salt,
            eos_token_ids=self.tokenizer.eos_token_ids,
            arrival_time=arrival,
        )
        return treq, ids

    async def open(
        self, req: pb.GenerateRequest, caller_trace: Mapping[str, str] | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Validates and submits now (raising FrontendError); returns the response stream.

        The caller must iterate the stream (or ``aclose`` it): its end releases the request.
        ``caller_trace`` is the caller's W3C context. Tokenizing runs on a worker thread so a
        huge prompt does not stall the event loop. With ``n`` > 1 the stream interleaves the
        samples, each with its ``index``.
        """
        arrival = time.time()
        span = RequestSpan(self.model_id, caller_trace)
        try:
            with span.child("tokenize"):
                treq, ids = await asyncio.to_thread(self._prepare, req, arrival)
            treq.trace_context.update(span.carrier())
            if req.n > 1:
                return await self._open_samples(req, treq, ids, span)
            queue = self._submit(treq, ids)
        except FrontendError as e:
            self.metrics.on_error(e.code.name)
            span.finish(req.request_id, None, e.code.name)
            raise
        sp = req.sampling
        job = _InFlight(treq, list(sp.stop), list(sp.stop_regex), ids, queue, arrival)
        return self._run(job, span)

    def _submit(
        self, treq: engine_pb2.TokenizedRequest, ids: list[int], pin: str | None = None
    ) -> _Deltas:
        try:
            return self.engines.submit(treq, ids, pin) if pin else self.engines.submit(treq, ids)
        except DuplicateRequestError as e:
            raise FrontendError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {treq.rid!r} is already in flight"
            ) from e

    async def generate(
        self, req: pb.GenerateRequest, caller_trace: Mapping[str, str] | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the responses; raises FrontendError for a bad or failed request."""
        async for resp in await self.open(req, caller_trace):
            yield resp

    async def _run(
        self, job: _InFlight, span: RequestSpan, own_span: bool = True
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """``own_span``: the request's span ends with this stream (not with one sample's)."""
        final: pb.GenerateResponse | None = None
        error = "CANCELLED"
        last_t: float | None = None
        try:
            with span.child("stream"):
                async for resp in self._stream(job):
                    now = time.time()
                    since_last = None if last_t is None else now - last_t
                    self.metrics.on_tokens(len(resp.token_ids), now - job.arrival, since_last)
                    last_t = now
                    if resp.finish_reason:
                        final, error = resp, ""
                        self.metrics.on_finish(resp)
                    yield resp
        except FrontendError as e:
            error = e.code.name
            self.metrics.on_error(error)
            raise
        finally:
            if final is None:  # cancelled, disconnected or failed: free the engine's work now
                self.engines.abort(job.treq.rid, "cancelled by the client")
            self.engines.release(job.treq.rid)
            if own_span:
                span.finish(job.treq.rid, final, error)

    async def _open_samples(
        self,
        req: pb.GenerateRequest,
        treq: engine_pb2.TokenizedRequest,
        ids: list[int],
        span: RequestSpan,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Prefills the prompt, then submits the n samples to the engine that holds it."""
        prefill, engine = await self._prefill(prefill_request(treq), ids)
        sp = req.sampling
        jobs: list[_InFlight] = []
        try:
            for sample in sample_requests(treq, req.n):
                queue = self._submit(sample, ids, engine)
                stops = list(sp.stop), list(sp.stop_regex)
                jobs.append(_InFlight(sample, *stops, ids, queue, treq.arrival_time))
        except FrontendError:
            for job in jobs:
                self._drop(job.treq.rid)
            raise
        return self._samples(treq.rid, jobs, span, prefill)

    async def _prefill(
        self, treq: engine_pb2.TokenizedRequest, ids: list[int]
    ) -> tuple[engine_pb2.TokenDelta, str | None]:
        """Runs the prompt alone to its end: its last delta (the counts) and its engine."""
        queue = self._submit(treq, ids)
        done = False
        try:
            while not ((delta := await queue.get()).finish_reason or delta.error_code):
                pass
            if delta.error_code:
                raise _engine_error(delta, treq.sampling)
            if delta.finish_reason == "abort":
                why = delta.finish_message or "aborted"
                raise FrontendError(grpc.StatusCode.CANCELLED, f"the prompt's prefill: {why}")
            done = True
            return delta, self.engines.engine_of(treq.rid)
        finally:
            if not done:
                self.engines.abort(treq.rid, "cancelled by the client")
            self.engines.release(treq.rid)

    async def _samples(
        self, rid: str, jobs: list[_InFlight], span: RequestSpan, prefill: engine_pb2.TokenDelta
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The samples' responses, each with its index; cached_tokens is the prefill's, since
        the samples' reuse of the prefill is the request's own."""
        finals: list[pb.GenerateResponse] = []
        error = "CANCELLED"
        try:
            streams = [self._run(job, span, own_span=False) for job in jobs]
            async with contextlib.aclosing(interleave(streams)) as merged:
                async for i, resp in merged:
                    resp.index = i
                    if resp.finish_reason:
                        _cached_as(resp, prefill)
                        finals.append(resp)
                    yield resp
            error = ""
        except FrontendError as e:
            error = e.code.name
            raise
        finally:
            for job in jobs:  # a sample closed before it started still holds its entry
                self._drop(job.treq.rid)
            span.finish(rid, _summary(finals) if not error else None, error)

    def _drop(self, rid: str) -> None:
        self.engines.abort(rid, "cancelled by the client")
        self.engines.release(rid)

    async def _stream(self, job: _InFlight) -> AsyncIterator[pb.GenerateResponse]:
        treq, ids, queue, arrival = job.treq, job.ids, job.queue, job.arrival
        sp = treq.sampling
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids)
        stops = StopStringMatcher(job.stop, job.stop_regex)
        progress = _Progress()
        while True:
            delta: engine_pb2.TokenDelta = await queue.get()
            if delta.error_code:
                raise _engine_error(delta, sp)
            progress.note(delta)
            done = progress.delivered
            text, kept = _stopped_text(stops, detok, delta, done, sp.min_tokens)
            progress.delivered += kept
            new = delta.token_ids[:kept]  # a stop string in the middle: nothing after it
            resp = pb.GenerateResponse(request_id=treq.rid, token_ids=new, text=text)
            if sp.logprobs:
                resp.logprobs.extend(logprobs_to_public(delta.logprobs[:kept]))
            if sp.prompt_logprobs and delta.prompt_logprobs_start:
                # The scheduler sends them once, on its first delta: our first response.
                resp.prompt_logprobs.extend(logprobs_to_public(delta.prompt_logprobs))
                resp.prompt_logprobs_start = delta.prompt_logprobs_start
            if stops.matched is not None:
                # The scheduler does not see text: tell it to stop now, and take the counts
                # and timings from its last delta (they ride only on that one).
                self.engines.abort(treq.rid, "stop string matched")
                if not delta.finish_reason:
                    progress.note(await _final_delta(queue))
                self._finish(
                    resp, "stop", stops.matched, len(ids), progress, arrival, progress.delivered
                )
                yield resp
                return
            if delta.finish_reason:
                n_out = max(delta.completion_tokens, progress.delivered)
                self._finish(
                    resp,
                    delta.finish_reason,
                    self._stop_token_text(delta),
                    len(ids),
                    progress,
                    arrival,
                    n_out,
                )
                yield resp
                return
            yield resp

    def _stop_token_text(self, delta: engine_pb2.TokenDelta) -> str:
        if delta.finish_reason != "stop" or delta.matched_stop_token < 0:
            return ""
        return self.tokenizer.token_strings([delta.matched_stop_token])[0]

    @staticmethod
    def _finish(
        resp: pb.GenerateResponse,
        reason: str,
        matched: str,
        prompt_len: int,
        progress: _Progress,
        arrival: float,
        n_out: int,
    ) -> None:
        last = progress.last
        resp.finish_reason = reason
        resp.matched_stop = matched
        resp.prompt_tokens = last.prompt_tokens or prompt_len
        resp.cached_tokens = progress.cached_tokens
        resp.cached_tokens_details.CopyFrom(
            pb.CachedTokensDetails(
                device=progress.cached_tokens - progress.cached_host - progress.cached_storage,
                host=progress.cached_host,
                storage=progress.cached_storage,
            )
        )
        resp.completion_tokens = n_out
        resp.timings.CopyFrom(
            pb.Timings(
                queue_time=last.queue_time,
                prefill_time=last.prefill_time,
                decode_time=last.decode_time,
                total_time=time.time() - arrival,
            )
        )


def _cached_as(resp: pb.GenerateResponse, prefill: engine_pb2.TokenDelta) -> None:
    host, storage = prefill.cached_host_tokens, prefill.cached_storage_tokens
    resp.cached_tokens = prefill.cached_tokens
    resp.cached_tokens_details.CopyFrom(
        pb.CachedTokensDetails(
            device=prefill.cached_tokens - host - storage, host=host, storage=storage
        )
    )


def _summary(finals: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """The last messages of n samples as one, for the request's span: the prompt once."""
    out = pb.GenerateResponse()
    if finals:
        out.CopyFrom(finals[-1])
        out.completion_tokens = sum(f.completion_tokens for f in finals)
    return out


def template_chat(chat: pb.ChatMessages) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and tools in OpenAI's shapes; a call's arguments become an object, as
    templates write ``arguments | tojson`` (validation checked they parse)."""
    messages = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    return messages, [_template_tool(t) for t in chat.tools]


def _template_tool(tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    no_params = {"type": "object", "properties": {}}
    function["parameters"] = json.loads(tool.parameters) if tool.parameters else no_params
    return {"type": "function", "function": function}


def _stopped_text(
    stops: StopStringMatcher,
    detok: IncrementalDetokenizer,
    delta: engine_pb2.TokenDelta,
    done: int,
    min_tokens: int,
) -> tuple[str, int]:
    """The delta's text through the stop strings and regexes, and how many of its tokens the
    client gets. A multi-token delta (speculative decoding) is fed token by token, so it
    stops where one token per delta would have."""
    ids = delta.token_ids
    kept = len(ids)
    try:
        if len(ids) > 1 and stops.active:
            text = ""
            for j in range(len(ids)):
                text += feed_tokens(stops, detok.add, ids[j : j + 1], done + j, min_tokens)
                if stops.matched is not None:
                    kept = j + 1
                    break
        else:
            text = feed_tokens(stops, detok.add, ids, done, min_tokens)
        if delta.finish_reason and stops.matched is None:
            text += stops.feed(detok.flush())
            text += stops.flush()
    except StopRegexTimeout as e:
        field = f"sampling.stop_regex[{e.index}]"
        raise FrontendError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}", field) from e
    return text, kept


async def _final_delta(queue: _Deltas) -> engine_pb2.TokenDelta | None:
    """The scheduler's closing delta after an abort, or None if it is slow to come."""
    try:
        async with asyncio.timeout(FINAL_DELTA_WAIT_S):
            while not (delta := await queue.get()).finish_reason:
                pass
            return delta
    except TimeoutError:
        return None
