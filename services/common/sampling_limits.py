"""The bounds of sampling parameters, in one place for every process that checks them.

The frontend checks the public SamplingParams (services/frontend/validation.py); the
scheduler checks the engine's copy of a request that may not have come through a frontend
(services/scheduler/request_checks.py). Both messages name these fields alike, so one
function serves both; no torch, no protobuf types imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20


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
    if sp.HasField("max_tokens") and sp.max_tokens < 1:
        return "sampling.max_tokens", f"must be >= 1, got {sp.max_tokens}"
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
    return None
