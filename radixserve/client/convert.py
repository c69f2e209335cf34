"""Protobuf responses -> the client's plain dataclasses (types.py): the one place that reads
generation_pb2 messages, so types.py stays free of protobuf and of the client's errors."""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.client.errors import RadixServeError
from radixserve.client.types import (
    Chunk,
    Completion,
    FlushResult,
    ModelInfo,
    Timings,
    TokenLogprob,
    Tokens,
    TopLogprob,
    Usage,
)
from radixserve.v1 import generation_pb2 as pb


def chunk_from_pb(msg: pb.GenerateResponse) -> Chunk:
    last = bool(msg.finish_reason)
    return Chunk(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        logprobs=tuple(_logprob(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason or None,
        matched_stop=msg.matched_stop or None,
        usage=_usage(msg) if last else None,
        timings=_timings(msg.timings) if last else None,
        prompt_logprobs=tuple(_logprob(lp) for lp in msg.prompt_logprobs),
        prompt_logprobs_start=msg.prompt_logprobs_start,
    )


def completion_from_chunks(chunks: Iterable[Chunk]) -> Completion[None]:
    """Joins a finished stream into one Completion; raises if the stream had no last chunk."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    last: Chunk | None = None
    scored: Chunk | None = None  # the one chunk with the prompt logprobs
    for c in chunks:
        text.append(c.text)
        ids.extend(c.token_ids)
        logprobs.extend(c.logprobs)
        last = c
        if c.prompt_logprobs_start:
            scored = c
    if last is None or last.finish_reason is None or last.usage is None or last.timings is None:
        # The server always closes a stream with a finishing message; a stream without one
        # was cut, and a partial answer must not pass for a whole one.
        raise RadixServeError("the stream ended without a final message (finish_reason)")
    return Completion(
        request_id=last.request_id,
        text="".join(text),
        token_ids=tuple(ids),
        finish_reason=last.finish_reason,
        matched_stop=last.matched_stop,
        usage=last.usage,
        timings=last.timings,
        logprobs=tuple(logprobs),
        prompt_logprobs=scored.prompt_logprobs if scored else (),
        prompt_logprobs_start=scored.prompt_logprobs_start if scored else 0,
    )


def tokens_from_pb(msg: pb.TokenizeResponse) -> Tokens:
    return Tokens(ids=tuple(msg.ids), tokens=tuple(msg.tokens))


def model_info_from_pb(msg: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_id=msg.model_id,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        page_size=msg.page_size,
        max_total_num_tokens=msg.max_total_num_tokens,
        num_engines=msg.num_engines,
        architecture=msg.architecture,
    )


def flush_from_pb(msg: pb.FlushCacheResponse) -> FlushResult:
    return FlushResult(flushed=msg.flushed, message=msg.message)


def _usage(msg: pb.GenerateResponse) -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        cached_tokens=msg.cached_tokens,
        cached_host_tokens=msg.cached_tokens_details.host,
        cached_storage_tokens=msg.cached_tokens_details.storage,
    )


def _timings(t: pb.Timings) -> Timings:
    return Timings(t.queue_time, t.prefill_time, t.decode_time, t.total_time)


def _logprob(lp: pb.TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(a.token_id, a.logprob) for a in lp.top)
    return TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top)
