"""What the client returns: plain frozen dataclasses, so callers never touch protobuf."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from radixserve.client.errors import RadixServeError
from radixserve.v1 import generation_pb2 as pb

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    """Token counts of one request; ``cached_tokens`` of the prompt came from the radix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Seconds in each phase, as the server measured them."""

    queue_time: float
    prefill_time: float
    decode_time: float
    total_time: float


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and, when top_logprobs was asked for, the best alternatives."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the tokens and text new since the previous one.

    The last chunk has ``finish_reason`` ("stop", "length" or "abort"), ``usage`` and
    ``timings``; on earlier ones they are None. With ``prompt_logprobs=True`` the first chunk
    carries them: entry k scores the prompt token at ``prompt_logprobs_start + k``.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    matched_stop: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_start: int = 0


@dataclass(frozen=True)
class Completion(Generic[T]):
    """A whole generation.

    ``parsed`` is the structured output (a dict, a pydantic model or dataclass instance, ...)
    when ``structured_output=`` was given, else None. ``logprobs`` is empty unless asked for,
    and so is ``prompt_logprobs``: the logprob of each prompt token from
    ``prompt_logprobs_start`` on (at least 1: the first token has nothing before it), given
    all the tokens before it, with ``top_logprobs`` alternatives each.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    matched_stop: str | None
    usage: Usage
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] = ()
    parsed: T = field(default=None)  # type: ignore[assignment]
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_start: int = 0


@dataclass(frozen=True)
class Tokens:
    """A tokenized prompt: the ids and their token strings (for reading)."""

    ids: tuple[int, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    page_size: int
    max_total_num_tokens: int
    num_engines: int
    architecture: str


@dataclass(frozen=True)
class FlushResult:
    """``flushed`` is False when the server refused (requests running); ``message`` says why."""

    flushed: bool
    message: str


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


def with_parsed(c: Completion[None], parsed: T) -> Completion[T]:
    """The same completion carrying its structured output."""
    return Completion(
        request_id=c.request_id,
        text=c.text,
        token_ids=c.token_ids,
        finish_reason=c.finish_reason,
        matched_stop=c.matched_stop,
        usage=c.usage,
        timings=c.timings,
        logprobs=c.logprobs,
        parsed=parsed,
        prompt_logprobs=c.prompt_logprobs,
        prompt_logprobs_start=c.prompt_logprobs_start,
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
    )


def _timings(t: pb.Timings) -> Timings:
    return Timings(t.queue_time, t.prefill_time, t.decode_time, t.total_time)


def _logprob(lp: pb.TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(a.token_id, a.logprob) for a in lp.top)
    return TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top)
