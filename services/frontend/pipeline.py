"""One generation, end to end on the frontend, shared by the gRPC and the HTTP API.

validate -> tokenize (chat template) -> check length -> route to an engine -> for every
TokenDelta: detokenize incrementally, apply stop strings, yield a GenerateResponse. A
consumer that stops iterating (client cancelled or went away) aborts the request at its
scheduler at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.common.transport import pack_i32
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import DuplicateRequestError, EngineClient
from services.frontend.stop_strings import StopStringMatcher
from services.frontend.tokenizer import Tokenizer
from services.frontend.validation import (
    ValidationError,
    validate_input,
    validate_length,
    validate_request,
)

log = logging.getLogger(__name__)


class FrontendError(Exception):
    """A request failure with its gRPC status; ``field`` is set for INVALID_ARGUMENT."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def _invalid(e: ValidationError) -> FrontendError:
    return FrontendError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field)


def _status_from_name(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


@dataclass
class _Progress:
    """Counts and timings of a request so far (the last delta's values win)."""

    completion_tokens: int = 0
    cached_tokens: int = 0
    last: engine_pb2.TokenDelta = field(default_factory=engine_pb2.TokenDelta)


class Frontend:
    def __init__(self, tokenizer: Tokenizer, engines: EngineClient, model_id: str) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.model_id = model_id

    # ---- small calls -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        info = self.engines.info
        return info.worker.vocab_size if info and info.worker.vocab_size else self.tokenizer.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engines.info.max_model_len if self.engines.info else 0

    def model_info(self) -> pb.GetModelInfoResponse:
        self._require_ready()
        info = self.engines.info
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
        if kind == "input_ids":
            return list(req.input_ids.ids)
        if kind == "text":
            return self.tokenizer.encode(req.text)
        try:
            return self.tokenizer.encode_chat([(m.role, m.content) for m in req.messages.messages])
        except Exception as e:  # a template may raise on a conversation it does not accept
            raise ValidationError("messages", f"the chat template refused them: {e}") from e

    def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        try:
            validate_input(req, self.vocab_size)
            ids = self._encode(req)
        except ValidationError as e:
            raise _invalid(e) from e
        return pb.TokenizeResponse(ids=ids, tokens=self.tokenizer.token_strings(ids))

    async def flush_cache(self) -> pb.FlushCacheResponse:
        return await self.engines.flush_cache()

    def _require_ready(self) -> None:
        if not self.engines.ready:
            raise FrontendError(grpc.StatusCode.UNAVAILABLE, "the engines are not ready yet; retry shortly")

    # ---- generate ----------------------------------------------------------------

    def _prepare(self, req: pb.GenerateRequest, arrival: float) -> tuple[engine_pb2.TokenizedRequest, list[int]]:
        self._require_ready()
        try:
            validate_request(req, self.vocab_size)
            ids = self._encode(req)
            validate_length(len(ids), req.sampling, self.max_model_len)
        except ValidationError as e:
            raise _invalid(e) from e
        treq = engine_pb2.TokenizedRequest(
            rid=req.request_id or uuid.uuid4().hex,
            input_ids=pack_i32(ids),
            sampling=req.sampling,
            priority=req.priority,
            cache_salt=req.cache_salt,
            eos_token_ids=self.tokenizer.eos_token_ids,
            arrival_time=arrival,
        )
        return treq, ids

    def open(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Validates and submits now (raising FrontendError); returns the response stream.

        The caller must iterate the stream (or ``aclose`` it): its end releases the request.
        """
        arrival = time.time()
        treq, ids = self._prepare(req, arrival)
        try:
            queue = self.engines.submit(treq, ids)
        except DuplicateRequestError as e:
            raise FrontendError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {treq.rid!r} is already in flight") from e
        return self._run(treq, ids, queue, arrival)

    async def generate(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the responses; raises FrontendError for a bad or failed request."""
        async for resp in self.open(req):
            yield resp

    async def _run(self, treq, ids, queue, arrival) -> AsyncIterator[pb.GenerateResponse]:
        finished = False
        try:
            async for resp in self._stream(treq, ids, queue, arrival):
                finished = finished or bool(resp.finish_reason)
                yield resp
            finished = True
        finally:
            if not finished:  # cancelled, disconnected or failed: free the engine's work now
                self.engines.abort(treq.rid, "cancelled by the client")
            self.engines.release(treq.rid)

    async def _stream(self, treq, ids, queue, arrival) -> AsyncIterator[pb.GenerateResponse]:
        sp = treq.sampling
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids)
        stops = StopStringMatcher(sp.stop)
        progress = _Progress()
        while True:
            delta: engine_pb2.TokenDelta = await queue.get()
            if delta.error_code:
                raise FrontendError(_status_from_name(delta.error_code), delta.finish_message or delta.error_code)
            progress.completion_tokens += len(delta.token_ids)
            progress.cached_tokens = max(progress.cached_tokens, delta.cached_tokens)
            progress.last = delta
            text = stops.feed(detok.add(delta.token_ids))
            if delta.finish_reason and stops.matched is None:
                text += stops.feed(detok.flush())
                text += stops.flush()
            resp = pb.GenerateResponse(request_id=treq.rid, token_ids=delta.token_ids, text=text)
            if sp.logprobs:
                resp.logprobs.extend(delta.logprobs)
            if stops.matched is not None:
                # The scheduler does not see text: tell it to stop now.
                self.engines.abort(treq.rid, "stop string matched")
                self._finish(resp, "stop", stops.matched, len(ids), progress, arrival)
                yield resp
                return
            if delta.finish_reason:
                self._finish(resp, delta.finish_reason, self._stop_token_text(delta), len(ids), progress, arrival)
                yield resp
                return
            yield resp

    def _stop_token_text(self, delta: engine_pb2.TokenDelta) -> str:
        if delta.finish_reason != "stop" or delta.matched_stop_token < 0:
            return ""
        return self.tokenizer.token_strings([delta.matched_stop_token])[0]

    @staticmethod
    def _finish(resp, reason: str, matched: str, prompt_len: int, progress: _Progress, arrival: float) -> None:
        last = progress.last
        resp.finish_reason = reason
        resp.matched_stop = matched
        resp.prompt_tokens = last.prompt_tokens or prompt_len
        resp.cached_tokens = progress.cached_tokens
        resp.completion_tokens = max(last.completion_tokens, progress.completion_tokens)
        resp.timings.CopyFrom(
            pb.Timings(
                queue_time=last.queue_time,
                prefill_time=last.prefill_time,
                decode_time=last.decode_time,
                total_time=time.time() - arrival,
            )
        )
