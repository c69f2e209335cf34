"""What the client returns: plain frozen dataclasses, so callers never touch protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    """Token counts of one request; ``cached_tokens`` of the prompt came from the radix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Of cached_tokens, those loaded back from the hierarchical cache's host / storage tier.
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0

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
