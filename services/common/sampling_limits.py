"""The bounds of sampling parameters, in one place for every process that checks them.

Frontend and scheduler both check (a request need not come through a frontend); their
SamplingParams name the fields alike, so one function serves both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 128  # the engine's max_tokens when a request leaves it unset
# logit_bias: entries at most (each costs the worker a scatter per step), and OpenAI's range.
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_RANGE = 100.0


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool = False  # (lo, ...] instead of [lo, ...]

    def holds(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        return math.isfinite(x) and above and x <= self.hi

    def text(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


FLOAT_RANGES = {
    "temperature": Range(0, 100),
    "top_p": Range(0, 1, lo_open=True),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, 2, lo_open=True),
    "frequency_penalty": Range(-2, 2),
    "presence_penalty": Range(-2, 2),
}


def sampling_bound_problem(sp: Any) -> tuple[str, str] | None:
    """(field, what is wrong) for the first set field out of bounds, else None. ``sp`` is
    either proto's SamplingParams (the same names on both)."""
    if sp.HasField("max_tokens") and sp.max_tokens < 0:
        # 0 is valid: prefill only (prompt logprobs, cache warming); nothing is sampled.
        return "sampling.max_tokens", f"must be >= 0 (0 = prefill only), got {sp.max_tokens}"
    for name, rng in FLOAT_RANGES.items():
        if sp.HasField(name) and not rng.holds(getattr(sp, name)):
            return f"sampling.{name}", f"must be in {rng.text()}, got {getattr(sp, name):g}"
    if sp.HasField("top_k") and sp.top_k < 0:
        return "sampling.top_k", f"must be >= 0 (0 = off), got {sp.top_k}"
    if sp.HasField("top_logprobs") and not 0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS:
        return (
            "sampling.top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {sp.top_logprobs}",
        )
    if sp.HasField("min_tokens"):
        problem = _min_tokens_problem(
            sp.min_tokens, sp.max_tokens if sp.HasField("max_tokens") else None
        )
        if problem:
            return "sampling.min_tokens", problem
    if sp.HasField("prompt_logprobs_start") and sp.prompt_logprobs_start < 0:
        return (
            "sampling.prompt_logprobs_start",
            f"must be >= 0, got {sp.prompt_logprobs_start}",
        )
    problem = logit_bias_problem(sp.logit_bias)
    return ("sampling.logit_bias", problem) if problem else None


def logit_bias_problem(entries: Any) -> str:
    """What is wrong with LogitBias entries (the vocabulary aside: each side knows its own)."""
    if len(entries) > MAX_LOGIT_BIAS:
        return f"at most {MAX_LOGIT_BIAS} entries, got {len(entries)}"
    seen: set[int] = set()
    for e in entries:
        if not (math.isfinite(e.bias) and abs(e.bias) <= LOGIT_BIAS_RANGE):
            return (
                f"the bias of token {e.token_id} must be in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {e.bias:g}"
            )
        if e.token_id in seen:
            return f"token {e.token_id} is given twice"
        seen.add(e.token_id)
    return ""


def _min_tokens_problem(min_tokens: int, max_tokens: int | None) -> str:
    """The floor must fit under the ceiling (the engine's default when max_tokens is unset)."""
    if min_tokens < 0:
        return f"must be >= 0, got {min_tokens}"
    limit = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if min_tokens > limit:
        which = "max_tokens" if max_tokens is not None else "the default max_tokens"
        return f"must be <= {which} ({limit}), got {min_tokens}"
    return ""


def prompt_logprobs_start_problem(sp: Any, prompt_len: int) -> tuple[str, str] | None:
    """The start must name a prompt position (checked once the prompt is tokenized)."""
    start = sp.prompt_logprobs_start if sp.HasField("prompt_logprobs_start") else 0
    if start >= prompt_len:
        return (
            "sampling.prompt_logprobs_start",
            f"must be < the prompt length ({prompt_len} tokens), got {start}",
        )
    return None
