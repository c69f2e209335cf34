"""The stall-free prefill budget of a mixed batch, from the worker's forward times: as in
Sarathi-Serve, capped at ``(slowdown - 1)`` decode steps' worth (a fixed slice cheap on
one model stalls the streams on another).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.2  # follows a changed batch in a few steps; one slow step moves it little
MIN_TOKENS = 16  # arrivals always progress, however slow prefill is


def _average(old: float, new: float) -> float:
    return new if old <= 0.0 else old + SMOOTHING * (new - old)


@dataclass
class StepCosts:
    """Running estimates of a decode step's time and a prefill token's, in seconds."""

    decode_s: float = 0.0
    token_s: float = 0.0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """``decode_rows`` and ``prefill_tokens`` ran in ``seconds`` (0: not reported)."""
        if not 0.0 < seconds < math.inf or (decode_rows <= 0 and prefill_tokens <= 0):
            return
        if prefill_tokens <= 0:
            self.decode_s = _average(self.decode_s, seconds)
            return
        if decode_rows > 0 and self.decode_s <= 0.0:
            return  # a mixed batch before any decode step: nothing to take off yet
        rest = seconds - (self.decode_s if decode_rows > 0 else 0.0)
        self.token_s = _average(self.token_s, max(rest, 0.0) / prefill_tokens)

    def mixed_budget(self, slowdown: float, ceiling: int) -> int:
        """Prefill tokens so a mixed batch takes at most ``slowdown`` decode steps: at most
        ``ceiling`` (also when an estimate is missing or slowdown <= 1), at least MIN_TOKENS."""
        if slowdown <= 1.0 or self.decode_s <= 0.0 or self.token_s <= 0.0:
            return ceiling
        fits = (slowdown - 1.0) * self.decode_s / self.token_s
        if not fits < ceiling:  # also an overflow to inf
            return ceiling
        return max(int(fits), min(MIN_TOKENS, ceiling))
