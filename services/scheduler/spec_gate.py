"""Whether decode steps verify drafts at all: only while verify steps bring more tokens per
second than plain ones (goodput), as measured here.

A verify step costs more than a plain one: 1 + k rows per request, the proposals, and the
overlap schedule pauses behind it. Where the step is bound by host work (a small model on a
CPU, a large batch) or drafts are mostly refused, that cost can exceed what the accepted
drafts save; steps then run plain. Each request's own draft length still adapts on its own
(spec_drafts.AdaptiveLength); the gate judges the steps as a whole, by what they delivered.

How the two are measured and compared: services/common/goodput.py (verify steps are the
first way, plain ones the second).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from services.common.goodput import Goodput, GoodputChoice

GATES = ("goodput", "always")
# worth() calls an exploration lasts: the lookahead's and the build's of one step, and one
# more, so that two steps of the explored mode run back to back (one period).
EXPLORE_CALLS = 3
# An engine idle this long starts again with its measurements thinned (GoodputChoice.refresh):
# the next requests may be another workload, whose drafts pay more or less.
REFRESH_AFTER_IDLE_S = 0.5


def gate_names() -> list[str]:
    return list(GATES)


class StepKind(Enum):
    PLAIN = "plain"  # decode rows only, no drafts
    VERIFY = "verify"  # decode rows, some with drafts
    OTHER = "other"  # any prefill rows: breaks the chain of periods


@dataclass
class SpecGate:
    """``always``: every step verifies what was drafted (nothing measured)."""

    mode: str = "goodput"
    clock: Callable[[], float] = field(default_factory=lambda: time.perf_counter)
    verify: dict[int, Goodput] = field(default_factory=dict)
    plain: dict[int, Goodput] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in GATES:
            raise ValueError(
                f"speculative_gate must be one of {', '.join(GATES)}, got {self.mode!r}"
            )
        # A verify step's period after a plain step is its whole cost, as after a verify
        # step: nothing is queued behind a plain step when the next one verifies. So verify
        # steps that come only now and then (a draft here and there) are measured too.
        # A batch draining to its last requests verifies in the smaller buckets where a
        # larger one found verify steps worth it, instead of first measuring plain ones in
        # each (first_down).
        self.choice = GoodputChoice(
            EXPLORE_CALLS, clock=self.clock, firsts=self.verify, seconds=self.plain,
            first_after_any=True, first_down=True,
        )  # fmt: skip
        self._idle_since: float | None = None

    def observe(self, kind: StepKind, batch: int, tokens: int) -> None:
        """A result of ``batch`` decode rows that committed ``tokens`` came back just now."""
        if self.mode != "goodput":
            return
        if self._idle_since is not None:  # the first result since the engine went idle
            if self.clock() - self._idle_since >= REFRESH_AFTER_IDLE_S:
                self.choice.refresh()
            self._idle_since = None
        way = None if kind is StepKind.OTHER else kind is StepKind.VERIFY
        self.choice.observe(way, batch, tokens)

    def idle(self) -> None:
        """The loop went idle: the next result starts a new chain."""
        self.choice.idle()
        if self._idle_since is None:
            self._idle_since = self.clock()

    def verifying(self, batch: int) -> bool:
        """Whether steps of ``batch`` verify as things stand (unknown: yes)."""
        return self.mode != "goodput" or self.choice.leaning(batch) is not False

    def worth(self, batch: int) -> bool:
        """Whether the next step of ``batch`` decode rows, some with drafts, verifies them."""
        return self.mode != "goodput" or self.choice.first(batch)
