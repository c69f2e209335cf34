"""Which of two ways to run a step delivers more tokens per second, by measuring both.

Used where the answer depends on the model, the batch and the machine and is only known by
trying: the scheduler's speculation gate (verify drafts, or run the step plain) and the CPU
worker's thread count (every thread, or one fewer beside processes that want a core).

A way's goodput is the mean tokens of its last WINDOW steps over their median period. A
step's period is the time between two results of the same way back to back (or, for a first
way whose steps nothing overlaps, after a result of either way), so it holds all the step
costs of the loop (the forward and the host work around it); the median, because a period
also holds whatever else happened in it, which now and then makes one many times longer.
Kept per batch size bucket (powers of two). The way not chosen is measured again now and
then, a few steps long: after EXPLORE_EVERY steps of the other while the two are close, more
rarely the further apart they are (each look costs steps of the worse way).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 16  # steps of a way whose median rate a bucket keeps
MIN_STEPS = 3  # steps of each way measured before they are compared
EXPLORE_EVERY = 32  # steps of one way in a row before the other is measured again
MAX_EXPLORE_EVERY = 512  # the same when one way is far ahead (interval x ratio squared)


def bucket(batch: int) -> int:
    return max(batch, 1).bit_length()


def explore_interval(
    a: float, b: float, every: int = EXPLORE_EVERY, most: int = MAX_EXPLORE_EVERY
) -> int:
    """Steps of the better way before the other is measured again."""
    ratio = max(a, b) / max(min(a, b), 1e-12)
    return int(min(most, every * ratio * ratio))


@dataclass
class Goodput:
    """One way's last steps, as (period seconds, tokens) each. Its rate is their mean tokens
    over their median period: the median keeps a period that other work held up from
    counting; the mean counts tokens as delivered (a verify step commits 1 token or 1 + k,
    so a median of per-step rates reads mostly-refused steps as the whole way)."""

    steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float, tokens: float) -> None:
        if seconds > 0:
            self.steps.append((seconds, tokens))

    @property
    def rates(self) -> list[float]:
        """Each step's own tokens per second (what the rate is made of, for reading)."""
        return [t / s for s, t in self.steps]

    @property
    def known(self) -> bool:
        return len(self.steps) >= MIN_STEPS

    @property
    def rate(self) -> float:
        tokens = statistics.fmean(t for _, t in self.steps)
        return tokens / statistics.median(s for s, _ in self.steps)


@dataclass
class GoodputChoice:
    """The first way or the second, per batch size bucket. A bucket measures the first way
    first (``follow``: the way the busiest measured bucket chose, so that a new batch size
    runs like the steps around it while the other way is measured).

    ``explore_calls``: how many ``first()`` calls a look at the other way lasts; enough that
    two steps of it run back to back (one period) however often a step asks. ``margin``:
    how many times the first way's rate the second must measure to be chosen (> 1 where the
    first is the safe default and a wrong switch costs more than a missed one).
    ``explore_every``, ``max_explore_every``: explore_interval's bounds.
    ``first_after_any``: a step of the first way is measured after a step of either way,
    where its period is the same whatever ran before it (a verify step, which nothing
    overlaps); else, as always for the second way, only after a step of its own way.
    ``first_down``: a bucket that does not know both ways yet runs the first way where the
    nearest larger bucket that does chose it, the second way measured on its looks only: a
    batch draining to its last requests passes through smaller buckets for a few steps
    each, which measuring both ways first spent mostly on the second (verify steps gain
    more the smaller the batch, so a larger batch's verdict for them holds)."""

    explore_calls: int = 2
    margin: float = 1.0
    explore_every: int = EXPLORE_EVERY
    max_explore_every: int = MAX_EXPLORE_EVERY
    follow: bool = False
    first_after_any: bool = False
    first_down: bool = False
    clock: Callable[[], float] = field(default_factory=lambda: time.perf_counter)
    firsts: dict[int, Goodput] = field(default_factory=dict)
    seconds: dict[int, Goodput] = field(default_factory=dict)
    seen: Counter[int] = field(default_factory=Counter)  # first() calls per bucket
    streak: int = 0  # first() answers in a row that chose the measured-better way
    exploring: int = 0  # first() calls left that answer the other way
    _last: tuple[bool, float] | None = None

    def observe(self, first: bool | None, batch: int, tokens: int) -> None:
        """A step of ``batch`` that delivered ``tokens`` ended just now, run the first way,
        the second, or neither (None: a step of another kind breaks the chain)."""
        now = self.clock()
        last, self._last = self._last, (None if first is None else (first, now))
        if first is None or last is None:
            return
        if last[0] is not first and not (first and self.first_after_any):
            return
        table = self.firsts if first else self.seconds
        table.setdefault(bucket(batch), Goodput()).add(now - last[1], tokens)

    def idle(self) -> None:
        """The loop went idle: the next result starts a new chain."""
        self._last = None

    def refresh(self) -> None:
        """What runs next may differ from what was measured (a new workload after a pause):
        each way keeps only its newest MIN_STEPS // 2 rates and is measured again until
        known, so the new steps are most of each median (else a window full of another
        workload's steps keeps deciding for hundreds of steps)."""
        for table in (self.firsts, self.seconds):
            for g in table.values():
                while len(g.steps) > MIN_STEPS // 2:
                    g.steps.popleft()

    def ratio(self, b: int) -> float | None:
        """The second way's rate over the first's in bucket b; None until both known."""
        one, two = self.firsts.get(b), self.seconds.get(b)
        if one is None or not one.known or two is None or not two.known:
            return None
        return two.rate / max(one.rate, 1e-12)  # a way that delivered nothing: 0

    def leaning(self, batch: int) -> bool | None:
        """Which way the measurements favour for ``batch`` (True: the first), None while
        unknown; asks nothing of the exploring (first() does)."""
        ratio = self.ratio(bucket(batch))
        return None if ratio is None else ratio < self.margin

    def _lean(self) -> bool:
        """The way the busiest bucket that knows both chose (``follow``), else the first."""
        known = [b for b in self.firsts.keys() & self.seconds.keys() if self.ratio(b) is not None]
        if not self.follow or not known:
            return True
        ratio = self.ratio(max(known, key=self.seen.__getitem__))
        return ratio is not None and ratio < self.margin

    def _first_above(self, b: int) -> float | None:
        """The ratio of the nearest larger bucket that knows both ways, if it chose the
        first way (first_down)."""
        for k in sorted(self.firsts.keys() & self.seconds.keys()):
            if k > b and (ratio := self.ratio(k)) is not None:
                return ratio if ratio < self.margin else None
        return None

    def first(self, batch: int) -> bool:
        """Whether the next step of ``batch`` runs the first way."""
        b = bucket(batch)
        self.seen[b] += 1
        ratio = self.ratio(b)
        if ratio is None and self.first_down:
            ratio = self._first_above(b)
        if ratio is None:  # measure both ways, in the order _lean gives
            one, two = self.firsts.get(b), self.seconds.get(b)
            if self._lean():
                return one is None or not one.known
            return two is not None and two.known
        best = ratio < self.margin
        if self.exploring:
            self.exploring -= 1
            return not best
        self.streak += 1
        every = explore_interval(1.0, ratio, self.explore_every, self.max_explore_every)
        if self.streak >= every:  # things drift: look again
            self.streak, self.exploring = 0, self.explore_calls - 1
            return not best
        return best
