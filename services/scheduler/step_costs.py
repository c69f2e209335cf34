"""What batches cost on the worker, from the forward times it reports: the stall-free
prefill budget of a mixed batch.

A mixed batch is every decoding request's next token plus a slice of prefill. It takes
about one decode step (bound by reading the weights and the KV) plus the slice's compute,
so a fixed slice (``--mixed-prefill-tokens`` 128) that is cheap on one model is a stall
on another: on a CPU, 128 prefill tokens cost a small model less than two decode steps and
a 0.5B model about four, and the streams' inter-token latency swings with them.

So, as Sarathi-Serve sizes its token budget from the inter-token latency the decoding
requests may suffer, the slice is also capped by time: at most ``(slowdown - 1)`` decode
steps' worth of prefill, from two running estimates (exponential averages of the worker's
``forward_time``): a decode step, and a prefill token (a prefill batch's time per token; a
mixed batch's time less a decode step, per token). Until both are known the fixed budget
holds; it is always the ceiling. Plain numbers, no tensors: the scheduler's own business.
Measured (the prefill-stall workload): docs/benchmarks-history.md, item 13.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest batch in the running averages: a few steps follow a change in the
# batch (requests joining or leaving) while one slow step (the machine busy) moves it little.
SMOOTHING = 0.2
# The fewest prefill tokens a mixed batch carries however slow prefill is: arrivals always
# progress, even when one token costs more than the allowed slowdown.
MIN_TOKENS = 16


def _average(old: float, new: float) -> float:
    return new if old <= 0.0 else old + SMOOTHING * (new - old)


@dataclass
class StepCosts:
    """Running estimates of a decode step's time and a prefill token's, in seconds."""

    decode_s: float = 0.0
    token_s: float = 0.0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One batch came back: ``decode_rows`` decoding requests and ``prefill_tokens``
        new prompt tokens ran in ``seconds`` of forward time (0: not reported; ignored)."""
        if not 0.0 < seconds < math.inf or (decode_rows <= 0 and prefill_tokens <= 0):
            return  # NaN, infinite or absent: the worker's word is not trusted blindly
        if prefill_tokens <= 0:
            self.decode_s = _average(self.decode_s, seconds)
            return
        if decode_rows > 0 and self.decode_s <= 0.0:
            return  # a mixed batch before any decode step: nothing to take off yet
        rest = seconds - (self.decode_s if decode_rows > 0 else 0.0)
        self.token_s = _average(self.token_s, max(rest, 0.0) / prefill_tokens)

    def mixed_budget(self, slowdown: float, ceiling: int) -> int:
        """Prefill tokens a mixed batch may carry so that it takes about ``slowdown``
        decode steps at most: ``ceiling`` when that allows more, when either estimate is
        missing or when ``slowdown`` is off (<= 1); never fewer than MIN_TOKENS (unless
        the ceiling itself is lower)."""
        if slowdown <= 1.0 or self.decode_s <= 0.0 or self.token_s <= 0.0:
            return ceiling
        fits = (slowdown - 1.0) * self.decode_s / self.token_s
        if not fits < ceiling:  # also an overflow to inf
            return ceiling
        return max(int(fits), min(MIN_TOKENS, ceiling))
