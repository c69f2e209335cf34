"""What batches cost on the worker, from the forward times it reports: the stall-free
prefill budget of a mixed batch.

A mixed batch is every decoding request's next token plus a slice of prefill. It takes
about one decode step (bound by reading the weights and the KV) plus the slice's compute,
so a fixed slice (``--mixed-prefill-tokens`` 128) that is cheap on one model is a stall
on another. On the 2-core CPU, the peers' small model decodes 16 streams in ~20 ms a step
and 128 prefill tokens add ~33 ms; the Qwen2-0.5B-shaped one decodes 8 streams in ~108 ms
and 128 tokens add ~440 ms, so every mixed step was 5x a decode step and the streams' p99
inter-token latency 4x their median (issue 18's prefill-stall workload, docs/benchmarks.md).

So, as Sarathi-Serve sizes its token budget from the inter-token latency the decoding
requests may suffer, the slice is also capped by time: at most ``(slowdown - 1)`` decode
steps' worth of prefill, from two running estimates (exponential averages of the worker's
``forward_time``): a decode step, and a prefill token (a prefill batch's time per token; a
mixed batch's time less a decode step, per token). Until both are known the fixed budget
holds; it is always the ceiling. Plain numbers, no tensors: the scheduler's own business.

Measured on the 2-core Xeon, the prefill-stall workload through ``radixserve bench`` (8
streams of 288 + 64 tokens, then 4 prompts of 1,000 tokens), Qwen2-0.5B shape: with 128
tokens a mixed step took 480-650 ms beside 101-118 ms decode steps, p99 / p50 of the
streams' inter-token latency 2.7-4.0; with ``--mixed-step-slowdown 3`` the steps carry ~45-70
tokens, take 150-430 ms, and p99 / p50 is 1.36-1.46 (the prompts' own time to first token
and the workload's wall time grow: 31.6 -> 32.9-36.9 s, smaller GEMMs per step). The
small model (16 streams, 8 prompts) keeps 128: a 128-token mixed step is ~2.6 decode steps.
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
