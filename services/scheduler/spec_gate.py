"""Whether decode steps verify drafts at all: only while verify steps bring more tokens per
second than plain ones (goodput), as measured here.

A verify step costs more than a plain one: 1 + k rows per request, the proposals, and the
overlap schedule pauses behind it. Where the step is bound by host work (a small model on a
CPU, a large batch) or drafts are mostly refused, that cost can exceed what the accepted
drafts save; steps then run plain. Each request's own draft length still adapts on its own
(spec_drafts.AdaptiveLength); the gate judges the steps as a whole, by what they delivered.

Each mode's goodput is the median tokens per second of its last WINDOW steps: a step's
period is the time between two results of the same mode back to back (plain after plain,
verify after verify), so it holds all a step costs the loop: the forward, the scheduler's
work, and for a plain step whatever the overlap hid. The median, because a period also
holds whatever else the loop did in it (requests arriving, ending, aborted), which now and
then makes one many times longer. Kept per batch size bucket (powers of two). The mode not
chosen is measured again now and then, a few steps long: after EXPLORE_EVERY steps of the
other while the two are close, more rarely the further apart they are (each look costs
steps of the worse mode).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

GATES = ("goodput", "always")
WINDOW = 16  # steps of a mode whose median rate a bucket keeps
MIN_STEPS = 3  # steps of each mode measured before the gate compares them
EXPLORE_EVERY = 32  # steps of one mode in a row before the other is measured again
MAX_EXPLORE_EVERY = 512  # the same when one mode is far ahead (interval x ratio squared)
# worth() calls an exploration lasts: the lookahead's and the build's of one step, and one
# more, so that two steps of the explored mode run back to back (one period).
EXPLORE_CALLS = 3


def gate_names() -> list[str]:
    return list(GATES)


class StepKind(Enum):
    PLAIN = "plain"  # decode rows only, no drafts
    VERIFY = "verify"  # decode rows, some with drafts
    OTHER = "other"  # any prefill rows: breaks the chain of periods


def bucket(batch: int) -> int:
    return max(batch, 1).bit_length()


def explore_interval(a: float, b: float) -> int:
    """Steps of the better mode before the other is measured again."""
    ratio = max(a, b) / max(min(a, b), 1e-12)
    return int(min(MAX_EXPLORE_EVERY, EXPLORE_EVERY * ratio * ratio))


@dataclass
class Goodput:
    """One mode's last steps, as tokens per second each."""

    rates: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float, tokens: int) -> None:
        if seconds > 0:
            self.rates.append(tokens / seconds)

    @property
    def known(self) -> bool:
        return len(self.rates) >= MIN_STEPS

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


@dataclass
class SpecGate:
    """``always``: every step verifies what was drafted (nothing measured)."""

    mode: str = "goodput"
    clock: Callable[[], float] = field(default_factory=lambda: time.perf_counter)
    plain: dict[int, Goodput] = field(default_factory=dict)
    verify: dict[int, Goodput] = field(default_factory=dict)
    streak: int = 0  # worth() answers in a row that chose the measured-better mode
    exploring: int = 0  # worth() calls left that answer the other mode
    _last: tuple[StepKind, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in GATES:
            raise ValueError(
                f"speculative_gate must be one of {', '.join(GATES)}, got {self.mode!r}"
            )

    def observe(self, kind: StepKind, batch: int, tokens: int) -> None:
        """A result of ``batch`` decode rows that committed ``tokens`` came back just now."""
        now = self.clock()
        last, self._last = self._last, (kind, now)
        if self.mode != "goodput" or last is None or kind is StepKind.OTHER or last[0] is not kind:
            return
        table = self.verify if kind is StepKind.VERIFY else self.plain
        table.setdefault(bucket(batch), Goodput()).add(now - last[1], tokens)

    def idle(self) -> None:
        """The loop went idle: the next result starts a new chain."""
        self._last = None

    def worth(self, batch: int) -> bool:
        """Whether the next step of ``batch`` decode rows, some with drafts, verifies them."""
        if self.mode != "goodput":
            return True
        b = bucket(batch)
        verify, plain = self.verify.get(b), self.plain.get(b)
        if verify is None or not verify.known:
            return True  # measure verify steps first
        if plain is None or not plain.known:
            return False  # then plain ones
        best = verify.rate > plain.rate
        if self.exploring:
            self.exploring -= 1
            return not best
        self.streak += 1
        if self.streak >= explore_interval(verify.rate, plain.rate):  # things drift: look again
            self.streak, self.exploring = 0, EXPLORE_CALLS - 1
            return not best
        return best
